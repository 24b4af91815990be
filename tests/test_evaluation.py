"""pass@k, avg@K and their summaries against hand-computed values."""

from __future__ import annotations

import math

import pytest

from quarl.evaluation import ProblemResult, ks_up_to, pass_at_k, summarize


def test_pass_at_k_hand_values():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # n=8, c=3, k=4: 1 - C(5,4)/C(8,4) = 1 - 5/70 = 13/14
    assert pass_at_k(8, 3, 4) == pytest.approx(13 / 14)
    assert pass_at_k(4, 0, 2) == 0.0  # nothing correct
    assert pass_at_k(4, 3, 2) == 1.0  # n - c = 1 < k: every pair holds a correct sample
    assert pass_at_k(4, 4, 4) == 1.0
    for c in range(5):
        assert pass_at_k(4, c, 1) == pytest.approx(c / 4)  # pass@1 is the share correct


def test_pass_at_k_is_stable_where_binomials_overflow_floats():
    for n, c, k in ((200, 17, 64), (100, 1, 50), (1024, 3, 512)):
        want = 1 - math.comb(n - c, k) / math.comb(n, k)  # exact integers, one rounding
        assert pass_at_k(n, c, k) == pytest.approx(want, rel=1e-12)
    assert math.comb(2000, 1000) > 1e308  # as a float this would overflow; the product does not
    assert 0.0 < pass_at_k(2000, 1, 1000) == pytest.approx(0.5)


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def test_ks_and_summary():
    assert ks_up_to(1) == [1]
    assert ks_up_to(6) == [1, 2, 4]
    assert ks_up_to(8) == [1, 2, 4, 8]
    problems = [ProblemResult(0, 4, 0), ProblemResult(1, 4, 1), ProblemResult(2, 4, 4)]
    s = summarize(problems, 4)
    # avg@4 = (0/4 + 1/4 + 4/4) / 3 = 5/12; pass@2 = (0 + 0.5 + 1) / 3 = 0.5; pass@4 = (0 + 1 + 1) / 3
    assert s["avg@4"] == pytest.approx(5 / 12)
    assert s["pass@k"] == pytest.approx({"1": 5 / 12, "2": 0.5, "4": 2 / 3})
    assert s["num_problems"] == 3
    with pytest.raises(ValueError):
        summarize([ProblemResult(0, 2, 1)], 4)
