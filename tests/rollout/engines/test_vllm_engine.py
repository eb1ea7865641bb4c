"""The vLLM wrapper's logic with fakes of vLLM's objects (the real engine: test_vllm_cpu.py).

Checks argument building (CUDA and CPU), KV-cache sizing, request building (per-sample
seeds, stop ids, processed log-probs), output conversion, the weight-update session
(start / chunks / finish + prefix-cache reset) and the sleep / wake-up protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from mcpo_megatron.rollout.engines.interface import SamplingParams, generate_data_parallel, sample_seed
from mcpo_megatron.rollout.engines.vllm.args import EngineSettings, build_llm_kwargs, kv_cache_bytes
from mcpo_megatron.rollout.engines.vllm.engine import VLLMRolloutEngine
from mcpo_megatron.rollout.engines.records import SequenceRecord, continuation_seed
from mcpo_megatron.rollout.engines.vllm.requests import build_requests, convert_outputs, routed_experts_record
from mcpo_megatron.rollout.engines.vllm.session import continuation_requests


class FakeVSamplingParams:
    """Records keyword arguments like vllm.SamplingParams(**kw)."""

    def __init__(self, **kw):
        self.kw = kw

    def __getattr__(self, name):
        try:
            return self.__dict__["kw"][name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class FakeLogprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FakeCompletion:
    index: int
    token_ids: list
    logprobs: list | None
    finish_reason: str | None
    text: str = ""
    cumulative_logprob: float | None = None


@dataclass
class FakeRequestOutput:
    request_id: str
    prompt_token_ids: list
    outputs: list
    finished: bool = True


@dataclass
class FakeEngineCore:
    """vLLM's LLMEngine as the offline loop uses it: requests finish two per step, the later one first."""

    pending: list = field(default_factory=list)
    aborted: list = field(default_factory=list)
    steps: int = 0

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        self.steps += 1
        done, self.pending = self.pending[:2], self.pending[2:]
        return [_fake_output(*request) for request in reversed(done)]

    def abort_request(self, request_ids, internal=False):
        assert internal  # the ids enqueue returned are vLLM's internal ones
        self.aborted.extend(request_ids)
        self.pending = [r for r in self.pending if f"{r[0]}-internal" not in request_ids]


def _fake_output(request_id, prompt, sp):
    """Deterministic fake: response = [seed % 50, seed % 7 + 50, ...] truncated at stops."""
    tokens, lps, reason = [], [], "length"
    for t in range(sp.max_tokens):
        tok = (sp.seed + 13 * t + len(prompt["prompt_token_ids"])) % 64
        tokens.append(tok)
        lps.append({tok: FakeLogprob(-0.01 * (t + 1), rank=1), tok + 1: FakeLogprob(-9.0, rank=2)})
        if tok in sp.stop_token_ids:
            reason = "stop"
            break
    return FakeRequestOutput(str(request_id), prompt["prompt_token_ids"], [FakeCompletion(0, tokens, lps, reason)],
                             finished=True)


@dataclass
class FakeLLM:
    calls: list = field(default_factory=list)
    loaded: list = field(default_factory=list)
    llm_engine: FakeEngineCore = field(default_factory=FakeEngineCore)
    counter: int = 0

    def enqueue(self, prompts, params, use_tqdm=True):
        self.calls.append(("enqueue", len(prompts)))
        ids = []
        for prompt, sp in zip(prompts, params):
            self.llm_engine.pending.append((self.counter, prompt, sp))
            ids.append(f"{self.counter}-internal")
            self.counter += 1
        return ids

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        """vLLM's worker weight-transfer methods, by name."""
        if method == "update_weights":
            chunk = kwargs["update_info"]["weights"]
            self.loaded.extend(chunk)
            self.calls.append((method, len(chunk)))
        else:
            assert method in ("start_weight_update", "finish_weight_update"), method
            self.calls.append((method,))
        return [None]

    def reset_prefix_cache(self):
        """Fails while requests hold cache blocks, as vLLM's block pool does (v1/core/block_pool.py 837-844)."""
        self.calls.append(("reset_prefix_cache",))
        return not self.llm_engine.pending

    def apply_model(self, fn):
        """A model whose layers the reshard plan cannot write: the update takes the HF stream."""
        self.calls.append(("apply_model",))
        return [None]

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))
        return True


