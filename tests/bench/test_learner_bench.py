"""``quarl bench learner`` on CPU: one micro-batch's measurement, the gradients it
accumulates, bad settings, and a mode measured against a baseline package in child processes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from quarl.bench.learner import (
    Spec, build, check_mode, measure, model_config, run_benchmark, run_micro_batch, summary_table,
)
from quarl.model.transformer import TORCH_OPS

CPU = torch.device("cpu")


def test_a_micro_batch_accumulates_the_gradient_of_its_weighted_log_probs():
    """Two micro-batches leave twice one micro-batch's gradient in ``.grad`` (gradient
    accumulation), and that gradient is the derivative of ``sum(w * log p)``."""
    spec = Spec("tiny", layers=1, tokens=24, seq_len=12)
    model, ids, mask, weights = build(model_config(spec), None, spec, CPU)
    assert ids.shape == (2, 12) and weights.shape == (2, 11)
    run_micro_batch(model, ids, mask, weights, TORCH_OPS)
    one = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    run_micro_batch(model, ids, mask, weights, TORCH_OPS)
    assert len(one) > 5
    for n, p in model.named_parameters():
        if n in one:
            torch.testing.assert_close(p.grad, 2 * one[n], rtol=1e-2, atol=1e-6)
    probe = model.norm.weight
    with torch.no_grad():  # the norm weight's gradient by a finite difference of the float64 sum
        base = _weighted_logp(model, ids, mask, weights)
        probe[0] += 0.5
        bumped = _weighted_logp(model, ids, mask, weights)
        probe[0] -= 0.5
    fd = (bumped - base) / 0.5
    assert abs(float(one["norm.weight"][0]) - fd) <= 0.1 * abs(fd) + 0.05, (float(one["norm.weight"][0]), fd)


def _weighted_logp(model, ids, mask, weights) -> float:
    from quarl.learner.logprobs import sequence_logprobs

    lp, _ = sequence_logprobs(model, ids, mask, right_padded=True, ops=TORCH_OPS)
    return float((lp.double() * weights.double()).sum())


@pytest.mark.parametrize("mode,profile", [("bf16", None), ("aligned-w8a8-fp8", "host")])
def test_measure_reports_every_repeat_per_micro_batch(mode, profile):
    spec = Spec("tiny", layers=2, tokens=32, seq_len=16, micro_batches=2, reps=3, warmup=1)
    r = measure(model_config(spec), check_mode(mode), spec, CPU, profile)
    assert len(r["walls_ms"]) == 3 and r["host_ms"] > 0 and r["wall_ms_min"] <= r["wall_ms"] <= r["wall_ms_max"]
    # (no GPU: no kernel time)
    assert r["kernels_ms"] is None and r["host_over_kernels"] is None and r["idle_ms"] is None
    assert r["fallbacks"] == 0  # every layer ran as the compiled regions
    if profile:  # where one more repeat's host time went, by function
        assert r["profile"][0].startswith("2 micro-batches: host")
        assert any("compiled_ops.py" in ln for ln in r["profile"])
    else:
        assert "profile" not in r


def test_bad_settings_name_the_fix():
    with pytest.raises(ValueError, match="unknown mode 'w4a16'; choose from bf16, aligned-w4a16"):
        check_mode("w4a16")
    with pytest.raises(ValueError, match="tokens >= seq_len >= 2"):
        Spec(tokens=100, seq_len=1024)
    with pytest.raises(ValueError, match="--micro-batches, --reps and --layers must be at least 1"):
        Spec(reps=0)
    with pytest.raises(ValueError, match="no quarl/ package there"):
        run_benchmark(["bf16"], Spec("tiny", layers=1, tokens=16, seq_len=8), baseline=Path("/nonexistent"))


def test_a_mode_against_a_baseline_package_runs_each_in_its_own_process(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(Path(__file__).resolve().parents[2] / "quarl", base / "quarl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    spec = Spec("tiny", layers=1, tokens=16, seq_len=8, micro_batches=1, reps=2, warmup=1, compiled=False)
    out = tmp_path / "r.json"
    result = run_benchmark(["bf16"], spec, out, base, "abc1234")
    r = result["modes"]["bf16"]
    assert r["baseline"]["git_commit"] == "abc1234" and len(r["baseline"]["walls_ms"]) == 2
    assert set(r["vs_baseline"]) == {"host_ms", "wall_ms"} and r["vs_baseline"]["host_ms"] > 0
    assert out.is_file() and result["layers"] == 1
    table = summary_table(result)
    assert "| bf16 |" in table and "| bf16 (baseline abc1234) |" in table
