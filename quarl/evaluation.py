"""Sampling metrics of an evaluation: pass@k, avg@K, and their aggregation over problems.

A problem is sampled ``n`` times and ``c`` of the samples are correct (reward >= 1).
pass@k is the chance that at least one of ``k`` samples drawn without replacement from
those ``n`` is correct; the unbiased estimator of Chen et al. 2021 ("Evaluating Large
Language Models Trained on Code", eq. 1) is

    pass@k = 1 - C(n - c, k) / C(n, k)

Binomials of n ~ 100s overflow floats, so the ratio is taken as a product:

    C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (1 - k / i)

avg@K is the mean accuracy over the K samples (``c / n`` per problem); pass@1 equals it.
A set's score is the mean over its problems; "overall" pools every set's problems.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProblemResult:
    """One problem's outcome: ``correct`` of ``n`` samples earned reward >= 1."""

    index: int
    n: int
    correct: int


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for ``c`` correct of ``n`` samples (``1 <= k <= n``, ``0 <= c <= n``)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def ks_up_to(n: int) -> list[int]:
    """The k reported for ``n`` samples: 1, 2, 4, ... <= n."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks


def summarize(problems: list[ProblemResult], n: int) -> dict:
    """``{"pass@k": {"1": x, "2": y, ...}, "avg@N": x, "num_problems": m}`` over ``problems``.

    ``n`` is the number of samples per problem (every problem must have it).
    """
    if any(p.n != n for p in problems):
        raise ValueError(f"every problem needs {n} samples")
    m = max(len(problems), 1)
    return {
        "pass@k": {str(k): sum(pass_at_k(n, p.correct, k) for p in problems) / m for k in ks_up_to(n)},
        f"avg@{n}": sum(p.correct / n for p in problems) / m,
        "num_problems": len(problems),
    }


def problem_seed(seed: int, index: int) -> int:
    """The sampling seed of problem ``index`` of a set: its samples depend on nothing else."""
    return seed * 1_000_003 + index
