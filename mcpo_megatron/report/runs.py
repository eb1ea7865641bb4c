"""Reading run directories and labelling runs by the config keys that differ between them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from mcpo_megatron.accounting import read_jsonl, summarize
from mcpo_megatron.config import presets

# Keys that differ between any two runs without describing the experiment (where files go).
IGNORED_KEYS = ("trainer.output_dir", "checkpoint.dir", "logging.wandb.name", "trainer.resume", "trainer.overwrite")
SWEEP_POINT_FILE = "sweep_point.json"  # written by launch.sweep next to each run's config.yaml
# Keys that make runs replicates of one experiment rather than different experiments: runs that differ only in
# these are grouped, and the report shows their mean and an interval over seeds. ``launch.sweep``'s ``seed`` axis
# sets trainer.seed and rollout.seed; data.seed (prompt subset, order, held-out set) counts as a seed here too.
SEED_KEYS = ("trainer.seed", "rollout.seed", "data.seed")


@dataclass
class Run:
    """One run directory: its config (flattened), step records, summary, cluster shape, evals."""

    path: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    nodes: Optional[int] = None
    world_size: Optional[int] = None
    evals: dict[str, Any] = field(default_factory=dict)  # benchmark -> BenchmarkResult or {metric: value}
    label: str = ""
    algorithm: Optional[str] = None  # the preset and its overridden keys (``dapo (filter_groups.enable=False)``)
    seed: Optional[str] = None  # this run's values of the seed keys that vary in its report (``assign_seeds``)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of a per-step metric, skipping steps where it is missing or not finite."""
        xs, ys = [], []
        for r in self.records:
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                xs.append(int(r["step"]))
                ys.append(float(v))
        return xs, ys

    def mean(self, key: str) -> Optional[float]:
        return self.summary.get("mean", {}).get(key)


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"a.b.c": value}; lists are kept as values."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(flatten(v, key) if isinstance(v, dict) and v else {key: v})
    return out


def _read_yaml(path: Path) -> dict:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f) or {}


def _read_evals(run_dir: Path, records: list[dict]) -> dict[str, Any]:
    """Final evaluation results: ``eval_results.json`` (``mcpo eval``'s format, in the run directory or its
    ``eval/`` folder) when present, else the last step record carrying ``eval/<benchmark>/<metric>`` keys."""
    for candidate in (run_dir / "eval_results.json", run_dir / "eval" / "eval_results.json"):
        if candidate.is_file():
            from mcpo_megatron.evaluation import read_results

            per_run = read_results(candidate)
            if per_run:
                return dict(next(iter(per_run.values())))  # one model evaluated per run directory
    for r in reversed(records):
        evals: dict[str, dict[str, float]] = {}
        for k, v in r.items():
            if k.startswith("eval/") and k.count("/") >= 2:
                _, bench, metric = k.split("/", 2)
                evals.setdefault(bench, {})[metric] = v
        if evals:
            return evals
    return {}


def load_run(run_dir: str | Path, *, warmup_steps: int = 1) -> Run:
    """Read one run directory (``metrics.jsonl`` required; ``config.yaml``, ``summary.json``,
    ``sweep_point.json``, eval results optional)."""
    path = Path(run_dir)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{path}: not a run directory (no metrics.jsonl); pass the trainer's "
                                "trainer.output_dir, or a sweep point's directory")
    records = read_jsonl(metrics)
    if not records:
        raise ValueError(f"{metrics}: empty (the run logged no step)")
    records.sort(key=lambda r: r.get("step", 0))
    config = flatten(_read_yaml(path / "config.yaml")) if (path / "config.yaml").is_file() else {}
    saved = json.loads((path / "summary.json").read_text()) if (path / "summary.json").is_file() else {}
    point = json.loads((path / SWEEP_POINT_FILE).read_text()) if (path / SWEEP_POINT_FILE).is_file() else {}
    # Recompute the step statistics from the records so that every run is summarised the same way.
    summary = summarize(records, warmup_steps=warmup_steps)
    nodes = saved.get("nodes", point.get("nodes"))
    world_size = saved.get("world_size", point.get("world_size"))
    return Run(path=path, config=config, records=records, summary=summary, nodes=nodes, world_size=world_size,
               evals=_read_evals(path, records), algorithm=presets.label(config))


def _differs(runs: list[Run], key: str) -> bool:
    return len({json.dumps(r.config.get(key), sort_keys=True, default=str) for r in runs}) > 1


def varying_keys(runs: list[Run]) -> list[str]:
    """Config keys (and ``nodes``) whose values differ between runs, in a stable order. When every run's
    ``algorithm.name`` is a preset, the keys a preset sets are summarised by one pseudo-key ``algorithm``
    (the preset, with the preset keys a run overrides). The seed keys (``SEED_KEYS``) are summarised by one
    pseudo-key ``seed``, last: runs that differ only in it are replicates."""
    keys: list[str] = []
    if len({r.nodes for r in runs}) > 1:
        keys.append("nodes")
    ignored = set(IGNORED_KEYS) | set(SEED_KEYS)
    if all(r.algorithm is not None for r in runs):
        ignored |= set(presets.OWNED_KEYS)
        if len({r.algorithm for r in runs}) > 1:
            keys.append("algorithm")
    all_keys = sorted({k for r in runs for k in r.config} - ignored)
    keys += [k for k in all_keys if _differs(runs, k)]
    if seed_keys(runs):
        keys.append("seed")
    return keys


def seed_keys(runs: list[Run]) -> list[str]:
    """The seed keys whose values differ between runs."""
    return [k for k in SEED_KEYS if _differs(runs, k)]


def assign_seeds(runs: list[Run]) -> None:
    """Set ``Run.seed``: the run's value of the varying seed keys (``3`` when they all share it, as with
    ``launch.sweep``'s seed axis; else ``trainer.seed=3,data.seed=1``); None when no seed key varies."""
    keys = seed_keys(runs)
    for r in runs:
        if not keys:
            r.seed = None
        elif len({json.dumps(r.config.get(k), default=str) for k in keys}) == 1:
            r.seed = str(r.config.get(keys[0]))
        else:
            r.seed = ",".join(f"{k}={r.config.get(k)}" for k in keys)


def axis_value(run: Run, key: str) -> Any:
    if key in ("nodes", "algorithm", "seed"):
        return getattr(run, key)
    return run.config.get(key)


def short_names(keys: list[str]) -> dict[str, str]:
    """The last component of each dotted key, or the full keys when two would end alike."""
    short = {k: k.rsplit(".", 1)[-1] for k in keys}
    if len(set(short.values())) < len(short):
        short = {k: k for k in keys}
    return short


def assign_labels(runs: list[Run], keys: list[str]) -> None:
    """Label each run by its values of the varying keys (``name=mcpo nodes=2``); by directory name when
    nothing differs or labels would collide."""
    short = short_names(keys)
    for r in runs:
        r.label = " ".join(f"{short[k]}={axis_value(r, k)}" for k in keys) or r.path.name
    if len({r.label for r in runs}) < len(runs):
        for r in runs:
            r.label = f"{r.path.name}" + (f" ({r.label})" if keys else "")