def test_llm_kwargs():
    kw = build_llm_kwargs("/m", EngineSettings(rollout_tp=2, gpu_memory_utilization=0.4, seed=3, dtype="bf16",
                                               max_model_len=4096, max_num_seqs=64, load_format="dummy"),
                          weight_transfer_backend="mcpo_colocated")
    assert kw["model"] == "/m" and kw["tokenizer"] == "/m" and kw["tensor_parallel_size"] == 2
    assert kw["distributed_executor_backend"] == "external_launcher"
    assert kw["async_scheduling"] is False  # the trainer steps it: each step's own tokens (rollout/engines/vllm/args.py)
    assert "disable_custom_all_reduce" not in kw and "moe_backend" not in kw  # visible GPUs unknown; a dense model
    assert kw["enable_sleep_mode"] is True and kw["enforce_eager"] is False
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["dtype"] == "bfloat16" and kw["max_model_len"] == 4096 and kw["load_format"] == "dummy"
    assert kw["gpu_memory_utilization"] == 0.4 and kw["seed"] == 3 and kw["max_num_seqs"] == 64
    assert kw["weight_transfer_config"] == {"backend": "mcpo_colocated"}
    assert "max_num_batched_tokens" not in kw and "kv_cache_memory_bytes" not in kw  # vLLM's defaults on GPUs
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineSettings(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineSettings(rollout_tp=0)
    with pytest.raises(ValueError, match="dtype"):
        EngineSettings(dtype="int3")
    with pytest.raises(ValueError, match="device"):
        build_llm_kwargs("/m", EngineSettings(), device="tpu")
    # what only the CUDA build needs, for an engine the project steps; a standalone engine keeps vLLM's defaults
    stepped = build_llm_kwargs("/m", EngineSettings(rollout_tp=2), visible_gpus=1, unquantized_moe=True)
    assert stepped["disable_custom_all_reduce"] is True and stepped["moe_backend"] == "triton"
    alone = build_llm_kwargs("/m", EngineSettings(rollout_tp=2), own_workers=True, visible_gpus=1, unquantized_moe=True)
    assert not {"async_scheduling", "disable_custom_all_reduce", "moe_backend"} & set(alone)
    cpu = build_llm_kwargs("/m", EngineSettings(rollout_tp=2, max_model_len=8, kv_cache_bytes=1), device="cpu",
                           visible_gpus=None, unquantized_moe=True)
    assert cpu["async_scheduling"] is False and not {"disable_custom_all_reduce", "moe_backend"} & set(cpu)


def test_llm_kwargs_cpu():
    """On CPU: no sleep mode, eager, a KV cache and a step budget of max_num_seqs full sequences
    (no prompt is ever prefilled in two steps, so seeded requests never rewind a generator)."""
    kw = build_llm_kwargs("/m", EngineSettings(dtype="fp32", max_model_len=112, max_num_seqs=32, kv_cache_bytes=12345,
                                               tokenizer=False, enable_sleep_mode=True), device="cpu")
    assert "enable_sleep_mode" not in kw and kw["enforce_eager"] is True
    assert kw["max_num_batched_tokens"] == 32 * 112 and kw["kv_cache_memory_bytes"] == 12345
    assert kw["skip_tokenizer_init"] is True and "tokenizer" not in kw and kw["dtype"] == "float32"
    with pytest.raises(ValueError, match="max_model_len and kv_cache_bytes"):
        build_llm_kwargs("/m", EngineSettings(max_model_len=112), device="cpu")


def test_kv_cache_bytes_by_hand():
    from mcpo_megatron.models.tiny import tiny_hf_config

    # SmolLM2-135M: 30 layers, 3 KV heads of 64; fp32.  112 tokens -> 1 block of 128 per sequence.
    cfg = tiny_hf_config("llama", num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, hidden_size=576)
    per_token = 2 * 30 * 3 * 64 * 4
    assert kv_cache_bytes(cfg, max_num_seqs=32, max_model_len=112, dtype="float32") == (32 + 1) * 128 * per_token
    # 129 tokens need 2 blocks; bf16 halves it.
    assert kv_cache_bytes(cfg, max_num_seqs=4, max_model_len=129, dtype="bf16") == (8 + 1) * 128 * per_token // 2
    # 2 KV heads at rollout TP=2: one per rank; at TP=4 vLLM replicates them: still one per rank.
    cfg2 = tiny_hf_config("qwen3")  # 4 layers, 2 KV heads of 16
    one_head = 2 * 4 * 1 * 16 * 4
    for tp in (2, 4):
        assert kv_cache_bytes(cfg2, max_num_seqs=4, max_model_len=100, rollout_tp=tp) == 5 * 128 * one_head


def test_requests_one_per_sample_with_derived_seeds():
    sp = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=-1, max_new_tokens=5,
                        stop_token_ids=(9,), seed=4)
    prompts, params, keys = build_requests([[1, 2], [3]], sp, [10, 11], [2], FakeVSamplingParams)
    assert prompts == [{"prompt_token_ids": [1, 2]}] * 2 + [{"prompt_token_ids": [3]}] * 2
    assert keys == [(10, 0), (10, 1), (11, 0), (11, 1)]
    for p, (j, i) in zip(params, keys):
        assert p.n == 1 and p.seed == sample_seed(4, j, i)
        assert p.temperature == 0.7 and p.top_p == 0.9 and p.top_k == 0  # vLLM's "disabled"
        assert p.max_tokens == 5 and p.stop_token_ids == [2, 9] and p.logprobs == 0
    _, params, _ = build_requests([[1]], SamplingParams(top_k=20), [0], [], FakeVSamplingParams)
    assert params[0].top_k == 20
    assert params[0].detokenize is False and "stop" not in params[0].kw


