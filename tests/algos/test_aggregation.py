"""Loss aggregation and masked reductions."""

from __future__ import annotations

import math

import pytest
import torch

from quarl.algos import AGG_MODES, agg_loss, masked_mean, masked_sum, seq_mean

F64 = torch.float64

# rows: lengths 1, 3, 0 of T = 3 ; NaN on padding must never be read
LOSS = torch.tensor([[2.0, math.nan, math.nan], [1.0, 2.0, 3.0], [math.nan, math.nan, math.nan]], dtype=F64)
MASK = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=F64)


def test_token_mean():
    # (2 + 1 + 2 + 3) / 4 tokens = 2.0
    assert agg_loss(LOSS, MASK, "token-mean").item() == 2.0


def test_seq_mean_token_mean():
    # row means (2, 2); the empty row leaves the row count: 4 / 2
    assert math.isclose(agg_loss(LOSS, MASK, "seq-mean-token-mean").item(), 2.0)


def test_seq_mean_token_sum_norm():
    # row sums (2, 6) / max_len, mean over the 2 rows with tokens: max_len = T = 3 -> 8 / 6 ; max_len 4 -> 8 / 8
    assert math.isclose(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm").item(), 8 / 6)
    assert math.isclose(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", max_len=4).item(), 8 / 8)


def test_gradients_are_finite_and_zero_on_padding():
    for agg in AGG_MODES:
        x = LOSS.clone().requires_grad_()
        agg_loss(x, MASK, agg).backward()
        assert torch.isfinite(x.grad).all() and (x.grad[MASK == 0] == 0).all()


def test_empty_mask_gives_zero():
    for agg in AGG_MODES:
        assert agg_loss(torch.ones(2, 3), torch.zeros(2, 3), agg).item() == 0.0


def test_masked_helpers():
    assert masked_sum(LOSS, MASK).item() == 8.0
    assert torch.equal(masked_sum(LOSS, MASK, dim=-1), torch.tensor([2.0, 6.0, 0.0], dtype=F64))
    assert masked_mean(LOSS, MASK).item() == 2.0
    assert torch.equal(seq_mean(LOSS, MASK), torch.tensor([2.0, 2.0, 0.0], dtype=F64))
    assert torch.equal(seq_mean(LOSS, MASK.bool()), seq_mean(LOSS, MASK))


def test_errors():
    with pytest.raises(ValueError, match="valid: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm"):
        agg_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        agg_loss(LOSS[0], MASK[0], "token-mean")
    with pytest.raises(ValueError, match="max_len"):
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", max_len=0)
