"""Throughput accounting: model FLOPs per phase of an RL step, achieved FLOP/s, MFU, peak memory, summary.

Convention (the one of Megatron-LM's and PaLM's MFU): **model FLOPs**, 2 FLOPs per multiply-accumulate,
counting only the matrix multiplies the model needs (no activation recomputation, no optimizer, no
norms / RoPE / softmax / SwiGLU element-wise work, no embedding lookup, which is a gather). Per decoder layer
and per token, with hidden ``h``, ``a`` query heads and ``k`` KV heads of size ``d`` and FFN width ``f``:

    q projection          2 * h * a*d
    k and v projections   2 * 2 * h * k*d          (GQA: k <= a heads)
    output projection     2 * a*d * h
    SwiGLU MLP            3 * 2 * h * f            (gate, up, down)

A mixture-of-experts layer (E experts of width ``I``, ``k`` per token) replaces the MLP term by the experts a
token visits and its router: ``k * 3 * 2 * h * I  +  2 * h * E`` (active parameters only).

A hybrid decoder (Qwen3.5, Qwen3-Next: ``layer_types``) counts each layer by its kind. Its full-attention layers'
query projection also makes the output gate (``2 * h * a*d`` more). A Gated DeltaNet layer (``nk`` key heads of
size ``dk``, ``nv`` value heads of size ``dv``, ``qk = nk*dk``, ``v = nv*dv``) replaces the four attention terms by:

    input projection      2 * h * (2*qk + 2*v + 2*nv)   (q, k, v, the output gate z, beta, the decay a)
    delta rule            3 * 2 * nv*dk*dv              (per token and value head: the state read by k, its
                                                          rank-1 update, the state read by q)
    output projection     2 * v * h

Its depthwise convolution (``K`` multiplies per channel) is element-wise work and is not counted, and it has no
term in the sequence length. A MoE layer's shared expert of width ``S`` and its gate add ``3 * 2 * h * S + 2 * h``.

plus the attention scores and context of a query at position ``i`` (0-based) over ``i + 1`` keys (the causal
mask: we count only the keys a query may see, i.e. ``S (S + 1) / 2`` query-key pairs for a sequence of
``S`` tokens, not the full ``S^2`` square that PaLM's formula counts):

    Q K^T and A V         2 * 2 * a*d * (i + 1)

and the output layer (LM head) ``2 * h * V`` per position whose logits are computed.

Phases of one RL step (``kind``):

* ``"train"``: forward + backward over every token of every trained sequence = **3 x forward** (the backward
  computes gradients with respect to both inputs and weights: two matmuls per forward matmul). Megatron's
  ``GPTModel`` computes logits at every position, so the LM head counts every position. Times ``ppo_epochs``
  for repeated passes over the batch (done by the caller).
* ``"logprob"``: the old-log-prob pass, a forward over the same sequences = **1 x forward**.
* ``"generate"``: with a KV cache every token is processed once: the prompt in the prefill, then each sampled
  token in a decode step whose query attends to the whole cache before it, which is exactly the causal count
  above. A reply of ``R`` tokens needs ``P + R - 1`` processed positions (the last sampled token is never fed
  back) and logits at ``R`` positions (the last prompt position and each decode step); ``R = 0`` still pays
  the prefill and one logit row.

All functions here are pure except ``peak_memory_bytes`` (reads the process) and ``write_summary`` (files).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from mcpo_megatron.config.shapes import FULL_ATTENTION, LINEAR_ATTENTION

KINDS = ("train", "logprob", "generate")
H100_BF16_DENSE_PEAK = 989e12  # FLOP/s, one H100 SXM, dense bf16 (NVIDIA datasheet; sparse figure is 2x)
GIB = 1024 ** 3


def _get(shape: Any, name: str) -> int:
    value = shape[name] if isinstance(shape, Mapping) else getattr(shape, name)
    if value is None or int(value) <= 0:
        raise ValueError(f"model shape field {name}={value!r}: must be a positive integer (set model.arch.{name} "
                         "or point model.path at a directory with config.json)")
    return int(value)


def _experts(shape: Any) -> int:
    value = shape.get("num_experts", 0) if isinstance(shape, Mapping) else getattr(shape, "num_experts", 0)
    return int(value or 0)


def _opt(shape: Any, name: str, default: Any = 0) -> Any:
    value = shape.get(name, default) if isinstance(shape, Mapping) else getattr(shape, name, default)
    return default if value is None else value


def layer_kinds(shape: Any) -> tuple[str, ...]:
    """Each layer's kind: a hybrid decoder's ``layer_types``, else full attention throughout (a shape object or a
    mapping)."""
    kinds = tuple(_opt(shape, "layer_types", ()) or ())
    return kinds or (FULL_ATTENTION,) * _get(shape, "num_layers")


def linear_flops_per_token(shape: Any) -> float:
    """Matmul FLOPs of all decoder layers for one token, excluding attention scores/context and the LM head
    (for a mixture of experts: the k experts the token is routed to, the router and the shared expert; for a
    hybrid decoder, its Gated DeltaNet layers' projections and delta rule)."""
    h, a, k = _get(shape, "hidden_size"), _get(shape, "num_attention_heads"), _get(shape, "num_key_value_heads")
    d = _get(shape, "head_dim")
    experts = _experts(shape)
    if experts:
        topk, width = _get(shape, "num_experts_per_tok"), _get(shape, "moe_ffn_hidden_size")
        mlp = topk * 3 * 2 * h * width + 2 * h * experts
        shared = int(_opt(shape, "shared_expert_ffn_hidden_size"))
        mlp += 3 * 2 * h * shared + 2 * h if shared else 0
    else:
        mlp = 3 * 2 * h * _get(shape, "ffn_hidden_size")
    kinds = layer_kinds(shape)
    hybrid = LINEAR_ATTENTION in kinds
    full = 2 * h * a * d * (2 if hybrid else 1) + 2 * 2 * h * k * d + 2 * a * d * h + mlp
    total = kinds.count(FULL_ATTENTION) * full
    if hybrid:
        nk, nv = _get(shape, "linear_num_key_heads"), _get(shape, "linear_num_value_heads")
        dk, dv = _get(shape, "linear_key_head_dim"), _get(shape, "linear_value_head_dim")
        qk, v = nk * dk, nv * dv
        linear = 2 * h * (2 * qk + 2 * v + 2 * nv) + 3 * 2 * nv * dk * dv + 2 * v * h + mlp
        total += kinds.count(LINEAR_ATTENTION) * linear
    return float(total)


def attention_flops(shape: Any, positions: int, *, causal: bool = True) -> float:
    """Score and context FLOPs of all (full-attention) layers for ``positions`` tokens of one sequence attending
    causally (query ``i`` sees ``i + 1`` keys); ``causal=False`` counts the full square (PaLM's convention)."""
    a, d = _get(shape, "num_attention_heads"), _get(shape, "head_dim")
    layers = layer_kinds(shape).count(FULL_ATTENTION)
    pairs = positions * (positions + 1) // 2 if causal else positions * positions
    return float(layers * 2 * 2 * a * d * pairs)


def lm_head_flops(shape: Any, positions: int) -> float:
    """Output-layer FLOPs for ``positions`` rows of logits."""
    return float(2 * _get(shape, "hidden_size") * _get(shape, "vocab_size") * positions)


def forward_flops(shape: Any, positions: int, *, logit_positions: Optional[int] = None,
                  causal: bool = True) -> float:
    """One forward pass over ``positions`` tokens of one sequence (logits at ``logit_positions``, default
    every position)."""
    if positions < 0:
        raise ValueError(f"positions={positions}: must be >= 0")
    logits = positions if logit_positions is None else logit_positions
    return (positions * linear_flops_per_token(shape) + attention_flops(shape, positions, causal=causal)
            + lm_head_flops(shape, logits))


def _as_list(x: int | Sequence[int] | None, n: Optional[int], name: str) -> list[int]:
    if isinstance(x, int):
        if n is None:
            raise ValueError(f"{name}={x} is a single length: pass num_sequences too, or a list of lengths")
        return [x] * n
    out = [int(v) for v in x]
    if any(v < 0 for v in out):
        raise ValueError(f"{name}: lengths must be >= 0, got {out}")
    return out


def model_flops(shape: Any, *, kind: str, prompt_lens: int | Sequence[int], response_lens: int | Sequence[int],
                num_sequences: Optional[int] = None, causal: bool = True) -> float:
    """Model FLOPs of one phase of an RL step over a batch of sequences (module docstring: conventions).

    shape: a ``config.ModelShape`` (or a mapping with its field names).
    kind: ``"train"`` (forward + backward, 3x forward), ``"logprob"`` (forward), ``"generate"`` (KV-cache
        decoding of the responses after a prefill of the prompts).
    prompt_lens, response_lens: per-sequence token counts (lists of equal length), or two ints with
        ``num_sequences`` for a uniform batch.
    causal: count only the query-key pairs the causal mask allows (default); False counts the full square.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: must be one of {KINDS}")
    prompts = _as_list(prompt_lens, num_sequences, "prompt_lens")
    responses = _as_list(response_lens, num_sequences, "response_lens")
    if len(prompts) != len(responses):
        raise ValueError(f"prompt_lens has {len(prompts)} sequences but response_lens has {len(responses)}")
    total = 0.0
    for p, r in zip(prompts, responses):
        if kind == "generate":
            total += forward_flops(shape, p + max(r, 1) - 1, logit_positions=max(r, 1), causal=causal)
        else:
            total += forward_flops(shape, p + r, causal=causal)
    return 3.0 * total if kind == "train" else total


def mfu(achieved_flops_per_s: float, peak: float = H100_BF16_DENSE_PEAK) -> float:
    """Model FLOPs utilisation of one device: achieved model FLOP/s per device / its peak FLOP/s."""
    if peak <= 0:
        raise ValueError(f"peak={peak}: the peak FLOP/s of one device must be > 0")
    return achieved_flops_per_s / peak


def peak_memory_bytes(*, all_ranks: bool = False) -> int:
    """Peak memory of this rank: CUDA max allocated bytes on a GPU, else the process's max RSS.

    With ``all_ranks=True`` (a collective: every rank must call it) the maximum over all ranks is returned.
    """
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        value = int(torch.cuda.max_memory_allocated())
    else:
        value = _peak_rss_bytes()
    if all_ranks:
        from mcpo_megatron.parallel.distributed import all_reduce_max

        value = int(all_reduce_max(torch.tensor([value], dtype=torch.int64)).item())  # a CPU scalar
    return value


def proc_status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status (``VmRSS``, ``VmHWM``, ...) in bytes; None where there is no such file
    (not Linux) or field."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def _peak_rss_bytes() -> int:
    """This process's peak resident set. On Linux, ``VmHWM``: getrusage's ``ru_maxrss`` is not this program's own
    peak there: it starts from the parent's resident size at the fork and survives exec (a rank started by a
    1.5 GiB parent reports at least 1.5 GiB)."""
    peak = proc_status_bytes("VmHWM")
    if peak is not None:
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS reports bytes


def _on_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@dataclass(frozen=True)
class StepWork:
    """The sequences one RL step processed, all DP ranks together: what its FLOPs are counted over.

    prompt_lens, response_lens: the trained sequences.
    gen_prompt_lens, gen_response_lens: every generated sequence (None: the trained ones; they differ with
        dynamic sampling, which generates more than it keeps, or a retention probe).
    ppo_epochs: passes of the updates over the trained sequences.
    logprob_passes: forward passes over them before the updates: 1 (old log-probs), 2 with the reference KL.
    """

    prompt_lens: Sequence[int]
    response_lens: Sequence[int]
    gen_prompt_lens: Optional[Sequence[int]] = None
    gen_response_lens: Optional[Sequence[int]] = None
    ppo_epochs: int = 1
    logprob_passes: int = 1

    def generated(self) -> tuple[Sequence[int], Sequence[int]]:
        """(prompt lengths, response lengths) of every generated sequence."""
        prompts = self.prompt_lens if self.gen_prompt_lens is None else self.gen_prompt_lens
        responses = self.response_lens if self.gen_response_lens is None else self.gen_response_lens
        return prompts, responses


@dataclass(frozen=True)
class StepDevices:
    """The devices one RL step ran on, and how its generation is timed.

    Colocated engines: every phase runs on all ``world_size`` devices, generation for ``time/rollout``. With
    engines on ranks of their own (``rollout.placement=separate``), ``world_size`` is the launch's devices,
    training runs on ``train_world_size`` of them and generation on ``rollout_world_size`` for the engines'
    seconds (``generation_time_key="time/engine_generate"``).
    peak_flops: peak FLOP/s of one device, for MFU (reported only on a GPU; ``on_gpu`` None: asks torch).
    """

    world_size: int
    train_world_size: Optional[int] = None
    rollout_world_size: Optional[int] = None
    generation_time_key: str = "time/rollout"
    peak_flops: float = H100_BF16_DENSE_PEAK
    on_gpu: Optional[bool] = None

    def __post_init__(self):
        if self.world_size <= 0:
            raise ValueError(f"world_size={self.world_size}: must be >= 1")


def phase_flops(shape: Any, work: StepWork) -> dict[str, float]:
    """Model FLOPs of each phase of the step: ``train`` (every epoch), ``old_logprob`` (every pass) and
    ``rollout`` (every generated sequence)."""
    gen_prompts, gen_responses = work.generated()
    lengths = dict(prompt_lens=work.prompt_lens, response_lens=work.response_lens)
    return {"train": work.ppo_epochs * model_flops(shape, kind="train", **lengths),
            "old_logprob": work.logprob_passes * model_flops(shape, kind="logprob", **lengths),
            "rollout": model_flops(shape, kind="generate", prompt_lens=gen_prompts, response_lens=gen_responses)}


def _seconds(step_record: Mapping[str, Any], key: str) -> Optional[float]:
    """The step's ``key`` timing when it was measured (a positive number), else None."""
    seconds = step_record.get(key)
    return seconds if isinstance(seconds, (int, float)) and seconds > 0 else None