def test_stop_strings_turn_the_detokenizer_on():
    """vLLM 0.32 refuses stop strings without its detokenizer (vllm/sampling_params.py:734); an episode's turn
    (rollout/episodes.py) asks for the closing fence, kept in the output."""
    _, params, _ = build_requests([[1]], SamplingParams(stop_strings=("\n```\n",)), [0], [], FakeVSamplingParams)
    p = params[0]
    assert p.detokenize is True and p.stop == ["\n```\n"] and p.include_stop_str_in_output is True
    # a segment of an episode (partial rollouts) continues its turn's record with the same stop string
    record = SequenceRecord(0, 0, 7, [5], [-0.5], [0])
    for stop_strings, on in ((("\n```\n",), True), ((), False)):
        sampling = SamplingParams(max_new_tokens=4, stop_strings=stop_strings)
        _, (c,) = continuation_requests([[1]], [record], sampling, [2], FakeVSamplingParams)
        assert c.detokenize is on and c.max_tokens == 3 and c.seed == continuation_seed(7, 1)
        assert (c.kw.get("stop"), c.kw.get("include_stop_str_in_output")) == ((["\n```\n"], True) if on else
                                                                             (None, None))


def test_convert_outputs():
    outs = [
        FakeRequestOutput("0", [1], [FakeCompletion(0, [4, 2], [{4: FakeLogprob(-0.5)},
                                                                {2: FakeLogprob(-0.25), 3: FakeLogprob(-2.0)}],
                                                    "stop")]),
        FakeRequestOutput("1", [1], [FakeCompletion(0, [7], [{7: FakeLogprob(-1.5)}], "length")]),
    ]
    ro = convert_outputs(outs, [(3, 0), (3, 1)])
    assert ro.token_ids == [[4, 2], [7]]
    assert ro.logprobs == [[-0.5, -0.25], [-1.5]]
    assert ro.finish_reasons == ["stop", "length"] and ro.prompt_indices == [3, 3]
    bad = [FakeRequestOutput("0", [1], [FakeCompletion(0, [4], None, "stop")])]
    with pytest.raises(ValueError, match="processed_logprobs"):
        convert_outputs(bad, [(0, 0)])
    aborted = [FakeRequestOutput("0", [1], [FakeCompletion(0, [4], [{4: FakeLogprob(0.0)}], "abort")])]
    with pytest.raises(RuntimeError, match="abort"):
        convert_outputs(aborted, [(0, 0)])


