"""Token- and sequence-level mismatch corrections."""

from __future__ import annotations

import math

import pytest
import torch

from quarl.algos.corrections import (
    SEQ_CORRECTIONS,
    TOKEN_CORRECTIONS,
    seq_correction,
    seq_tis_weight,
    token_correction,
)

F64 = torch.float64


def weights(w_rows, name, cap=2.0):
    w = torch.tensor(w_rows, dtype=F64)
    old = torch.full_like(w, -2.0)
    return token_correction(name, old, old - torch.log(w), torch.ones_like(w), cap)


def test_token_weights_hand_values():
    w = [[0.4, 1.5, 3.0]]
    # tis min(w, 2); decoupled w; acr min(w, 2) with upper bound x max(1, w / 2); icepop w in [0.5, 2]
    assert torch.allclose(weights(w, "tis").weight, torch.tensor([[0.4, 1.5, 2.0]], dtype=F64))
    assert torch.allclose(weights(w, "decoupled").weight, torch.tensor(w, dtype=F64))
    acr = weights(w, "acr")
    assert torch.allclose(acr.weight, torch.tensor([[0.4, 1.5, 2.0]], dtype=F64))
    assert torch.allclose(acr.upper_scale, torch.tensor([[1.0, 1.0, 1.5]], dtype=F64))
    ice = weights(w, "icepop")
    assert torch.allclose(ice.weight, torch.tensor([[0.0, 1.5, 0.0]], dtype=F64))
    assert ice.dropped.tolist() == [[True, False, True]]


@pytest.mark.parametrize("name", TOKEN_CORRECTIONS)
def test_token_corrections_are_exactly_one_when_sampler_agrees(name):
    old = -torch.rand(3, 5, dtype=F64) * 5
    corr = token_correction(name, old, old.clone(), torch.ones_like(old), 2.0)
    assert (corr.weight == 1).all() and (corr.upper_scale == 1).all() and not corr.dropped.any()


@pytest.mark.parametrize("name", SEQ_CORRECTIONS)
def test_seq_corrections_are_exactly_one_when_sampler_agrees(name):
    old = -torch.rand(3, 5, dtype=F64) * 5
    corr = seq_correction(name, old, old.clone(), torch.ones_like(old), 2.0)
    assert (corr.weight == 1).all() and not corr.dropped.any()


def test_seq_weights_hand_values():
    # row 0: d = (log 4, 0) -> mean log 2 -> v = 2 (at the cap, kept by mis) ;
    # row 1: d = (log 9, log 9, log 9)... only 1 token on the mask -> v = 9 -> seq-tis 2, mis dropped
    # row 2: d = -log 3 -> v = 1/3 -> seq-tis 1/2, mis dropped (< 1/2)
    d = torch.tensor([[math.log(4), 0.0], [math.log(9), 5.0], [-math.log(3), 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 0]], dtype=F64)
    old = torch.full_like(d, -1.0)
    tis = seq_tis_weight(old, old - d, mask, 2.0)
    assert torch.allclose(tis, torch.tensor([2.0, 2.0, 0.5], dtype=F64))
    mis = seq_correction("mis", old, old - d, mask, 2.0)
    assert torch.allclose(mis.weight, torch.tensor([2.0, 0.0, 0.0], dtype=F64))
    assert mis.dropped.tolist() == [False, True, True]


def test_errors():
    old = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="valid: none, tis, decoupled, acr, icepop"):
        token_correction("seq-tis", old, old, torch.ones_like(old), 2.0)
    with pytest.raises(ValueError, match="valid: none, seq-tis, mis"):
        seq_correction("tis", old, old, torch.ones_like(old), 2.0)
    with pytest.raises(ValueError, match="cap"):
        token_correction("tis", old, old, torch.ones_like(old), 0.9)
