"""Generation: rollout and eval sampling, response lengths, the engine's GPU share and vLLM settings, and
asynchronous RL's staleness."""

from mcpo_megatron import config as C
from mcpo_megatron.config import load_config

from config_cases import MOE as C_MOE, TINY, ok, problems


def test_rollout_n_at_least_two():
    assert problems(["rollout.n=1"]) == [
        "rollout.n=1: must be >= 2 (group statistics need at least two responses per prompt); "
        "set rollout.n to 2 or more"]


def test_sampling_parameters():
    assert problems(["rollout.temperature=0"]) == [
        "rollout.temperature=0.0: must be > 0; use a positive temperature (1.0 samples the policy)"]
    assert problems(["rollout.top_p=0"]) == [
        "rollout.top_p=0.0: must satisfy 0 < top_p <= 1; use 1.0 to disable nucleus sampling"]
    assert problems(["eval.top_p=1.5"]) == [
        "eval.top_p=1.5: must satisfy 0 < top_p <= 1; use 1.0 to disable nucleus sampling"]
    assert problems(["rollout.top_k=0"]) == ["rollout.top_k=0: must be -1 (disabled) or >= 1; set -1 or a positive value"]


def test_truncated_sampling_is_refused_for_training_and_allowed_for_eval():
    """The trainer's log-probs are over the full temperature-scaled distribution; top-p/top-k rollouts would be
    drawn from another one, so the PPO ratio and TIS would compare the wrong distributions."""
    why = ("the trainer's log-probs (PPO ratio, TIS, mismatch) are over the full temperature-scaled distribution, "
           "so rollouts must be sampled from it")
    assert problems(["rollout.top_p=0.95"]) == [
        f"rollout.top_p=0.95: truncated sampling is refused for training: {why}; use rollout.top_p=1.0 "
        "(eval.top_p may truncate)"]
    assert problems(["rollout.top_k=50"]) == [
        f"rollout.top_k=50: truncated sampling is refused for training: {why}; use rollout.top_k=-1"]
    ok(["eval.top_p=0.95"])


def test_eval_max_new_tokens():
    assert problems(["eval.max_new_tokens=0"]) == [
        "eval.max_new_tokens=0: must be >= 1 when set; set a positive value, or null to use data.max_response_length"]
    ok(["eval.max_new_tokens=1024"])


def test_eval_num_problems():
    assert problems(["eval.num_problems=0"]) == [
        "eval.num_problems=0: must be >= 1 when set; set a positive number of problems, or null to evaluate every "
        "problem"]
    ok(["eval.num_problems=64"])


def test_max_new_tokens_within_response_length():
    assert problems(["rollout.max_new_tokens=30000"]) == [
        "rollout.max_new_tokens=30000: must be <= data.max_response_length=20480 (the overlong-shaping L_max); "
        "lower rollout.max_new_tokens or raise data.max_response_length"]


def test_engine_gpu_share_colocated_or_alone():
    """A colocated engine takes rollout.gpu_memory_utilization and sleeps as configured; an engine alone on its GPUs
    (an engine rank with placement=separate, mcpo eval's) takes rollout.dedicated_gpu_memory_utilization (0.9) and
    never sleeps. Both shares are checked, naming the key."""
    from mcpo_megatron.config import engine_memory_settings

    r = load_config(None, [*TINY, "rollout.gpu_memory_utilization=0.5"]).rollout
    assert engine_memory_settings(r, dedicated=False) == (0.5, True)
    assert engine_memory_settings(r, dedicated=True) == (0.9, False)
    r = load_config(None, [*TINY, "rollout.dedicated_gpu_memory_utilization=0.8", "rollout.enable_sleep_mode=false"])
    # null: resolved against the GPU and trainer.offload (planner.colocated_share; 0.6 without offload)
    assert engine_memory_settings(r.rollout, dedicated=False) == (None, False)
    assert engine_memory_settings(r.rollout, dedicated=True) == (0.8, False)
    assert problems(["rollout.dedicated_gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization=0"]) == [
        "rollout.gpu_memory_utilization=0.0: must satisfy 0 < value <= 1; give the fraction of GPU memory the engine "
        "may use, e.g. 0.6",
        "rollout.dedicated_gpu_memory_utilization=1.5: must satisfy 0 < value <= 1; give the fraction of GPU memory "
        "the engine may use, e.g. 0.9"]


