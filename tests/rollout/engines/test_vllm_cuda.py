"""The vLLM engine against vLLM's CUDA build faked on CPU (``tests/fake_vllm.py``: CUDA mocked, a ``vllm.LLM`` that
schedules, caches and starts as the CUDA build does): asynchronous scheduling and the engine's sessions, the
prefix-cache reset after an in-flight update, the engine's arguments under each GPU binding of the launcher, the
MoE kernel of engines the reshard plan writes in place, and the switch of the batch-invariant mode
(docs/verification.md, "Behaviour only CUDA shows")."""

from __future__ import annotations

import os

import pytest
import torch

from fake_vllm import async_scheduling, fake_cuda_vllm
from mcpo_megatron.models.tiny import make_tiny_hf_model
from mcpo_megatron.rollout.engines.interface import GenerationInterrupted, SamplingParams, sample_seed
from mcpo_megatron.rollout.engines.records import SequenceRecord
from mcpo_megatron.rollout.partial.segments import GroupWork, PartialRequest, generate_partial
from mcpo_megatron.rollout.engines.vllm.engine import VLLMRolloutEngine

EOS = 2  # the tiny models' eos_token_id
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
SAMPLING = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=3)
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "CUDA_VISIBLE_DEVICES")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_tiny_hf_model("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


def engine(model_dir, **settings) -> VLLMRolloutEngine:
    """A vLLM engine built as the trainer builds one (``vllm.LLM`` faked), colocated unless ``standalone``."""
    return VLLMRolloutEngine(model_dir, eos_token_ids=[EOS], **settings)


def fresh_records():
    records = [SequenceRecord(j, i, sample_seed(SAMPLING.seed, j, i)) for j in range(len(PROMPTS))
               for i in range(SAMPLING.n)]
    return [PROMPTS[r.prompt_index] for r in records], records


def weights_of(record) -> list[int]:
    """The weights' version that computed each token (the fake's log-prob is -(1 + version))."""
    return [round(-lp - 1) for lp in record.logprobs]


def update_weights(eng) -> None:
    """A weight update through vLLM's layerwise reload (the fake's model has no weight target)."""
    eng.begin_update()
    eng.update_weights([("model.norm.weight", torch.ones(4))])
    eng.finish_update()


# ------------------------------------------------------------------------------- asynchronous scheduling
def test_the_fake_schedules_as_vllm_decides(monkeypatch):
    """The fake's rule is vLLM's default (config/vllm.py 1585-1644): on for CUDA's executors, off on CPU, with Ray,
    pipeline parallelism on the V1 model runner, a pooling runner or a speculative method outside EAGLE's family."""
    assert async_scheduling({"distributed_executor_backend": "external_launcher"})
    assert async_scheduling({}) and not async_scheduling({}, platform="cpu")
    assert not async_scheduling({"async_scheduling": False})
    assert not async_scheduling({"distributed_executor_backend": "ray"})
    assert async_scheduling({"pipeline_parallel_size": 2})
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert not async_scheduling({"pipeline_parallel_size": 2})
    assert not async_scheduling({"speculative_config": {"method": "suffix"}})
    assert async_scheduling({"speculative_config": {"method": "eagle3"}})
    assert async_scheduling({"speculative_config": {"method": "deepseek_mtp"}})


def test_segments_of_one_step_on_a_stepped_engine(monkeypatch, dense):
    """rollout.partial.segment_tokens=1: every segment adds a token to every running record, and the records equal
    one generate() of the same seeds. Under vLLM's default asynchronous scheduling the first step returns nothing
    (the batch queue holds it) and the batch raised "added no token ... lost them"."""
    built = fake_cuda_vllm(monkeypatch)
    eng = engine(dense)
    ref = eng.generate(PROMPTS, SAMPLING)
    groups = [GroupWork(j, PROMPTS[j], [SequenceRecord(j, i, sample_seed(SAMPLING.seed, j, i))
                                        for i in range(SAMPLING.n)]) for j in range(len(PROMPTS))]
    request = PartialRequest(key=0, groups=groups, need=len(groups), sampling=SAMPLING, segment_tokens=1)
    out = generate_partial(eng, request, version=0)
    records = [r for group in out.members for r in group]
    assert [r.token_ids for r in records] == ref.token_ids and [r.logprobs for r in records] == ref.logprobs
    assert [r.finish_reason for r in records] == ref.finish_reasons
    assert out.segments == max(len(t) for t in ref.token_ids)  # one token per segment, none late
    assert built[0]["async_scheduling"] is False and not eng.llm.async_scheduling


def test_versions_of_tokens_across_an_in_flight_update(monkeypatch, dense):
    """An update between two segments of a running session (in-flight, docs/algorithms.md §13.2): each token is
    stamped with the version of the weights that computed it, and a segment of k steps adds k tokens. With the
    batch queue, the first token after the update was computed by the old weights (its batch was scheduled before
    it) and stamped with the new version, and the first segment added one token less."""
    fake_cuda_vllm(monkeypatch)
    eng = engine(dense)
    prompts, records = fresh_records()
    session = eng.open_session(prompts, records, SAMPLING)
    session.step(2, version=0)
    update_weights(eng)
    session.step(3, version=1)
    out = session.close()
    for r in out:
        assert r.versions == weights_of(r), (r.versions, weights_of(r))
        # every record samples its stop token after 2 to 8 tokens
        assert r.versions[:2] == [0, 0] and r.versions[2:] == [1] * min(3, len(r.token_ids) - 2)


def test_a_standalone_engine_keeps_vllms_scheduling_and_its_loop_is_exact(monkeypatch, dense):
    """mcpo eval's engine (vLLM's own executor, generate() only) keeps vLLM's default, asynchronous scheduling on
    CUDA: the offline loop steps until no request is unfinished, so the one-step lag changes no output, and a stop
    between steps still aborts every request."""
    built = fake_cuda_vllm(monkeypatch)
    alone = engine(dense, standalone=True)
    assert "async_scheduling" not in built[0] and alone.llm.async_scheduling
    stepped = engine(dense)
    assert not stepped.llm.async_scheduling
    out, ref = alone.generate(PROMPTS, SAMPLING), stepped.generate(PROMPTS, SAMPLING)
    assert out.token_ids == ref.token_ids and out.logprobs == ref.logprobs and out.finish_reasons == ref.finish_reasons
    assert alone.llm.llm_engine.steps == stepped.llm.llm_engine.steps + 1  # the lag: one step more in all
    polls = []
    with pytest.raises(GenerationInterrupted, match="6 of 6 requests unfinished"):
        alone.generate(PROMPTS, SAMPLING, should_stop=lambda: polls.append(1) or len(polls) > 1)
    assert not alone.llm.llm_engine.has_unfinished_requests()
    assert alone.generate(PROMPTS, SAMPLING).token_ids == ref.token_ids


def test_engine_kwargs_cannot_turn_asynchronous_scheduling_on(monkeypatch, dense):
    fake_cuda_vllm(monkeypatch)
    with pytest.raises(ValueError, match=r"rollout.engine_kwargs.async_scheduling=True: an engine in the training "
                                         r"processes is stepped by the trainer"):
        engine(dense, extra={"async_scheduling": True})
    assert engine(dense, extra={"async_scheduling": False}).llm.kwargs["async_scheduling"] is False
    assert engine(dense, standalone=True, extra={"async_scheduling": True}).llm.async_scheduling


# ------------------------------------------------------------------------------- the prefix cache
def test_a_prefix_cache_reset_refused_during_a_session_happens_at_the_next_one(monkeypatch, dense):
    """vLLM refuses to reset the prefix cache while requests hold blocks (v1/core/block_pool.py 837-844): after an
    in-flight update through the layerwise reload the reset waits for the next session, which must not find blocks
    of the old weights. finish_update dropped the refusal, and the next session's requests met the old blocks."""
    fake_cuda_vllm(monkeypatch)
    eng = engine(dense)
    prompts, records = fresh_records()
    session = eng.open_session(prompts, records, SAMPLING)
    session.step(2, version=0)
    update_weights(eng)
    assert eng.llm.resets == [False]  # requests of the session hold blocks
    session.step(2, version=1)
    left = [r for r in session.close() if not r.finished]
    assert left
    eng.open_session([PROMPTS[r.prompt_index] for r in left], left, SAMPLING).close()
    assert eng.llm.resets == [False, True] and eng.llm.stale_prefix_requests == []
    update_weights(eng)  # between sessions: reset at once
    assert eng.llm.resets == [False, True, True]


# ------------------------------------------------------------------------------- GPU bindings
def binding_env(binding: str, rank: int, ranks: int = 8) -> tuple[dict, int]:
    """The launcher's variables for global rank ``rank`` of one node of ``ranks`` ranks, and the CUDA devices the
    process sees (parallel/gpu_binding.py): torchrun (every GPU visible), srun with one GPU per task, srun with
    4 GPUs shared by 4 consecutive tasks (the GPUs close to each task's cores)."""
    if binding == "torchrun":
        return dict(RANK=rank, WORLD_SIZE=ranks, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=ranks), ranks
    env = dict(SLURM_PROCID=rank, SLURM_NTASKS=ranks, SLURM_LOCALID=rank, SLURM_NTASKS_PER_NODE=ranks)
    if binding == "one GPU per task":
        return dict(env, CUDA_VISIBLE_DEVICES=rank), 1
    first = rank // 4 * 4
    return dict(env, CUDA_VISIBLE_DEVICES=",".join(str(first + k) for k in range(4))), 4


@pytest.mark.parametrize("binding,rollout_tp,local_rank,custom_all_reduce", [
    ("torchrun", 2, lambda r: r, True),
    ("torchrun", 8, lambda r: r, True),
    ("one GPU per task", 2, lambda r: 0, False),
    ("one GPU per task", 1, lambda r: 0, True),
    ("4 GPUs shared by 4 tasks", 2, lambda r: r % 4, True),
    ("4 GPUs shared by 4 tasks", 4, lambda r: r % 4, True),
    ("4 GPUs shared by 4 tasks", 8, lambda r: r % 4, False),
])
def test_engine_arguments_under_each_gpu_binding(monkeypatch, dense, binding, rollout_tp, local_rank,
                                                 custom_all_reduce):
    """Every rank of a node of 8 starts its engine (vLLM's worker takes cuda:LOCAL_RANK of the devices it sees, and
    custom all-reduce checks peer access by TP rank among them): custom all-reduce stays on where the visible GPUs
    hold whole TP groups, and is disabled where they do not. With one GPU per task and rollout TP=2, vLLM's own
    check raised IndexError at the start of every engine."""
    for rank in range(8):
        for var in LAUNCHER_VARS:
            monkeypatch.delenv(var, raising=False)
        env, gpus = binding_env(binding, rank)
        built = fake_cuda_vllm(monkeypatch, gpus=gpus)
        for var, value in env.items():
            monkeypatch.setenv(var, str(value))
        kw = engine(dense, rollout_tp=rollout_tp).llm.kwargs
        assert built == [kw]
        assert int(os.environ["LOCAL_RANK"]) == local_rank(rank)
        assert kw.get("disable_custom_all_reduce", False) is (not custom_all_reduce)


def test_a_visible_gpu_set_too_small_for_custom_all_reduce_is_not_overridden(monkeypatch, dense):
    fake_cuda_vllm(monkeypatch, gpus=1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    for var, value in dict(SLURM_PROCID=3, SLURM_NTASKS=8, SLURM_LOCALID=3, SLURM_NTASKS_PER_NODE=8).items():
        monkeypatch.setenv(var, str(value))
    with pytest.raises(ValueError, match="rollout.engine_kwargs.disable_custom_all_reduce=false: the GPUs this "
                                         "process sees do not hold whole tensor-parallel groups"):
        engine(dense, rollout_tp=2, extra={"disable_custom_all_reduce": False})


# ------------------------------------------------------------------------------- MoE kernels
@pytest.mark.parametrize("capability", [(10, 0), (9, 0)], ids=["blackwell", "hopper"])
def test_moe_engines_the_plan_writes_take_tritons_kernels(monkeypatch, tmp_path, dense, moe, capability):
    """The reshard plan writes vLLM's unquantized experts in place only in Triton's layout (rollout/engines/vllm/target.py);
    on Blackwell vLLM's default unquantized MoE kernel is FlashInfer's (fused_moe/oracle/unquantized.py 68-80: first
    in the list, moved back on Hopper only), so every update took the layerwise reload. Engines the trainer updates
    ask for Triton's (moe_backend, which vLLM's oracle maps to its TRITON backend, 308-316); a standalone engine, a
    dense model and a quantized one keep vLLM's choice, and an explicit rollout.engine_kwargs.moe_backend wins."""
    import dataclasses
    import json

    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (UnquantizedMoeBackend,
                                                                          map_unquantized_backend)

    from mcpo_megatron.rollout.engines.vllm.target import IN_PLACE, classify

    built = fake_cuda_vllm(monkeypatch, capability=capability)
    assert torch.cuda.get_device_capability() == capability
    assert engine(moe).llm.kwargs["moe_backend"] == "triton"
    assert "moe_backend" in {f.name for f in dataclasses.fields(EngineArgs)}
    assert map_unquantized_backend("triton") is UnquantizedMoeBackend.TRITON
    assert engine(moe, extra={"moe_backend": "flashinfer_trtllm"}).llm.kwargs["moe_backend"] == "flashinfer_trtllm"
    assert "moe_backend" not in engine(moe, standalone=True).llm.kwargs
    assert "moe_backend" not in engine(dense).llm.kwargs
    config = json.loads(open(os.path.join(moe, "config.json")).read())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, quantization_config={"quant_method": "fp8"})))
    assert "moe_backend" not in engine(str(tmp_path)).llm.kwargs
    assert len(built) == 5
    # the plan writes the experts of vLLM's unquantized method in place with Triton's backend only
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    method = UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod)
    method.unquantized_backend = UnquantizedMoeBackend.TRITON
    module = type("FusedMoE", (torch.nn.Module,), {})()
    module.quant_method = method
    assert classify(module, "w13_weight", cpu=False) == IN_PLACE
    method.unquantized_backend = UnquantizedMoeBackend.FLASHINFER_TRTLLM
    assert classify(module, "w13_weight", cpu=False) is None


