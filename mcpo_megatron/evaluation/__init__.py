"""Evaluation metrics (pass@1, pass@k unbiased and bootstrap) and the paper-style results table."""

from mcpo_megatron.evaluation.metrics import BenchmarkResult, benchmark_result, score_samples
from mcpo_megatron.evaluation.report import (
    DISPLAY_NAMES,
    format_cell,
    format_score,
    markdown_table,
    read_results,
    results_to_json,
    write_results,
)

__all__ = [
    "DISPLAY_NAMES",
    "BenchmarkResult",
    "benchmark_result",
    "format_cell",
    "format_score",
    "markdown_table",
    "read_results",
    "results_to_json",
    "score_samples",
    "write_results",
]