def test_gpu_settings_are_keys_with_todays_defaults():
    """Settings a GPU user tunes: today's values are the defaults; null means the platform's choice."""
    cfg = load_config(None, TINY)
    assert cfg.parallelism.overlap_grad_reduce is None and cfg.parallelism.overlap_param_gather is None
    r = cfg.rollout
    assert (r.sleep_level, r.enable_prefix_caching, r.enforce_eager, r.max_num_batched_tokens) == (2, True, None, None)
    assert dict(r.engine_kwargs) == {}
    ok(["rollout.engine_kwargs.swap_space=8", "rollout.sleep_level=1", "rollout.enforce_eager=true",
        "rollout.max_num_batched_tokens=16384", "parallelism.overlap_grad_reduce=true"])
    assert problems(["rollout.sleep_level=3"]) == [
        "rollout.sleep_level=3: must be one of 2 | 1; set rollout.sleep_level to one of those"]
    assert problems(["rollout.max_num_batched_tokens=0"]) == [
        "rollout.max_num_batched_tokens=0: must be >= 1 when set; set a positive token budget, or null for the "
        "platform's default"]
    assert problems(["parallelism.overlap_param_gather=true", "parallelism.use_distributed_optimizer=false"]) == [
        "parallelism.overlap_param_gather=True: needs parallelism.use_distributed_optimizer=true (the all-gather is "
        "the distributed optimizer's); set parallelism.use_distributed_optimizer=true or overlap_param_gather=false"]


def test_engine_kwargs_cannot_override_what_the_trainer_sets():
    assert problems(["rollout.engine_kwargs.enforce_eager=false", "rollout.engine_kwargs.logprobs_mode=raw_logprobs"]) == [
        "rollout.engine_kwargs.enforce_eager=False: set by the trainer: use rollout.enforce_eager; remove it from "
        "rollout.engine_kwargs and set rollout.enforce_eager",
        "rollout.engine_kwargs.logprobs_mode=raw_logprobs: set by the trainer; remove it from rollout.engine_kwargs"]


def test_engine_kwargs_checked_against_vllm_when_installed(monkeypatch):
    monkeypatch.setattr(C.validation, "vllm_available", lambda: True)
    monkeypatch.setattr(C.validation, "cuda_available", lambda: False)
    monkeypatch.setattr(C.sections.rollout, "vllm_engine_arg_names", lambda: ["swap_space", "block_size", "kv_cache_dtype"])
    ok(["rollout.engine=vllm", "rollout.engine_kwargs.block_size=32"], check_devices=True)
    warnings = ok(["rollout.engine_kwargs.blok_size=32"], check_devices=True)  # the torch engine takes none
    assert ("rollout.engine_kwargs={'blok_size': 32} is ignored: they are vLLM engine arguments and "
            "rollout.engine=torch") in warnings
    assert problems(["rollout.engine=vllm", "rollout.engine_kwargs.blok_size=32"], check_devices=True) == [
        "rollout.engine_kwargs.blok_size=32: not an argument of vLLM's engine; did you mean block_size?"]


def test_max_staleness_rules_and_tis_default():
    """docs/algorithms.md section 13: staleness > 0 needs engines of their own; decoupled PPO's weight (TIS) is on by default
    then, and turning it off is warned about."""
    assert problems(["trainer.max_staleness=1"], 2) == [
        "trainer.max_staleness=1: generation overlaps training only when the engines have ranks of their own, and a "
        "response carries over to a later step only with partial rollouts; set rollout.placement=separate and "
        "rollout.ranks, or rollout.partial.enable=true, or trainer.max_staleness=0"]
    assert problems(["trainer.max_staleness=-1"], 1)[0].startswith("trainer.max_staleness=-1: must be >= 0")
    sep = ["rollout.placement=separate", "rollout.ranks=1"]
    assert load_config(None, []).algorithm.tis.enable is False
    assert load_config(None, sep + ["trainer.max_staleness=2"]).algorithm.tis.enable is True
    assert load_config(None, sep + ["trainer.max_staleness=2", "algorithm.tis.enable=false"]).algorithm.tis.enable \
        is False
    assert load_config(None, ["algorithm.tis.enable=true"]).algorithm.tis.enable is True
    warnings = ok(sep + ["trainer.max_staleness=1", "algorithm.tis.enable=false"], 2)
    assert any(w.startswith("trainer.max_staleness=1 with algorithm.tis.enable=false") for w in warnings), warnings
    assert not any("tis" in w for w in ok(sep + ["trainer.max_staleness=1"], 2))