# ------------------------------------------------------------------------------- batch-invariant mode
def test_batch_invariant_mode_is_switched_on_before_the_engine_is_built(monkeypatch, dense):
    """rollout.batch_invariant sets VLLM_BATCH_INVARIANT before vllm.LLM is built (vLLM reads it as its workers
    start and caches it with the engine); a process where vLLM already read another value is refused, as is the
    mode on vLLM's CPU build."""
    import vllm.envs as envs

    from mcpo_megatron.rollout.engines.vllm.args import EngineSettings, build_llm_kwargs

    seen = []
    fake_cuda_vllm(monkeypatch)
    monkeypatch.setattr("fake_vllm.FakeCudaLLM.__init__", _recording_env(seen))
    engine(dense, batch_invariant=True)
    assert seen == [("1", True)]
    engine(dense)
    assert seen[-1] == ("0", False)
    monkeypatch.setattr(envs, "VLLM_BATCH_INVARIANT", False, raising=False)  # as cached by an earlier engine
    with pytest.raises(RuntimeError, match="rollout.batch_invariant=true: vLLM already read VLLM_BATCH_INVARIANT=0 "
                                           "in this process"):
        engine(dense, batch_invariant=True)
    with pytest.raises(ValueError, match="rollout.batch_invariant=true needs vLLM's CUDA build"):
        build_llm_kwargs("/m", EngineSettings(max_model_len=64, kv_cache_bytes=1, batch_invariant=True), device="cpu")


def _recording_env(seen):
    import fake_vllm

    original = fake_vllm.FakeCudaLLM.__init__

    def init(self, **kwargs):
        import vllm.envs as envs

        seen.append((os.environ.get("VLLM_BATCH_INVARIANT"), bool(envs.VLLM_BATCH_INVARIANT)))
        original(self, **kwargs)

    return init
