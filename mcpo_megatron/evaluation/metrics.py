"""Per-benchmark evaluation metrics from k sampled responses per problem (docs/algorithms.md §12).

pass@1 is the mean correctness over all samples (the paper's "avg@k"); pass@k is reported
with both estimators (docs/algorithms.md §12): the unbiased ``1 - C(n-c, k) / C(n, k)`` and verl's
bootstrap ``best@k/mean`` (1000 draws with replacement, seed 42), which the paper's Table 1
pass@8 values match. Both come from :mod:`mcpo_megatron.algorithms.metrics`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from mcpo_megatron.algorithms.metrics import BOOTSTRAP_DRAWS, BOOTSTRAP_SEED, bootstrap_best_at_k, pass_at_k
from mcpo_megatron.rewards.types import STATUSES


@dataclass
class BenchmarkResult:
    """Evaluation of one model on one benchmark.

    ``pass_at_k`` is the unbiased estimator, ``bootstrap_pass_at_k`` verl's bootstrap best@k.
    ``mean_response_length`` is in ``length_unit`` (tokens when the caller gave token counts,
    else characters). ``per_problem`` lists ``{"uid", "gold", "n", "correct"}`` per problem.
    """

    name: str
    num_problems: int
    samples_per_problem: int
    k: int
    pass_at_1: float
    pass_at_k: float
    bootstrap_pass_at_k: float
    mean_response_length: float
    length_unit: str
    truncation_rate: float
    status_counts: dict[str, int]
    n_boot: int = BOOTSTRAP_DRAWS
    seed: int = BOOTSTRAP_SEED
    per_problem: list[dict] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        """Flat scalar metrics for loggers (``pass@1``, ``pass@k``, ``bootstrap_pass@k``, ...)."""
        total = max(1, sum(self.status_counts.values()))
        out = {
            "pass@1": self.pass_at_1,
            f"pass@{self.k}": self.pass_at_k,
            f"bootstrap_pass@{self.k}": self.bootstrap_pass_at_k,
            "mean_response_length": self.mean_response_length,
            "truncation_rate": self.truncation_rate,
            "num_problems": float(self.num_problems),
        }
        for status in STATUSES:
            out[f"status/{status}"] = self.status_counts.get(status, 0) / total
        return out

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BenchmarkResult":
        return cls(**d)


def benchmark_result(
    name: str,
    correct: Sequence[Sequence[int]],
    *,
    lengths: Sequence[Sequence[float]] | None = None,
    length_unit: str = "tokens",
    truncated: Sequence[Sequence[bool]] | None = None,
    statuses: Sequence[Sequence[str]] | None = None,
    k: int | None = None,
    uids: Sequence[str] | None = None,
    golds: Sequence[str] | None = None,
) -> BenchmarkResult:
    """Metrics from a ``[problems][n]`` 0/1 correctness matrix (every problem has n samples).

    ``k`` defaults to n (the paper: 8 samples, pass@8). The bootstrap is verl's: ``BOOTSTRAP_DRAWS`` draws per
    problem from ``BOOTSTRAP_SEED``, with which the paper's Table 1 values were computed.
    """
    if len({len(row) for row in correct}) > 1:
        raise ValueError(f"{name}: every problem needs the same number of samples, got {sorted({len(r) for r in correct})}")
    m = np.asarray(correct, dtype=np.int64)
    if m.ndim != 2 or m.shape[0] < 1 or m.shape[1] < 1:
        raise ValueError(f"{name}: correct must be [problems][n] with n >= 1 samples each, got shape {m.shape}")
    if not np.isin(m, (0, 1)).all():
        raise ValueError(f"{name}: correct must hold only 0/1 values")
    p, n = m.shape
    k = n if k is None else int(k)
    if not 1 <= k <= n:
        raise ValueError(f"{name}: k={k} must be in [1, n={n}]; draw at least k samples per problem")

    def _shape_ok(x, what):
        if x is not None and (len(x) != p or any(len(row) != n for row in x)):
            raise ValueError(f"{name}: {what} must be [problems={p}][n={n}] like correct")

    _shape_ok(lengths, "lengths")
    _shape_ok(truncated, "truncated")
    _shape_ok(statuses, "statuses")
    counts = m.sum(axis=1)
    pass1 = float(m.mean())
    passk = float(np.mean([pass_at_k(n, int(c), k) for c in counts]))
    boot = bootstrap_best_at_k(m, k)
    mean_len = float(np.mean(np.asarray(lengths, dtype=np.float64))) if lengths is not None else float("nan")
    trunc = float(np.mean(np.asarray(truncated, dtype=np.float64))) if truncated is not None else 0.0
    status_counter = Counter(s for row in statuses for s in row) if statuses is not None else Counter()
    status_counts = {s: int(status_counter.get(s, 0)) for s in STATUSES}
    per_problem = [
        {"uid": uids[i] if uids is not None else str(i), "gold": golds[i] if golds is not None else None,
         "n": n, "correct": int(counts[i])}
        for i in range(p)
    ]
    return BenchmarkResult(
        name=name, num_problems=p, samples_per_problem=n, k=k, pass_at_1=pass1, pass_at_k=passk,
        bootstrap_pass_at_k=boot, mean_response_length=mean_len, length_unit=length_unit,
        truncation_rate=trunc, status_counts=status_counts, per_problem=per_problem,
    )


def score_samples(
    name: str,
    golds: Sequence[str],
    responses: Sequence[Sequence[str]],
    *,
    scorer,
    response_lengths: Sequence[Sequence[int]] | None = None,
    truncated: Sequence[Sequence[bool]] | None = None,
    uids: Sequence[str] | None = None,
    k: int | None = None,
) -> BenchmarkResult:
    """Score ``responses[i][j]`` (sample j of problem i) against ``golds[i]`` and compute the metrics.

    ``scorer`` is a :class:`~mcpo_megatron.rewards.MathVerifyScorer` (or anything with the same
    ``score``). Without ``response_lengths`` the mean length is in characters.
    """
    if len(responses) != len(golds):
        raise ValueError(f"{name}: {len(responses)} response lists for {len(golds)} golds; pass one list per problem")
    flat_resp = [r for row in responses for r in row]
    flat_gold = [g for g, row in zip(golds, responses) for _ in row]
    flat_trunc = [bool(t) for row in truncated for t in row] if truncated is not None else None
    results = scorer.score(flat_resp, flat_gold, flat_trunc)
    it = iter(results)
    rows = [[next(it) for _ in row] for row in responses]
    if response_lengths is None:
        lengths, unit = [[len(r) for r in row] for row in responses], "chars"
    else:
        lengths, unit = response_lengths, "tokens"
    return benchmark_result(
        name,
        [[r.correct for r in row] for row in rows],
        lengths=lengths, length_unit=unit,
        truncated=[[r.truncated for r in row] for row in rows],
        statuses=[[r.status for r in row] for row in rows],
        k=k, uids=uids, golds=golds,
    )
