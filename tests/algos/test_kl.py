"""KL penalty estimators."""

from __future__ import annotations

import math

import pytest
import torch

from quarl.algos import KL_ESTIMATORS, kl_penalty


def test_hand_values_and_gradient():
    # p = 0.5, p_ref = 0.25: d = ref - logp = log 0.5 = -0.6931
    # k1 = -d = log 2 = 0.6931 ; k2 = d^2 / 2 = 0.2402 ; k3 = e^d - d - 1 = 0.5 + 0.6931 - 1 = 0.1931
    # d k3 / d logp = -(e^d - 1) = 0.5
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    expected = {"k1": math.log(2), "k2": 0.5 * math.log(2) ** 2, "k3": 0.5 - math.log(0.5) - 1}
    for kind in KL_ESTIMATORS:
        logp = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
        kl = kl_penalty(logp, ref, kind)
        assert math.isclose(kl.item(), expected[kind], abs_tol=1e-12)
        if kind == "k3":
            kl.sum().backward()
            assert math.isclose(logp.grad.item(), 0.5, abs_tol=1e-12)


def test_zero_when_equal_and_mask_hides_padding():
    logp = torch.tensor([[-1.0, float("nan")]])
    ref = torch.tensor([[-1.0, float("-inf")]])
    for kind in KL_ESTIMATORS:
        kl = kl_penalty(logp, ref, kind, mask=torch.tensor([[1.0, 0.0]]))
        assert kl.tolist() == [[0.0, 0.0]]


def test_k3_nonnegative():
    logp, ref = torch.randn(4, 6), torch.randn(4, 6)
    assert (kl_penalty(logp, ref, "k3") >= 0).all()


def test_unknown_kind():
    with pytest.raises(ValueError, match="valid: k1, k2, k3"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "low_var")