def step_accounting(shape: Any, step_record: Mapping[str, Any], work: StepWork, devices: StepDevices, *,
                    peak_bytes: Optional[int] = None) -> dict[str, float]:
    """Per-step throughput metrics to merge into the step's record.

    step_record: the step's metrics so far; uses ``time/step`` and, when present, ``time/rollout`` (or the
        devices' ``generation_time_key``), ``time/old_logprobs``, ``time/train``.
    peak_bytes: this run's peak memory per rank (e.g. ``peak_memory_bytes(all_ranks=True)``); measured on the
        calling rank when None.

    Returns ``perf/train_tflops``, ``perf/old_logprob_tflops``, ``perf/rollout_tflops`` (model TFLOPs of each
    phase, all devices), ``perf/step_tflops``, ``perf/tokens_per_s_per_gpu`` (prompt + response tokens of the
    trained sequences per second of step time per device), ``perf/achieved_tflops_per_s_per_gpu`` (step TFLOPs /
    step time / devices) and per phase ``perf/{train,rollout}_achieved_tflops_per_s_per_gpu``,
    ``perf/mfu`` and ``perf/train_mfu`` (GPU only), ``memory/peak_gib``, and the generated response tokens per
    second of generation (``perf/generated_tokens_per_s``, over ``time/rollout``) and of the whole step
    (``perf/generated_tokens_per_step_s``, over ``time/step``: training, eval and checkpoints included).
    """
    flops = phase_flops(shape, work)
    total = sum(flops.values())
    on_gpu = _on_gpu() if devices.on_gpu is None else devices.on_gpu
    out: dict[str, float] = {f"perf/{phase}_tflops": flops[phase] / 1e12
                             for phase in ("train", "old_logprob", "rollout")}
    out["perf/step_tflops"] = total / 1e12

    generated = sum(work.generated()[1])
    for key, time_key in (("perf/generated_tokens_per_s", devices.generation_time_key),
                          ("perf/generated_tokens_per_step_s", "time/step")):
        if (seconds := _seconds(step_record, time_key)) is not None:
            out[key] = generated / seconds
    if (step_s := _seconds(step_record, "time/step")) is not None:
        step_rate = total / step_s / devices.world_size
        tokens = sum(work.prompt_lens) + sum(work.response_lens)
        out["perf/tokens_per_s_per_gpu"] = tokens / float(step_s) / devices.world_size
        out["perf/achieved_tflops_per_s_per_gpu"] = step_rate / 1e12
        if on_gpu:
            out["perf/mfu"] = mfu(step_rate, devices.peak_flops)
    for phase, key, phase_devices in (("train", "time/train", devices.train_world_size),
                                      ("rollout", devices.generation_time_key, devices.rollout_world_size),
                                      ("old_logprob", "time/old_logprobs", devices.train_world_size)):
        if (seconds := _seconds(step_record, key)) is None:
            continue
        rate = flops[phase] / seconds / (phase_devices or devices.world_size)
        out[f"perf/{phase}_achieved_tflops_per_s_per_gpu"] = rate / 1e12
        if on_gpu and phase == "train":
            out["perf/train_mfu"] = mfu(rate, devices.peak_flops)
    out["memory/peak_gib"] = (peak_memory_bytes() if peak_bytes is None else peak_bytes) / GIB
    return out


