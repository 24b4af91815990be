"""Mismatch corrections: weights, rejection and veto as separate choices, and the presets."""

from __future__ import annotations

import math

import pytest
import torch

from quarl.algos.corrections import (
    LEVELS,
    PRESETS,
    CorrectionSpec,
    build_spec,
    importance_weights,
    mismatch_correction,
    preset,
    rejection_keep,
    veto_keep,
)

F64 = torch.float64


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def log_w(rows) -> torch.Tensor:
    """Exact log-weights: old = 0 and sampler = -log w make old - sampler = log w bit for bit."""
    return torch.log(t(rows))


def correct(spec, w_rows, mask=None):
    lw = log_w(w_rows)
    mask = torch.ones_like(lw) if mask is None else t(mask)
    return mismatch_correction(spec, torch.zeros_like(lw), -lw, mask)


# ---------------------------------------------------------------- presets, by the papers' formulas


def test_token_presets_hand_values():
    w = [[0.4, 1.5, 3.0]]
    # tis min(w, 2); decoupled w; acr min(w, 2) with upper bound x max(1, w / 2); icepop w kept in [0.5, 2]
    assert torch.allclose(correct(preset("tis"), w).weight, t([[0.4, 1.5, 2.0]]))
    assert torch.allclose(correct(preset("decoupled"), w).weight, t(w))
    acr = correct(preset("acr"), w)
    assert torch.allclose(acr.weight, t([[0.4, 1.5, 2.0]]))
    assert torch.allclose(acr.upper_scale, t([[1.0, 1.0, 1.5]]))
    ice = correct(preset("icepop"), w)
    assert torch.allclose(ice.weight, t(w))
    assert ice.keep.tolist() == [[False, True, False]]
    for name in ("tis", "decoupled", "acr"):
        assert correct(preset(name), w).keep.all()


def test_sequence_presets_hand_values():
    # row 0: log w = (log 4, 0) -> mean log 2 -> v = 2 (on the bound: kept by mis)
    # row 1: log w = log 9 on its one masked token -> v = 9 -> seq-tis 2, mis removes the row
    # row 2: log w = -log 3 -> v = 1/3 -> seq-tis 1/2, mis removes the row (< 1/2)
    w = [[4.0, 1.0], [9.0, 5.0], [1 / 3, 1.0]]
    mask = [[1, 1], [1, 0], [1, 0]]
    tis = correct(preset("seq-tis"), w, mask)
    assert torch.allclose(tis.row_weight, t([2.0, 2.0, 0.5]))
    assert torch.allclose(tis.weight, t([[2.0, 2.0], [2.0, 2.0], [0.5, 0.5]]))
    mis = correct(preset("mis"), w, mask)
    assert torch.allclose(mis.row_weight, t([2.0, 9.0, 1 / 3]))
    assert mis.keep.tolist() == [[True, True], [False, False], [False, False]]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_are_exactly_neutral_when_sampler_agrees(name):
    old = -torch.rand(3, 5, dtype=F64) * 5
    mask = (torch.rand(3, 5) < 0.7).to(F64)
    corr = mismatch_correction(preset(name), old, old.clone(), mask)
    assert (corr.weight == 1).all() and (corr.row_weight == 1).all() and (corr.upper_scale == 1).all()
    assert torch.equal(corr.keep, mask.bool())


# ---------------------------------------------------------------- the pieces