def test_routed_experts_travel_with_each_sample():
    """vLLM's per-request routing (model.moe_routing_replay=r3) becomes the sample's record: prompt and every
    response token but the last, int16 ids."""
    import numpy as np

    rng = np.random.default_rng(0)
    routed = rng.integers(0, 8, size=(3 + 2, 4, 2)).astype(np.int32)  # vLLM may hold one row more than we keep
    comp = FakeCompletion(0, [4, 2], [{4: FakeLogprob(-0.5)}, {2: FakeLogprob(-0.25)}], "stop")
    comp.routed_experts = routed
    out = convert_outputs([FakeRequestOutput("0", [1, 5, 6], [comp])], [(0, 0)])
    rec = out.samples[0].routed_experts
    assert rec.dtype == torch.int16 and rec.shape == (3 + 2 - 1, 4, 2)
    assert torch.equal(rec, torch.from_numpy(routed[:4].astype(np.int16)))
    assert out.routed_experts is not None
    # too few rows: a routing that does not cover the sample is an error, not a silent partial replay
    comp.routed_experts = routed[:3]
    with pytest.raises(ValueError, match=r"expected \[>= 4, num_layers, top-k\]"):
        convert_outputs([FakeRequestOutput("0", [1, 5, 6], [comp])], [(0, 0)])
    # expert ids past int16 keep a wider type
    wide = np.full((4, 1, 1), 40000, dtype=np.int64)
    assert routed_experts_record(wide, 3, 2).dtype == torch.int32


def test_routed_experts_engine_argument():
    kw = build_llm_kwargs("/m", EngineSettings(return_routed_experts=True))
    assert kw["enable_return_routed_experts"] is True
    assert "enable_return_routed_experts" not in build_llm_kwargs("/m", EngineSettings())
    with pytest.raises(ValueError, match="only from its GPU model runner; its CPU build cannot"):
        build_llm_kwargs("/m", EngineSettings(max_model_len=64, kv_cache_bytes=1, return_routed_experts=True),
                         device="cpu")
    with pytest.raises(ValueError, match="needs rollout.enable_prefix_caching=true"):
        build_llm_kwargs("/m", EngineSettings(return_routed_experts=True, enable_prefix_caching=False))


def test_engine_generate_update_sleep_protocol():
    llm = FakeLLM()
    eng = VLLMRolloutEngine("/m", eos_token_ids=[63], llm=llm, sampling_params_cls=FakeVSamplingParams)
    sp = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=1)
    out = eng.generate([[1, 2, 3], [5]], sp)
    assert out.prompt_indices == [0, 0, 0, 1, 1, 1]
    assert [s.sample_index for s in out] == [0, 1, 2] * 2
    for s in out:
        assert s.finish_reason in ("stop", "length")
        assert (s.finish_reason == "stop") == (s.token_ids[-1] == 63)
        assert s.logprobs == [-0.01 * (t + 1) for t in range(len(s.token_ids))]
    # Same result whatever the split (per-request seeds from global indices).
    part = eng.generate([[5]], sp, prompt_indices=[1])
    assert part.token_ids == out.token_ids[3:]
    assert generate_data_parallel(eng, [[1, 2, 3], [5]], sp).token_ids == out.token_ids

    w = [("model.embed_tokens.weight", torch.ones(2, 2)), ("lm_head.weight", torch.zeros(2, 2))]
    eng.begin_update()
    eng.update_weights(iter(w[:1]))
    eng.update_weights(iter([]))
    eng.update_weights(iter(w[1:]))
    eng.finish_update()
    assert [n for n, _ in llm.loaded] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert llm.calls[-5:] == [("start_weight_update",), ("update_weights", 1), ("update_weights", 1),
                              ("finish_weight_update",), ("reset_prefix_cache",)]

    llm.calls.clear()
    eng.sleep()
    for call in (lambda: eng.generate([[1]], sp), lambda: eng.begin_update(), lambda: eng.update_weights(w)):
        with pytest.raises(RuntimeError, match="wake_up"):
            call()
    eng.wake_up()
    eng.begin_update()
    eng.update_weights(w)
    eng.finish_update()
    eng.generate([[1]], sp)
    assert llm.calls == [("sleep", 2), ("wake_up", ("weights",)), ("start_weight_update",), ("update_weights", 2),
                         ("finish_weight_update",), ("reset_prefix_cache",), ("wake_up", ("kv_cache",)),
                         ("enqueue", 3)]


