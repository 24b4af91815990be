"""Which responses a step learns from: DAPO's dynamic sampling and overlong filtering."""

from __future__ import annotations

import torch

from quarl.algos.advantages import _grouped


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[G]`` bool: groups whose rewards are not all equal. DAPO's dynamic sampling
    (Yu et al. 2025, eq. 11) keeps only these: a uniform group has zero group-relative
    advantage and so no policy gradient."""
    g = _grouped(rewards, group_size)
    return g.amax(-1) != g.amin(-1)


def drop_rows(response_mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``response_mask [B, T]`` with the rows flagged in ``rows [B]`` (bool) zeroed: DAPO's
    overlong filtering (Yu et al. 2025, section 3.4) drops responses cut at the length
    limit, whose missing ending makes their reward a poor signal."""
    if rows.shape != response_mask.shape[:1] or rows.dtype != torch.bool:
        raise ValueError(f"rows must be bool [{response_mask.shape[0]}], got {rows.dtype} {tuple(rows.shape)}")
    return torch.where(rows[:, None].to(response_mask.device), torch.zeros_like(response_mask), response_mask)
