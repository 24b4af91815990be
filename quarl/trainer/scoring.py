"""Stage 4 of a step: the rollout as the learner's batch, with each response's advantage."""

from __future__ import annotations

import torch

from quarl.algos import compute_advantages, drop_rows
from quarl.config.run import AlgoConfig
from quarl.learner.batch import RolloutBatch, build_batch
from quarl.trainer.stages import Rollout


def batch_with_advantages(rollout: Rollout, algo: AlgoConfig, n: int, overlong_filter: bool) -> RolloutBatch:
    """The learner's batch of ``rollout`` (``n`` completions a prompt) with group-relative
    advantages (GAE's are filled in by the update, from the critic) and, where the engine
    recorded them (an MoE model), the routes of its tokens; ``overlong_filter``: responses cut at
    the length limit leave the batch's response mask."""
    adv = torch.zeros_like(rollout.rewards) if algo.advantage == "gae" else \
        compute_advantages(algo.advantage, rollout.rewards, n)
    comps = rollout.completions
    routes = [c.routes for c in comps] if comps and all(c.routes is not None for c in comps) else None
    batch = build_batch([rollout.prompts[c.prompt_index] for c in comps], [c.token_ids for c in comps],
                        [c.logprobs for c in comps], rollout.rewards.tolist(), adv, routes)
    if overlong_filter:
        truncated = torch.tensor([c.finish_reason == "length" for c in comps])
        batch.response_mask = drop_rows(batch.response_mask, truncated)
    return batch