def test_partial_rollouts_rules_and_defaults():
    """rollout.partial (docs/algorithms.md §13): off by default (today's behaviour); on, a continued response trains
    with tokens at least one version old colocated and two with separate placement, so max_staleness must allow
    it; the spares default to half the batch and may not exceed it; TIS follows max_staleness as before."""
    cfg = load_config(None, [])
    assert cfg.rollout.partial.enable is False and cfg.trainer.staleness_policy == "wait"
    assert cfg.rollout.partial.segment_tokens == 64 and cfg.rollout.partial.spare_groups is None
    assert C.spare_groups(cfg) == 64  # half of data.train_batch_size=128
    assert C.spare_groups(load_config(None, ["data.train_batch_size=1"])) == 1
    assert C.spare_groups(load_config(None, ["rollout.partial.spare_groups=0"])) == 0
    on = ["rollout.partial.enable=true"]
    assert problems(on) == [
        "rollout.partial.enable=True: a response continued in a later step trains with tokens at least 1 version old "
        "(colocated), so it needs trainer.max_staleness >= 1 (it is 0); set trainer.max_staleness=1 or more, or "
        "rollout.partial.enable=false"]
    ok(on + ["trainer.max_staleness=1"])  # colocated: no longer refused with partial rollouts
    assert load_config(None, on + ["trainer.max_staleness=1"]).algorithm.tis.enable is True
    sep = ["rollout.placement=separate", "rollout.ranks=1"]
    assert problems(on + sep + ["trainer.max_staleness=1"], 2) == [
        "rollout.partial.enable=True: a response continued in a later step trains with tokens at least 2 versions old "
        "(with rollout.placement=separate a batch is generated while the previous step trains, so its tokens are "
        "already one version old), so it needs trainer.max_staleness >= 2 (it is 1); set trainer.max_staleness=2 or "
        "more, or rollout.partial.enable=false"]
    ok(on + sep + ["trainer.max_staleness=2"], 2)
    assert problems(on + ["trainer.max_staleness=1", "rollout.partial.spare_groups=129"]) == [
        "rollout.partial.spare_groups=129: must be <= data.train_batch_size=128: the groups a batch carries over are "
        "at most the spares, and a step must be able to train every carried group that is due "
        "(trainer.staleness_policy=wait); use at most 128"]
    assert problems(on + ["trainer.max_staleness=1", "rollout.partial.spare_groups=-1"])[0].startswith(
        "rollout.partial.spare_groups=-1: must be >= 0")
    assert problems(on + ["trainer.max_staleness=1", "rollout.partial.segment_tokens=0"])[0].startswith(
        "rollout.partial.segment_tokens=0: must be >= 1")
    assert problems(["trainer.staleness_policy=later"])[0].startswith(
        "trainer.staleness_policy=later: must be one of wait | drop")
    ok(on + ["trainer.max_staleness=1", "trainer.staleness_policy=drop", "rollout.partial.spare_groups=0"])


def test_off_policy_masks_need_a_band_around_one():
    """algorithm.token_mask (IcePop) and algorithm.sequence_mask: off by default; a band must hold ratio 1."""
    cfg = load_config(None, [])
    assert not cfg.algorithm.token_mask.enable and not cfg.algorithm.sequence_mask.enable
    assert (cfg.algorithm.token_mask.low, cfg.algorithm.token_mask.high) == (0.5, 5.0)
    assert (cfg.algorithm.sequence_mask.ratio, cfg.algorithm.sequence_mask.low,
            cfg.algorithm.sequence_mask.high) == ("geometric", 0.5, 2.0)
    ok(["algorithm.token_mask.enable=true", "algorithm.sequence_mask.enable=true",
        "algorithm.sequence_mask.ratio=product"])
    assert problems(["algorithm.token_mask.enable=true", "algorithm.token_mask.low=1.5"]) == [
        "algorithm.token_mask.low=1.5: must satisfy 0 < low <= 1 (the band must hold ratio 1, an on-policy token); "
        "use e.g. 0.5"]
    assert problems(["algorithm.sequence_mask.enable=true", "algorithm.sequence_mask.high=0.9"]) == [
        "algorithm.sequence_mask.high=0.9: must be >= 1 (the band must hold ratio 1, an on-policy token); use e.g. 2.0"]
    assert problems(["algorithm.sequence_mask.ratio=mean"])[0].startswith(
        "algorithm.sequence_mask.ratio=mean: must be one of geometric | product")
    ok(["algorithm.token_mask.low=7"])  # a disabled mask's band is not checked


def test_partial_rollouts_refused_with_vllm_routing_replay():
    """vLLM returns a request's routed experts with its final output only: an unfinished response's routing would be
    lost at the end of a batch."""
    assert problems(["rollout.partial.enable=true", "trainer.max_staleness=1", "rollout.engine=vllm",
                     "model.moe_routing_replay=r3"] + C_MOE)[0] == (
        "rollout.partial.enable=True: with model.moe_routing_replay=r3 and rollout.engine=vllm: vLLM 0.32 returns a "
        "request's routed experts with its final output only, so the routing of a response left unfinished at the "
        "end of a batch would be lost; use rollout.engine=torch, model.moe_routing_replay=r2 or off, or "
        "rollout.partial.enable=false")