def test_engine_generate_stops_when_asked():
    """should_stop is polled before each engine step; True aborts the call's requests and raises."""
    from mcpo_megatron.rollout.engines.interface import GenerationInterrupted

    llm = FakeLLM()
    eng = VLLMRolloutEngine("/m", llm=llm, sampling_params_cls=FakeVSamplingParams)
    sp = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=1)
    polls = []
    with pytest.raises(GenerationInterrupted, match="4 of 6 requests unfinished"):
        eng.generate([[1, 2, 3], [5]], sp, should_stop=lambda: polls.append(1) or len(polls) > 1)
    assert llm.llm_engine.steps == 1 and llm.llm_engine.aborted == [f"{i}-internal" for i in range(6)]
    assert not llm.llm_engine.has_unfinished_requests()
    # The next call runs normally, in request order although requests finish out of order.
    out = eng.generate([[1, 2, 3], [5]], sp, should_stop=lambda: False)
    assert out.prompt_indices == [0, 0, 0, 1, 1, 1] and [s.sample_index for s in out] == [0, 1, 2] * 2


def test_resharder_drives_the_update_session():
    """Resharder.push: begin_update, every bucket, finish_update, in that order."""
    from mcpo_megatron.rollout.weights.resharder import Resharder, bucketize

    llm = FakeLLM()
    eng = VLLMRolloutEngine("/m", llm=llm, sampling_params_cls=FakeVSamplingParams)
    tensors = [(f"t{i}", torch.zeros(64)) for i in range(5)]  # 256 B each
    resharder = Resharder([], None, bucket_mb=600 / 2**20)
    resharder.iter_buckets = lambda counts=None: bucketize(iter(tensors), resharder.bucket_bytes)
    stats = resharder.push(eng)
    assert stats.path == "stream" and stats.buckets == 3 and stats.tensors == 5
    assert llm.calls == [("apply_model",), ("start_weight_update",), ("update_weights", 2), ("update_weights", 2),
                         ("update_weights", 1), ("finish_weight_update",), ("reset_prefix_cache",)]


def test_from_config_builds_llm_arguments(monkeypatch, tmp_path):
    from mcpo_megatron.config import load_config
    from mcpo_megatron.models.tiny import make_tiny_hf_model
    from mcpo_megatron.rollout.engines.vllm import engine as vllm_engine

    model_dir = make_tiny_hf_model("qwen3", tmp_path / "m")
    cfg = load_config(None, ["rollout.tensor_parallel_size=2", "rollout.gpu_memory_utilization=0.45",
                             "rollout.seed=9", "rollout.max_new_tokens=100", "data.max_prompt_length=28",
                             "data.max_response_length=100", "eval.max_new_tokens=120",
                             "rollout.max_num_seqs=32", "model.dtype=bf16"])
    captured = {}

    def fake_init(self, model_dir, **kw):
        captured.update(kw, model_dir=model_dir)

    monkeypatch.setattr(vllm_engine.VLLMRolloutEngine, "__init__", fake_init)
    vllm_engine.VLLMRolloutEngine.from_config(cfg, model_dir, load_format="dummy")
    kw = build_llm_kwargs(captured.pop("model_dir"), EngineSettings(**{
        k: v for k, v in captured.items() if k not in ("eos_token_ids", "sleep_level", "standalone")}))
    assert captured["eos_token_ids"] == [2] and captured["sleep_level"] == 2 and captured["standalone"] is False
    assert captured["return_routed_experts"] is False  # model.moe_routing_replay=r3 turns it on
    assert kw["tensor_parallel_size"] == 2 and kw["gpu_memory_utilization"] == 0.45 and kw["seed"] == 9
    assert kw["max_model_len"] == 28 + 120  # room for the longer of rollout and eval replies
    assert kw["dtype"] == "bfloat16" and kw["max_num_seqs"] == 32 and kw["load_format"] == "dummy"
    assert kw["enable_sleep_mode"] is True and kw["enable_prefix_caching"] is True and kw["enforce_eager"] is False
    assert "max_num_batched_tokens" not in kw and "swap_space" not in kw

    cfg = load_config(None, ["rollout.sleep_level=1", "rollout.enable_prefix_caching=false", "rollout.enforce_eager=true",
                             "rollout.max_num_batched_tokens=8192", "rollout.engine_kwargs.swap_space=6",
                             "rollout.engine_kwargs.compilation_config.mode=3"])
    captured.clear()
    vllm_engine.VLLMRolloutEngine.from_config(cfg, model_dir)
    assert captured["sleep_level"] == 1
    kw = build_llm_kwargs(captured.pop("model_dir"), EngineSettings(**{
        k: v for k, v in captured.items() if k not in ("eos_token_ids", "sleep_level", "standalone")}))
    assert kw["enable_prefix_caching"] is False and kw["enforce_eager"] is True
    assert kw["max_num_batched_tokens"] == 8192 and kw["swap_space"] == 6
    assert kw["compilation_config"] == {"mode": 3} and type(kw["compilation_config"]) is dict