def test_importance_weights_asymmetric_bounds_at_each_level():
    lw = log_w([[0.4, 1.2, 3.0], [2.0, 1.5, 7.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    w, row = importance_weights("token", lw, mask, 0.5, 1.5)
    assert torch.allclose(w, t([[0.5, 1.2, 1.5], [1.5, 1.5, 1.0]]))  # off the mask: 1
    assert torch.equal(row, t([1.0, 1.0]))
    # sequence: products 0.4 * 1.2 * 3 = 1.44 and 2 * 1.5 = 3 (the unmasked 7 is not read)
    w, row = importance_weights("sequence", lw, mask, 0.5, 2.5)
    assert torch.allclose(row, t([1.44, 2.5]))
    assert torch.allclose(w, t([[1.44] * 3, [2.5] * 3]))
    # geometric: 1.44 ** (1/3) = 1.12924 and sqrt(3) = 1.73205, the latter above 1.6
    _, row = importance_weights("geometric", lw, mask, 0.9, 1.6)
    assert torch.allclose(row, t([1.44 ** (1 / 3), 1.6]))
    w, row = importance_weights("none", lw, mask)
    assert (w == 1).all() and (row == 1).all()


def test_rejection_keeps_the_band_bounds_included():
    # token band [0.5, 1.25]: 0.5 and 1.25 stay, 0.4 and 1.3 go; masked-out tokens are never kept
    lw = log_w([[0.5, 1.25, 0.4, 1.3], [1.0, 1.0, 1.0, 9.0]])
    mask = t([[1, 1, 1, 1], [1, 1, 1, 0]])
    assert rejection_keep("token", lw, mask, 0.5, 1.25).tolist() == [[True, True, False, False],
                                                                        [True, True, True, False]]
    # sequence: products 0.5 * 1.25 * 0.4 * 1.3 = 0.325 (out of [0.5, 2]) and 1 (in)
    assert rejection_keep("sequence", lw, mask, 0.5, 2.0).tolist() == [[False] * 4, [True, True, True, False]]
    # geometric: 0.325 ** (1/4) = 0.755 -> in [0.7, 2], out of [0.8, 2]
    assert rejection_keep("geometric", lw, mask, 0.7, 2.0)[0].all()
    assert not rejection_keep("geometric", lw, mask, 0.8, 2.0)[0].any()
    assert rejection_keep("none", lw, mask).tolist() == mask.bool().tolist()


def test_veto_removes_responses_with_any_extreme_token_in_either_direction():
    # veto 1e-3: band [1e-3, 1e3]. row 0 has 1e-4 (vetoed), row 1 has 2e3 (vetoed), row 2's extreme
    # token is off the mask (kept), row 3 sits on the bound 1e-3 (kept)
    lw = log_w([[1.0, 1e-4], [2e3, 1.0], [1.0, 1e-9], [1e-3, 1.0]])
    mask = t([[1, 1], [1, 1], [1, 0], [1, 1]])
    assert veto_keep(lw, mask, 1e-3).tolist() == [False, False, True, True]


def test_rejection_and_veto_combine_and_leave_the_weights_alone():
    spec = CorrectionSpec("token", 0.0, 2.0, reject="token", reject_low=0.5, reject_high=2.0, veto=0.01)
    corr = correct(spec, [[0.4, 1.5, 3.0], [1.0, 0.005, 1.0], [1.0, 1.0, 1.0]])
    assert corr.keep.tolist() == [[False, True, False], [False, False, False], [True, True, True]]
    assert torch.allclose(corr.weight, t([[0.4, 1.5, 2.0], [1.0, 0.005, 1.0], [1.0, 1.0, 1.0]]))
    assert corr.weight.requires_grad is False


def test_levels_against_a_python_reference_on_random_inputs():
    gen = torch.Generator().manual_seed(11)
    lw = torch.randn(9, 6, generator=gen, dtype=F64) * 0.6
    mask = t([[1] * n + [0] * (6 - n) for n in (6, 1, 3, 0, 5, 6, 2, 4, 6)])
    for level in LEVELS[1:]:
        w, row = importance_weights(level, lw, mask, 0.7, 1.6)
        keep = rejection_keep(level, lw, mask, 0.6, 1.4)
        for i in range(9):
            xs = [float(lw[i, j]) for j in range(6) if mask[i, j]]
            stat = {"sequence": math.exp(sum(xs)), "geometric": math.exp(sum(xs) / max(len(xs), 1))}.get(level)
            for j in range(6):
                if not mask[i, j]:
                    assert not keep[i, j]
                    continue
                x = math.exp(float(lw[i, j])) if level == "token" else stat
                assert math.isclose(float(w[i, j]), min(max(x, 0.7), 1.6), rel_tol=1e-12)
                assert bool(keep[i, j]) == (0.6 <= x <= 1.4)
            if level != "token" and xs:
                assert math.isclose(float(row[i]), min(max(stat, 0.7), 1.6), rel_tol=1e-12)


# ---------------------------------------------------------------- composing a spec


def test_build_spec_composes_presets_with_explicit_choices():
    assert build_spec("tis", 2.0) == preset("tis", 2.0)
    spec = build_spec("none", 3.0, weights="sequence")
    assert (spec.weights, spec.weight_low, spec.weight_high) == ("sequence", 0.0, 3.0)
    spec = build_spec("seq-tis", 2.0, weight_low=0.8, weight_high=1.25)  # asymmetric TBPO weights
    assert (spec.weights, spec.weight_low, spec.weight_high) == ("geometric", 0.8, 1.25)
    spec = build_spec("tis", 2.0, reject="geometric", reject_high=1.001, veto=1e-4)
    assert spec.weights == "token" and spec.weight_high == 2.0
    assert (spec.reject, spec.reject_low, spec.reject_high, spec.veto) == ("geometric", 1 / 1.001, 1.001, 1e-4)
    spec = build_spec("icepop", 2.0, reject_low=0.25)  # bounds of the preset's own rejection
    assert (spec.reject, spec.reject_low, spec.reject_high) == ("token", 0.25, 2.0)
    assert build_spec("tis", veto=1e-3).rejects and not build_spec("tis").rejects
    assert build_spec("mis").without_rejection() == CorrectionSpec("geometric")


@pytest.mark.parametrize("kw,match", [
    (dict(correction="tis", weights="sequence"), "has its own token weights"),
    (dict(correction="icepop", reject="sequence"), "already rejects at the token level"),
    (dict(weight_high=2.0), "has none: set weights"),
    (dict(reject_high=2.0), "none is set: set reject"),
    (dict(weights="tokens"), "unknown weights level 'tokens'; valid: none, token, sequence, geometric"),
    (dict(reject="token", reject_low=1.5), "0 <= low <= 1 <= high"),
    (dict(veto=2.0), "veto must lie in"),
    (dict(correction="seq_tis"), "unknown correction 'seq_tis'"),
    (dict(correction="tis", cap=0.9), "cap must be >= 1"),
])
def test_build_spec_names_the_conflict(kw, match):
    with pytest.raises(ValueError, match=match):
        build_spec(**kw)
