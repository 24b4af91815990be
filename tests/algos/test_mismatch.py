"""Sampler/learner mismatch metrics."""

from __future__ import annotations

import math

import torch

from quarl.algos import mismatch_metrics

F64 = torch.float64
LOG2 = math.log(2)


def test_hand_values():
    # d = old - sampler: row 0 (log 2, log 2), row 1 (-log 2, padding)
    # k1 = mean(-d) = (-2 log2 + log2) / 3 = -log2 / 3
    # k3 = mean(e^d - d - 1) = [(2 - log2 - 1) * 2 + (0.5 + log2 - 1)] / 3 = (1.5 - log2) / 3
    # |d| mean = log2, max = log2 ; ppl_ratio = exp(mean(sampler - old)) = 2^(-1/3)
    # seq_w_max = max(exp(log2), exp(-log2)) = 2
    sampler = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], dtype=F64)
    d = torch.tensor([[LOG2, LOG2], [-LOG2, 123.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=F64)
    m = mismatch_metrics(sampler + d, sampler, mask)
    assert math.isclose(m["mismatch/kl_k1"], -LOG2 / 3)
    assert math.isclose(m["mismatch/kl_k3"], (1.5 - LOG2) / 3)
    assert math.isclose(m["mismatch/abs_logp_diff_mean"], LOG2)
    assert math.isclose(m["mismatch/max_abs_logp_diff"], LOG2)
    assert math.isclose(m["mismatch/ppl_ratio"], 2 ** (-1 / 3))
    assert math.isclose(m["mismatch/seq_w_max"], 2.0)
    assert all(isinstance(v, float) for v in m.values())


def test_max_abs_logp_diff_hand_values():
    """max |sampler - learner| over response tokens only: the padding's 9.0 and the masked-out
    token's 5.0 do not count; the largest real gap is |-1.25 - (-0.5)| = 0.75 (exact in float32)."""
    sampler = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, 0.0, 0.0]])
    learner = torch.tensor([[-1.5, -2.0, -1.25], [-0.25, 9.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert mismatch_metrics(learner, sampler, mask)["mismatch/max_abs_logp_diff"] == 0.75
    # one ulp apart is not exact: the metric sees the float32 difference
    ulp = torch.nextafter(torch.tensor(-1.0), torch.tensor(0.0))
    nudged = sampler.clone()
    nudged[0, 0] = ulp
    assert mismatch_metrics(nudged, sampler, mask)["mismatch/max_abs_logp_diff"] == 2.0**-24
    # identical values on every response token: exactly 0, whatever the padding holds
    same = sampler.clone()
    same[1, 1:] = 7.0
    assert mismatch_metrics(same, sampler, mask)["mismatch/max_abs_logp_diff"] == 0.0


def test_length_quartiles():
    # 4 responses in shuffled length order (3, 1, 4, 2) with per-row constant d = (-0.3, -0.1, -0.4, -0.2):
    # sorted by length the k1 (= -d) per quartile is 0.1, 0.2, 0.3, 0.4
    lengths, dvals = [3, 1, 4, 2], [-0.3, -0.1, -0.4, -0.2]
    mask = torch.zeros(4, 4, dtype=F64)
    d = torch.zeros(4, 4, dtype=F64)
    for i, (n, v) in enumerate(zip(lengths, dvals)):
        mask[i, :n] = 1
        d[i, :n] = v
    sampler = -torch.rand(4, 4, dtype=F64)
    m = mismatch_metrics(sampler + d, sampler, mask)
    for q, k in enumerate([0.1, 0.2, 0.3, 0.4], start=1):
        assert math.isclose(m[f"mismatch/kl_k1_q{q}"], k)
        assert math.isclose(m[f"mismatch/kl_k3_q{q}"], math.exp(-k) + k - 1)


def test_zero_when_aligned_and_empty_batch():
    logp = -torch.rand(3, 5, dtype=F64)
    m = mismatch_metrics(logp, logp.clone(), torch.ones_like(logp))
    assert m["mismatch/kl_k1"] == 0.0 and m["mismatch/kl_k3"] == 0.0
    assert m["mismatch/ppl_ratio"] == 1.0 and m["mismatch/seq_w_max"] == 1.0
    m = mismatch_metrics(logp, logp, torch.zeros_like(logp))
    assert m["mismatch/kl_k3"] == 0.0 and m["mismatch/max_abs_logp_diff"] == 0.0
    assert math.isnan(m["mismatch/kl_k3_q1"])