def test_inflight_update_settings():
    """In-flight weight updates (docs/algorithms.md §13.2): repeatable by default, one of three modes, the update
    segment a positive count or null (half a batch's minimum segments)."""
    cfg = load_config(None, [])
    assert cfg.rollout.partial.inflight_updates == "repeatable" and cfg.rollout.partial.update_after_segments is None
    assert problems(["rollout.partial.update_after_segments=0"]) == [
        "rollout.partial.update_after_segments=0: must be >= 1 or null; use null (half the segments a batch runs at "
        "least) or a segment count"]
    assert problems(["rollout.partial.inflight_updates=sometimes"]) == [
        "rollout.partial.inflight_updates=sometimes: must be one of repeatable | fast | off; set "
        "rollout.partial.inflight_updates to one of those"]
    assert ok(["rollout.partial.inflight_updates=fast", "rollout.partial.update_after_segments=3"])


def test_engine_kwargs_cannot_undo_what_stepped_engines_need():
    """The trainer steps its vLLM engines itself: asynchronous scheduling (vLLM's default on CUDA) would return each
    step's tokens one step late, so engine_kwargs may not turn it on. A MoE kernel other than Triton's is allowed,
    with a warning that every update then takes vLLM's layerwise reload."""
    vllm = ["rollout.engine=vllm"]
    assert problems([*vllm, "rollout.engine_kwargs.async_scheduling=true"]) == [
        "rollout.engine_kwargs.async_scheduling=True: the trainer steps its vLLM engines itself (sessions, segments, "
        "per-token versions, in-flight updates), which needs every engine step to return its own tokens; vLLM's "
        "asynchronous scheduling returns them one step late (the trainer sets async_scheduling=false); remove it from "
        "rollout.engine_kwargs (mcpo eval's standalone engine keeps vLLM's default)"]
    ok([*vllm, "rollout.engine_kwargs.async_scheduling=false"])
    warnings = ok([*vllm, "rollout.engine_kwargs.moe_backend=flashinfer_trtllm"])
    assert any(w.startswith("rollout.engine_kwargs.moe_backend=flashinfer_trtllm: the reshard plan writes unquantized "
                            "experts in place only in the layout of Triton's kernels") for w in warnings), warnings
    assert not any("moe_backend" in w for w in ok([*vllm, "rollout.engine_kwargs.moe_backend=triton"]))


def test_batch_invariant_mode_rules(monkeypatch):
    """rollout.batch_invariant (vLLM's VLLM_BATCH_INVARIANT): off by default; on, it needs a CUDA machine, and an
    attention backend or MoE kernel named in engine_kwargs must be one vLLM can run batch-invariantly."""
    assert load_config(None, TINY).rollout.batch_invariant is False
    on = ["rollout.engine=vllm", "rollout.batch_invariant=true"]
    ok(on)
    assert "rollout.batch_invariant=true is ignored: it is vLLM's mode and rollout.engine=torch" in ok(
        ["rollout.batch_invariant=true"])
    monkeypatch.setattr(C.validation, "vllm_available", lambda: True)
    monkeypatch.setattr(C.validation, "cuda_available", lambda: False)
    assert problems(on, check_devices=True) == [
        "rollout.batch_invariant=True: needs vLLM's CUDA build and a GPU (its batch-invariant kernels are GPU kernels); "
        "this machine has no CUDA device; set rollout.batch_invariant=false (on CPU the engine's samples already do "
        "not depend on the batch)"]
    assert problems([*on, "rollout.engine_kwargs.attention_backend=FLASHINFER",
                     "rollout.engine_kwargs.moe_backend=flashinfer_cutlass"]) == [
        "rollout.engine_kwargs.attention_backend=FLASHINFER: does not support vLLM's batch-invariant mode "
        "(rollout.batch_invariant=true); use one of FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION, FLASHATTN_MLA, "
        "TRITON_MLA, or leave the choice to vLLM",
        "rollout.engine_kwargs.moe_backend=flashinfer_cutlass: is not batch invariant in vLLM "
        "(rollout.batch_invariant=true); use one of auto, triton, cutlass, humming, or remove the key"]
    assert problems([*on, "rollout.engine_kwargs.attention_config.backend=FLASHINFER"])[0].startswith(
        "rollout.engine_kwargs.attention_config.backend=FLASHINFER: does not support")
    ok([*on, "rollout.engine_kwargs.attention_backend=FLASH_ATTN", "rollout.engine_kwargs.moe_backend=triton"])
