"""Stages 5-6 (quarl.trainer.update.update_policy) around a stand-in learner: when the update
runs an old-logp pass, and exact mode's use of the sampler's log-probs in its place."""

from __future__ import annotations

import pytest
import torch

from quarl.config.run import AlgoConfig
from quarl.distributed import Dist
from quarl.learner.batch import build_batch
from quarl.learner.learner import UpdateSettings
from quarl.trainer.update import update_policy


class StandIn:
    """A learner whose every forward gives ``logp`` (``[B, T-1]``); records its passes."""

    routing_replay = False

    def __init__(self, logp: torch.Tensor) -> None:
        self.logp, self.passes, self.old_seen = logp, 0, None

    def route_tally(self):
        return None

    def logprobs(self, batch, budget, temperature, tally=None, **kw):
        self.passes += 1
        return self.logp.clone()

    def update(self, batch, settings, returns=None, tally=None):
        self.old_seen = None if batch.old_logp is None else batch.old_logp.clone()
        self.last_logp = self.logp * batch.response_mask
        return {"loss": 0.0}


def _batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    prompts = [[1, 2, 3], [4, 5]]
    responses = [[6, 7, 8, 9], [10, 11, 12]]
    logps = [(-torch.rand(len(r), generator=gen) * 3).tolist() for r in responses]
    return build_batch(prompts, responses, logps, [1.0, 0.0], torch.tensor([1.0, -1.0]))


def _run(exact: bool, learner_off: float = 0.0, mini_batches: int = 1, **algo):
    batch = _batch(0)
    mask = batch.response_mask.bool()
    logp = torch.where(mask, batch.sampler_logp + learner_off, torch.zeros_like(batch.sampler_logp))
    learner = StandIn(logp)
    cfg = AlgoConfig(loss="ppo", **algo)
    result, _ = update_policy(batch, learner, cfg, UpdateSettings(loss_type="ppo", mini_batches=mini_batches),
                              Dist(), exact=exact)
    return learner, result, batch


def test_exact_rejecting_correction_takes_the_sampler_logp_and_still_checks_the_learner():
    learner, result, batch = _run(True, correction="icepop")
    assert learner.passes == 0 and result.extra_forwards == 0
    assert torch.equal(learner.old_seen, batch.sampler_logp)  # the loss's old_logp: the sampler's bits
    assert batch.old_logp is None  # (the step's metrics read the update's own forward)
    assert result.mismatch["mismatch/max_abs_logp_diff"] == 0.0 and result.mismatch["mismatch/kl_k3"] == 0.0
    assert result.metrics["correction/drop_frac"] == 0.0
    # the learner's own forward still judges exactness: a learner 0.25 off shows up
    _, off, _ = _run(True, learner_off=0.25, correction="icepop")
    assert off.mismatch["mismatch/max_abs_logp_diff"] == pytest.approx(0.25)


@pytest.mark.parametrize("exact,mini_batches,algo", [
    (False, 1, {"correction": "icepop"}),  # not exact: the learner's own pass
    (True, 2, {"correction": "icepop"}),  # two optimizer steps: later ones need the pass's log-probs
    (True, 1, {"correction": "icepop", "truncate_at_error": True}),  # truncation: the pass
])
def test_the_old_logp_pass_runs_where_it_must(exact, mini_batches, algo):
    learner, result, _ = _run(exact, learner_off=0.01, mini_batches=mini_batches, **algo)
    assert learner.passes == 1 and result.extra_forwards == 1
    assert torch.equal(learner.old_seen, learner.logp)


def test_no_rejection_no_pass_and_no_borrowing():
    learner, result, _ = _run(True)
    assert learner.passes == 0 and learner.old_seen is None and result.extra_forwards == 0
