"""What a step shows: one JSONL record, TensorBoard scalars, optional W&B, and a tqdm bar (rank 0 only)."""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from mcpo_megatron.accounting import parse_jsonl, read_jsonl  # noqa: F401  read_jsonl: for the commands

# Fields that measure the machine (wall time, throughput, memory, transfer speed): they legitimately differ
# between two runs of the same job, so resume-equality checks ignore them.
MEASUREMENT_PREFIXES = ("time/", "perf/", "memory/", "reshard/")


def is_measurement_key(key: str) -> bool:
    return key.startswith(MEASUREMENT_PREFIXES)


class StepTimer:
    """Accumulates seconds per phase: ``with timer("rollout"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0

    def as_metrics(self) -> dict[str, float]:
        out = {f"time/{k}": round(v, 4) for k, v in self.seconds.items()}
        out["time/step"] = round(sum(self.seconds.values()), 4)
        return out


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


class MetricsLogger:
    """Rank 0 writes; other ranks get a logger whose methods do nothing."""

    def __init__(self, output_dir: str | Path, *, enabled: bool, jsonl: bool = True, tensorboard: bool = True,
                 wandb_cfg: Any = None, total_steps: int = 0, initial_step: int = 0, config_dict: dict | None = None):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._bar = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        if jsonl:
            self._jsonl = open(out / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(out / "tensorboard"))
        if wandb_cfg is not None and getattr(wandb_cfg, "enable", False):
            import wandb  # optional dependency, imported only when configured

            self._wandb = wandb.init(project=wandb_cfg.project, name=wandb_cfg.name,
                                     entity=getattr(wandb_cfg, "entity", None), config=config_dict, resume="allow")
        from tqdm import tqdm

        self._bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            hist = metrics.get("mastery/query_weight_values")
            if hist:
                import numpy as np

                self._tb.add_histogram("mastery/query_weight", np.asarray(hist), step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix({"reward": f"{record.get('reward/mean', float('nan')):.3f}",
                                   "acc": f"{record.get('acc/mean', float('nan')):.3f}"}, refresh=False)
            self._bar.write(summary_line(record))

    def write(self, message: str) -> None:
        if self.enabled:
            if self._bar is not None:
                self._bar.write(message)
            else:
                print(message, flush=True)

    def close(self) -> None:
        """Close every output (idempotent)."""
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._bar = self._jsonl = self._tb = self._wandb = None


SUMMARY_FIELDS = (
    ("reward/mean", "reward", "{:+.3f}"),
    ("acc/mean", "acc", "{:.3f}"),
    ("mastery/mastered_frac", "mastered", "{:.2f}"),
    ("mastery/all_wrong_frac", "all_wrong", "{:.2f}"),
    ("retention/acc", "retention", "{:.2f}"),
    ("hkl/active_frac", "hkl_active", "{:.3f}"),
    ("actor/grad_norm", "gnorm", "{:.3f}"),
    ("actor/entropy", "entropy", "{:.3f}"),
    ("response/length_mean", "len", "{:.1f}"),
    ("mismatch/k3", "k3", "{:.2e}"),
    ("moe/max_expert_load", "max_load", "{:.2f}"),
    ("perf/tokens_per_s_per_gpu", "tok/s/gpu", "{:.0f}"),
    ("time/step", "s", "{:.1f}"),
)


def summary_line(record: dict[str, Any]) -> str:
    """The one-line metrics summary printed per step."""
    parts = [f"step {record['step']}"]
    for key, label, fmt in SUMMARY_FIELDS:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"{label}={fmt.format(value)}")
    return " | ".join(parts)


def truncate_jsonl(path: str | Path, last_step: int) -> None:
    """Drop records after ``last_step`` (a resumed run re-logs the steps its checkpoint did not hold), and a torn
    last record (see :func:`mcpo_megatron.accounting.read_jsonl`)."""
    path = Path(path)
    if not path.is_file():
        return
    keep = [line for line, record in parse_jsonl(path) if record["step"] <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)