# ---------------------------------------------------------------------------------------------------------
# summary.json
# ---------------------------------------------------------------------------------------------------------

SUMMARY_MEAN_PREFIXES = ("time/", "perf/")
FINAL_KEYS = ("reward/mean", "acc/mean", "mastery/mastered_frac", "mastery/all_wrong_frac", "retention/acc",
              "actor/entropy", "response/length_mean")


def _number(v: Any) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(float(v)) else None


def summarize(records: Sequence[Mapping[str, Any]], *, warmup_steps: int = 1) -> dict[str, Any]:
    """Summary of a run's step records: means of ``time/*`` and ``perf/*`` over the steps after the first
    ``warmup_steps`` (all steps when the run is not longer than that), the max of ``memory/*``, totals, and
    the last value of the learning curves."""
    records = sorted(records, key=lambda r: r.get("step", 0))
    if not records:
        raise ValueError("no step records: the run wrote an empty metrics.jsonl")
    steady = records[warmup_steps:] if len(records) > warmup_steps else records
    means: dict[str, list[float]] = {}
    for r in steady:
        for k, v in r.items():
            x = _number(v)
            if x is not None and k.startswith(SUMMARY_MEAN_PREFIXES):
                means.setdefault(k, []).append(x)
    out: dict[str, Any] = {
        "steps": len(records),
        "last_step": records[-1].get("step"),
        "warmup_steps": len(records) - len(steady),
        "mean": {k: sum(v) / len(v) for k, v in sorted(means.items())},
        "max": {},
        "total": {},
        "final": {},
    }
    for r in records:
        for k, v in r.items():
            x = _number(v)
            if x is not None and k.startswith("memory/"):
                out["max"][k] = max(out["max"].get(k, x), x)
    for key, total_key in (("time/step", "time_s"), ("batch/sequences", "sequences"),
                           ("perf/step_tflops", "tflops")):
        vals = [_number(r.get(key)) for r in records]
        vals = [v for v in vals if v is not None]
        if vals:
            out["total"][total_key] = sum(vals)
    for key in FINAL_KEYS:
        vals = [_number(r.get(key)) for r in records]
        vals = [v for v in vals if v is not None]
        if vals:
            out["final"][key] = vals[-1]
    return out


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The step records of a ``metrics.jsonl``. A run killed while appending (node crash, full disk) leaves a
    partial last line: it is dropped with a warning naming the file. A bad line anywhere else is an error naming
    the file and the line (that is not how a crash leaves the file)."""
    return [record for _, record in parse_jsonl(Path(path))]


def parse_jsonl(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) for every non-blank line of ``path``."""
    lines = [(n, line) for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.strip()]
    out = []
    for i, (n, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError as e:
            if i == len(lines) - 1:
                warnings.warn(f"{path}: line {n} is a partial record (the run was killed while writing it): "
                              "dropped", stacklevel=3)
                break
            raise ValueError(f"{path}: line {n} is not a JSON record ({e}); only the last line can be partial "
                             "(a run killed while writing it): the file was edited or damaged there, fix or "
                             "delete that line") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}: line {n} is not a step record (a JSON object with an integer \"step\"): "
                             f"{line[:80]!r}; fix or delete that line")
        out.append((line, record))
    return out