def test_cpu_token_budget_holds_whole_prompts():
    with pytest.raises(ValueError, match="at least rollout.max_num_seqs x max_model_len = 3584"):
        build_llm_kwargs("/m", EngineSettings(max_model_len=112, max_num_seqs=32, kv_cache_bytes=1,
                                              max_num_batched_tokens=4096 - 1024), device="cpu")
    kw = build_llm_kwargs("/m", EngineSettings(max_model_len=112, max_num_seqs=32, kv_cache_bytes=1,
                                               max_num_batched_tokens=5000), device="cpu")
    assert kw["max_num_batched_tokens"] == 5000


def test_module_does_not_import_vllm_at_import_time():
    import subprocess
    import sys

    code = "import sys, mcpo_megatron.rollout.engines.vllm.engine; print('vllm' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


def test_engine_rank_of_its_own_takes_the_dedicated_share_without_sleep(monkeypatch, tmp_path):
    """rollout.placement=separate: an engine rank (trainer/rollout_worker.py) has its GPU to itself, so its vLLM
    engine gets rollout.dedicated_gpu_memory_utilization (0.9) and no sleep mode, not the colocated recipe's 0.5
    and sleep mode (CUDA mocked; the bridge's server does nothing). The colocated engine keeps both."""
    from types import SimpleNamespace

    from fake_vllm import fake_cuda_vllm

    from mcpo_megatron.config import load_config
    from mcpo_megatron.models.tiny import make_tiny_model_with_tokenizer
    from mcpo_megatron.parallel.bridge import ROLLOUT, Roles
    from mcpo_megatron.rollout.separate import server as rollout_server
    from mcpo_megatron.trainer import rollout_worker
    from mcpo_megatron.trainer.components import build_engine

    model = make_tiny_model_with_tokenizer(tmp_path / "m")
    built = fake_cuda_vllm(monkeypatch)

    class IdleServer:
        def __init__(self, *args, **kwargs):
            pass

        def serve(self):
            return 0

    class NoHeartbeat:  # the engine rank beats into the bridge's store from its start; this test has no store
        def __init__(self, store, bridge_rank, period_s):
            pass

        def close(self):
            pass

    monkeypatch.setattr(rollout_server, "RolloutServer", IdleServer)
    monkeypatch.setattr(rollout_worker, "Heartbeat", NoHeartbeat)
    bridge = SimpleNamespace(store=SimpleNamespace(clone=lambda: None), rank=1)
    base = [f"model.path={model}", "rollout.engine=vllm", "rollout.gpu_memory_utilization=0.5",
            "rollout.max_new_tokens=8", "data.max_response_length=8", "data.max_prompt_length=24"]
    separate = ["rollout.placement=separate", "rollout.ranks=1"]
    roles = Roles(role=ROLLOUT, rank=0, size=1, global_rank=1, global_size=2, rollout_ranks=1)
    assert rollout_worker.serve_rollouts(load_config(None, [*base, *separate]), roles, bridge=bridge) == 0
    (kw,) = built
    assert kw["gpu_memory_utilization"] == 0.9 and kw["enable_sleep_mode"] is False
    assert kw["distributed_executor_backend"] == "external_launcher"  # a rank of the engines' own world
    assert kw["weight_transfer_config"] == {"backend": "mcpo_colocated"}  # weights arrive over the bridge

    explicit = load_config(None, [*base, *separate, "rollout.dedicated_gpu_memory_utilization=0.8"])
    assert rollout_worker.serve_rollouts(explicit, roles, bridge=bridge) == 0
    assert built[1]["gpu_memory_utilization"] == 0.8
    engine = build_engine(load_config(None, base), model, None, None, rollout_worker.EngineRank(roles))  # colocated
    assert built[2]["gpu_memory_utilization"] == 0.5 and built[2]["enable_sleep_mode"] is True
    assert engine.sleep_enabled
