"""trainer.eval_before_train: the step-0 policy is evaluated first and logged as step 0."""

from __future__ import annotations

import json

from quarl.cli.main import main
from quarl.config import load_run_config


def _train(run_dir, *extra):
    code = main(["train", "--model.builtin=tiny", "--trainer.steps=1", "--trainer.eval_every=0",
                 "--trainer.sft_warmup_steps=5", "--rollout.max_new_tokens=8", "--trainer.prompts_per_step=2",
                 "--data.num_eval=4", "--trainer.tensorboard=false", f"--trainer.run_dir={run_dir}", "--quiet", *extra])
    assert code == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_eval_before_train_logs_the_step_zero_policy(tmp_path):
    assert load_run_config().trainer.eval_before_train is False  # off unless asked for
    rows = _train(tmp_path / "on", "--trainer.eval_before_train=true")
    assert [r["step"] for r in rows] == [0, 1]
    first = rows[0]
    assert 0.0 <= first["eval/acc"] <= 1.0 and "eval/reward_mean" in first
    assert "reward/mean" not in first and not any(k.startswith(("time/", "mismatch/")) for k in first)
    assert first["perf/eval_s"] > 0  # the evaluation's own seconds
    assert first["perf/setup_s"] > 0 and "perf/setup_s" not in rows[1]  # the run's set-up, in the first row alone
    assert "reward/mean" in rows[1] and "eval/acc" not in rows[1]  # eval_every=0: no evaluation after the step
    rows = _train(tmp_path / "off")
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["perf/setup_s"] > 0  # no step-0 row: the first step's row carries it
    assert not any(k.startswith("eval/") for k in rows[0])
