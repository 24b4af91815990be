"""eval/learner_nll on a GPU, in each mode: the teacher-forced score of the eval split's
worked solutions equals the learner's own log-probs of them (its training forward, on the
engine's kernels in aligned mode)."""

from __future__ import annotations

import pytest
import torch

from quarl.config import load_run_config
from quarl.learner.batch import build_batch
from quarl.trainer.loop import Trainer

RUN = ["--model.builtin=tiny", "--trainer.steps=1", "--trainer.sft_warmup_steps=30", "--rollout.max_new_tokens=16",
       "--trainer.prompts_per_step=2", "--data.num_eval=16", "--trainer.tensorboard=false",
       "--data.reward_workers=0", "--model.dtype=bfloat16"]


@pytest.mark.parametrize("mode,scheme", [("bf16", "w4a16"), ("rollout", "w4a16"), ("aligned", "w4a16"),
                                         ("aligned", "w8a8-int8"), ("aligned", "w8a8-fp8")])
def test_learner_nll_is_the_learners_own_logprobs(tmp_path, mode, scheme):
    cfg = load_run_config(None, [*RUN, f"--trainer.run_dir={tmp_path}", f"--quant.mode={mode}",
                                 f"--quant.scheme={scheme}"])
    trainer = Trainer(cfg)
    try:
        assert trainer.device.type == "cuda"
        metrics = trainer.evaluate(log=False)
        pairs = trainer.evaluation.solution_pairs
        batch = build_batch([p for p, _ in pairs], [r for _, r in pairs], [[0.0] * len(r) for _, r in pairs],
                            [0.0] * len(pairs), torch.zeros(len(pairs))).to(trainer.device)
        logp = trainer.learner.logprobs(batch, 1 << 20)
        mask = batch.response_mask
        nll = float(-(logp * mask).sum() / mask.sum())
        assert metrics["eval/learner_nll"] == pytest.approx(nll, rel=2e-2)  # bf16 autocast against the learner's path
        assert 0.0 <= metrics["eval/learner_exact"] <= 1.0
    finally:
        trainer.rewards.close()
