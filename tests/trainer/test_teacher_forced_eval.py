"""trainer.eval_teacher_forced: each evaluation also scores the eval split's worked solutions
under the learner's own weights (eval/learner_exact, eval/learner_nll)."""

from __future__ import annotations

import pytest

from quarl.config import load_run_config
from quarl.trainer.loop import Trainer
from tests.trainer.test_warmstart import _reference

RUN = ["--model.builtin=tiny", "--trainer.steps=1", "--trainer.sft_warmup_steps=20", "--rollout.max_new_tokens=8",
       "--trainer.prompts_per_step=2", "--data.num_eval=6", "--trainer.tensorboard=false", "--data.reward_workers=0"]


@pytest.mark.parametrize("mode", ["bf16", "rollout"])
def test_evaluation_scores_the_worked_solutions_under_the_learner(tmp_path, mode):
    cfg = load_run_config(None, [*RUN, f"--trainer.run_dir={tmp_path / mode}", f"--quant.mode={mode}",
                                 "--model.dtype=float32"])
    trainer = Trainer(cfg)
    try:
        metrics = trainer.evaluate(log=False)
        pairs = trainer.evaluation.solution_pairs
        assert len(pairs) == 6  # every eval example of the task has a worked solution
        # the learner's weights, one unpadded float64 forward a pair: not the engine's
        exact, nll = _reference(trainer.learner.model, pairs)
        assert metrics["eval/learner_nll"] == pytest.approx(nll, rel=1e-4)
        assert metrics["eval/learner_exact"] == pytest.approx(exact)
        assert 0.0 <= metrics["eval/acc"] <= 1.0  # the greedy decode through the engine is still there
    finally:
        trainer.rewards.close()


def test_teacher_forced_evaluation_can_be_switched_off(tmp_path):
    cfg = load_run_config(None, [*RUN, f"--trainer.run_dir={tmp_path}", "--trainer.eval_teacher_forced=false"])
    trainer = Trainer(cfg)
    try:
        metrics = trainer.evaluate(log=False)
        assert "eval/acc" in metrics and not any(k.startswith("eval/learner_") for k in metrics)
    finally:
        trainer.rewards.close()
