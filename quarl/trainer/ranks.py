"""A step's numbers over every rank: each rank holds its share of the step's rollouts, and
the metrics (and DAPO's choice of groups) are taken over their union, in rank order."""

from __future__ import annotations

import dataclasses

import torch

from quarl.distributed import Dist
from quarl.trainer.stages import Rollout


def union_of_ranks(dist: Dist, rollout: Rollout, routes: bool = False) -> Rollout:
    """Every rank's groups of ``rollout`` in rank order (the step's prompt order), the
    verifier's counts and the generated tokens summed over the ranks (DAPO's counts were
    taken over every rank already). The completions' MoE routes (``Completion.routes``,
    ~100x the bytes of their tokens) go along only where asked: the step's metrics do not
    read them, DAPO's choice hands the kept groups back to the ranks' learners."""
    if dist.world == 1:
        return rollout
    if not routes and any(c.routes is not None for c in rollout.completions):
        rollout = dataclasses.replace(rollout, completions=[dataclasses.replace(c, routes=None)
                                                            for c in rollout.completions])
    parts = dist.gather(rollout)
    union = parts[0]
    for part in parts[1:]:
        union = union.extend(part)
    counts = {k: sum(p.reward_metrics.get(k, 0.0) for p in parts) if k.startswith("reward/") else v
              for k, v in parts[0].reward_metrics.items()}
    return dataclasses.replace(union, reward_metrics=counts,
                               generated_tokens=sum(p.generated_tokens for p in parts))


def rows_of_all_ranks(dist: Dist, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``[B, T]`` tensors of every rank stacked by rows in rank order (each padded with zeros
    to the widest rank's ``T``), on this rank's device."""
    if dist.world == 1:
        return tensors
    parts = dist.gather([t.detach().cpu() for t in tensors])
    width = max(p[0].shape[1] for p in parts)
    out = []
    for i, t in enumerate(tensors):
        rows = [torch.nn.functional.pad(p[i], (0, width - p[i].shape[1])) for p in parts]
        out.append(torch.cat(rows).to(t.device))
    return tuple(out)


def cat_of_all_ranks(dist: Dist, values: torch.Tensor) -> torch.Tensor:
    """``[B]`` tensors of every rank concatenated in rank order, on this rank's device."""
    if dist.world == 1:
        return values
    return torch.cat(dist.gather(values.detach().cpu())).to(values.device)
