"""Evaluation estimators: unbiased pass@k (Chen et al., 2021) and verl's bootstrap best@k (docs/algorithms.md §12).

The MCPO paper's pass@8 numbers are verl's ``best@8/mean``: for each problem, draw k of its n samples *with
replacement*, take the max, average over draws (1000 draws, seed 42), then average over problems. This
underestimates the true pass@k; as draws -> infinity it tends to 1 - (1 - c/n)^k (0.656 for c/n = 1/8, k = 8).
Report both.
"""

from __future__ import annotations

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n-c, k) / C(n, k) for n samples of which c are correct.

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms the huge binomials.
    """
    n, c, k = int(n), int(c), int(k)
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"pass_at_k(n={n}, c={c}): need n >= 1 and 0 <= c <= n.")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k(k={k}): need 1 <= k <= n={n}; draw at least k samples per problem.")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def expected_best_at_k(n: int, c: int, k: int) -> float:
    """Limit of ``bootstrap_best_at_k`` as the number of draws grows: 1 - (1 - c/n)^k."""
    if n < 1 or not 0 <= c <= n or k < 1:
        raise ValueError(f"expected_best_at_k(n={n}, c={c}, k={k}): need n >= 1, 0 <= c <= n, k >= 1.")
    return float(1.0 - (1.0 - c / n) ** k)


BOOTSTRAP_DRAWS = 1000  # verl's bootstrap best@k: draws per problem
BOOTSTRAP_SEED = 42    # and the seed each problem restarts from


def bootstrap_best_at_k(correct_matrix, k: int, n_boot: int = BOOTSTRAP_DRAWS, seed: int = BOOTSTRAP_SEED) -> float:
    """verl's bootstrap ``best@k/mean`` averaged over problems.

    Args:
        correct_matrix: [problems, n] 0/1 (or any score: the max is taken) per sample.
        k: subset size drawn with replacement from each problem's n samples.
        n_boot: number of draws per problem (verl: 1000).
        seed: every problem restarts the legacy NumPy generator from this seed, as verl's per-problem
            ``np.random.seed(seed)`` + ``np.random.choice`` does (without touching the global generator).
    """
    m = np.asarray(correct_matrix, dtype=np.float64)
    if m.ndim != 2 or m.shape[1] < 1:
        raise ValueError(f"correct_matrix: expected [problems, n] with n >= 1, got shape {m.shape}.")
    if k < 1 or n_boot < 1:
        raise ValueError(f"bootstrap_best_at_k(k={k}, n_boot={n_boot}): both must be >= 1.")
    if m.shape[0] == 0:
        return float("nan")
    scores = []
    for row in m:
        # one call draws the same stream as verl's n_boot calls of size k (tested)
        idx = np.random.RandomState(seed).choice(len(row), size=(n_boot, k), replace=True)
        scores.append(float(np.mean(row[idx].max(axis=1))))
    return float(np.mean(scores))