def write_summary(run_dir: str | os.PathLike, *, warmup_steps: int = 1, world_size: Optional[int] = None,
                  nodes: Optional[int] = None, extra: Optional[Mapping[str, Any]] = None) -> Path:
    """Write ``<run_dir>/summary.json`` from ``<run_dir>/metrics.jsonl`` (see ``summarize``); returns its path.

    world_size / nodes describe the cluster shape for the scaling tables; nodes defaults to
    ``SLURM_JOB_NUM_NODES`` (or ``SLURM_NNODES``) when set, else 1. Call on rank 0 after the last step.
    """
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl in the run directory (is logging.jsonl false?)")
    summary = summarize(read_jsonl(path), warmup_steps=warmup_steps)
    if nodes is None:
        env = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
        nodes = int(env) if env and env.isdigit() else 1
    summary["nodes"] = nodes
    if world_size is not None:
        summary["world_size"] = world_size
    summary["device"] = "gpu" if _on_gpu() else "cpu"
    if extra:
        summary.update(extra)
    out = run_dir / "summary.json"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    tmp.replace(out)
    return out


def iter_lengths(prompt_ids_per_group: Iterable[Sequence[int]], response_ids: Sequence[Sequence[int]],
                 group_size: int) -> tuple[list[int], list[int]]:
    """Per-sample (prompt_len, response_len) lists from grouped rollouts (G samples share a prompt)."""
    prompts = [len(p) for p in prompt_ids_per_group for _ in range(group_size)]
    responses = [len(r) for r in response_ids]
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompt slots (groups x {group_size}) but {len(responses)} responses")
    return prompts, responses
