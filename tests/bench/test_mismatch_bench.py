"""``quarl bench mismatch``'s parts on CPU: the KL summary and one mode's measurement."""

from __future__ import annotations

import math

import pytest
import torch

from quarl.bench.mismatch import _kl_k3, measure_mode, nudge_inputs, summary_table
from quarl.bench.train import MODES, Workload, save_random_model, workload_overrides


def test_kl_summary_by_hand():
    a = torch.tensor([[0.0, math.log(2.0), -1.0]])
    b = torch.tensor([[0.0, 0.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is not a response token
    r = _kl_k3(a, b, mask)
    assert r["kl_k3"] == pytest.approx((0.0 + (2.0 - math.log(2.0) - 1.0)) / 2)
    assert r["abs_logp_diff_max"] == pytest.approx(math.log(2.0))
    assert r["tokens_differ"] == pytest.approx(0.5)


@pytest.mark.parametrize("mode", ["bf16", "aligned-w4a16"])
def test_one_mode_engine_and_learner_at_two_budgets(tmp_path, mode):
    w = Workload("tiny", prompts=2, n=2, gen=6, token_budget=256, steps=1)
    model_dir = save_random_model(w.shape, tmp_path / "model")
    r = measure_mode(workload_overrides(w, model_dir) + MODES[mode], tmp_path / mode, other_budget=8)
    assert r["budgets"] == [256, 8] and r["tokens"] == 2 * 2 * 6
    for key in ("engine_vs_learner", "learner_vs_learner", "engine_vs_learner_other", "nudged_vs_learner"):
        assert 0.0 <= r[key]["kl_k3"] < 1e-3, (key, r[key])  # the same math on both sides: tiny
        assert 0.0 <= r[key]["tokens_differ"] <= 1.0
    table = summary_table({"workload": "tiny", "device": "cpu", "git_commit": "abcdef0", "modes": {mode: r}})
    assert f"| {mode} | " in table


def test_nudge_moves_picked_inputs_one_ulp_away_from_zero():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(64, 1, bias=False)])

    model = Block().to(torch.bfloat16)
    seen = []
    x = torch.randn(50, 64).to(torch.bfloat16)
    x[0, :5] = 0
    for frac, lo, hi in ((1.0, 1.0, 1.0), (0.3, 0.2, 0.4), (0.0, 0.0, 0.0)):
        hooks = nudge_inputs(model, frac, seed=1)
        hooks.append(model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[0])))  # after it
        model.layers[0](x)
        for h in hooks:
            h.remove()
        y = seen[-1]
        moved = y != x
        assert not moved[0, :5].any()  # zeros stay
        assert lo <= moved[x != 0].float().mean() <= hi
        # one ulp up in magnitude: the next bf16 after |x| away from zero
        xm, ym = x[moved].float(), y[moved].float()
        ulp = torch.ldexp(torch.ones_like(xm), torch.frexp(xm.abs())[1] - 8)
        assert torch.equal(ym.abs() - xm.abs(), ulp) and torch.equal(ym.sign(), xm.sign())
