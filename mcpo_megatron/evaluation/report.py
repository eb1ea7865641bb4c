"""Evaluation results as JSON and as a Markdown table laid out like the MCPO paper's Table 1.

Table 1 has one row per model/run and one column per benchmark; each cell is
``pass@1/pass@k`` with four decimals and no leading zero (``.4458/.7012``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Sequence

from mcpo_megatron.evaluation.metrics import BenchmarkResult

#: Column headers of the paper for our benchmark names.
DISPLAY_NAMES: dict[str, str] = {"aime_2024": "AIME24", "aime_2025": "AIME25", "amc_2023": "AMC23", "champ": "CHAMP"}

Results = Mapping[str, Mapping[str, BenchmarkResult]]  # run -> benchmark -> result


def format_score(x: float) -> str:
    """Four decimals without the leading zero, as in the paper (0.4 -> ".4000", 1 -> "1.0000")."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    text = f"{x:.4f}"
    return text[1:] if text.startswith("0.") else text


def format_cell(result: BenchmarkResult | None, estimator: str = "bootstrap") -> str:
    if result is None:
        return "–"
    if estimator not in ("bootstrap", "unbiased"):
        raise ValueError(f"estimator={estimator!r} must be 'bootstrap' or 'unbiased'")
    pk = result.bootstrap_pass_at_k if estimator == "bootstrap" else result.pass_at_k
    return f"{format_score(result.pass_at_1)}/{format_score(pk)}"


def markdown_table(
    results: Results, *, benchmarks: Sequence[str] | None = None, estimator: str = "bootstrap", caption: bool = True
) -> str:
    """Rows = runs, columns = benchmarks, cells ``pass@1/pass@k`` (k of each result).

    ``estimator``: ``bootstrap`` (verl's best@k/mean, what the paper's pass@8 matches) or
    ``unbiased``. ``benchmarks`` fixes the column order (default: first-seen order).
    """
    if benchmarks is None:
        benchmarks = []
        for per_run in results.values():
            benchmarks += [b for b in per_run if b not in benchmarks]
    def cells(items) -> str:  # a "|" inside a cell (a spec such as arith:digits=1|2/1) must not split it
        return " | ".join(str(c).replace("|", "\\|") for c in items)

    lines = ["| | " + cells(DISPLAY_NAMES.get(b, b) for b in benchmarks) + " |", "|---" * (len(benchmarks) + 1) + "|"]
    for run, per_run in results.items():
        lines.append("| " + cells([run] + [format_cell(per_run.get(b), estimator) for b in benchmarks]) + " |")
    if caption:
        ks = sorted({r.k for per_run in results.values() for r in per_run.values()})
        k_text = "/".join(str(k) for k in ks) or "k"
        how = ("bootstrap best@k, 1000 draws with replacement, seed 42" if estimator == "bootstrap"
               else "unbiased estimator 1 - C(n-c,k)/C(n,k)")
        lines.insert(0, f"pass@1 / pass@{k_text} ({how})\n")
    return "\n".join(lines) + "\n"


def results_to_json(results: Results) -> dict:
    return {run: {b: r.to_dict() for b, r in per_run.items()} for run, per_run in results.items()}


def write_results(results: Results, out_dir: str | Path, *, stem: str = "eval_results") -> dict[str, Path]:
    """Write ``<stem>.json`` and ``<stem>.md`` (both estimators) under ``out_dir``; return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(results_to_json(results), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    md_path.write_text(
        markdown_table(results, estimator="bootstrap") + "\n" + markdown_table(results, estimator="unbiased"),
        encoding="utf-8",
    )
    return {"json": json_path, "markdown": md_path}


def read_results(path: str | Path) -> dict[str, dict[str, BenchmarkResult]]:
    """Inverse of the JSON written by :func:`write_results`."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    return {run: {b: BenchmarkResult.from_dict(d) for b, d in per_run.items()} for run, per_run in raw.items()}
