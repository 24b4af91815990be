"""``quarl bench train``'s parts on CPU: the per-mode run, medians, model FLOPs."""

from __future__ import annotations

import pytest

from quarl.bench.train import MODES, Workload, learner_flops, median_metrics, run_mode, save_random_model, \
    summarize, workload_overrides


def test_learner_flops_by_hand():
    # 6 * 1e6 params * 1000 tokens = 6e9; one extra forward adds 2e9
    assert learner_flops(10**6, 1000, 0) == 6e9
    assert learner_flops(10**6, 1000, 1) == 8e9


def test_medians_skip_the_first_step():
    rows = [{"time/step": 9.0, "mismatch/kl_k3": 1.0}, {"time/step": 1.0, "mismatch/kl_k3": None},
            {"time/step": 3.0, "mismatch/kl_k3": 2.0}, {"time/step": 2.0}]
    assert median_metrics(rows) == {"step_s": 2.0, "kl_k3": 2.0}


@pytest.mark.parametrize("mode", ["bf16", "aligned-w4a16"])
def test_run_mode_on_a_saved_random_model(tmp_path, mode):
    w = Workload("tiny", prompts=2, n=2, gen=6, token_budget=256, steps=2)
    model_dir = save_random_model(w.shape, tmp_path / "model")
    rows, info = run_mode(mode, workload_overrides(w, model_dir) + MODES[mode], tmp_path / mode)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["response/len_mean"] == 6 for r in rows)  # random weights: forced length
    assert info["extra_forwards"] == 0 and info["prompt_len_mean"] > 0
    med = summarize(rows, info, matmul_params=1000, bf16_rate=1e12, rollouts=w.prompts * w.n)
    tokens = 4 * (info["prompt_len_mean"] + 6)
    assert med["learner_tokens"] == pytest.approx(tokens)
    assert med["learner_mfu"] == pytest.approx(6 * 1000 * tokens / rows[1]["time/learner"] / 1e12)
    assert med["step_s"] == rows[1]["time/step"]
