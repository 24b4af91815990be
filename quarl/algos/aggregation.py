"""Masked reductions and loss aggregation over ``[B, T]`` token matrices.

Every function here treats ``mask`` (1.0 on response tokens, 0.0 on prompt and padding)
as the only source of truth about which entries exist: values at masked-out positions
are never read, so padding may hold anything (0, -inf, NaN) without leaking into a
result or a gradient.

The aggregation modes decide how per-token losses become one scalar; the choice is
separate from the loss itself (as in verl's ``agg_loss``):

- ``token-mean``: sum over all response tokens / number of response tokens (DAPO).
- ``seq-mean-token-mean``: mean over the rows of each row's token mean (GRPO, eq. 1
  of QuRL).
- ``seq-mean-token-sum-norm``: mean over the rows of each row's token sum divided by
  a constant ``max_len`` (default T): Dr. GRPO's length-unbiased normalisation.

What the mask removes leaves the denominators: tokens leave the token count, and a row
with no response token left leaves the row count of the sequence means (the rule the
sequence losses follow too).
"""

from __future__ import annotations

import torch

AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with masked-out entries replaced by exact zeros (no NaN/inf leaks)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x * mask`` over ``dim`` (all dims when None). ``x``, ``mask``: same shape."""
    masked = _masked(x, mask) * mask.to(x.dtype)
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is set; 0 where there are none.

    Shapes: ``x``, ``mask`` equal; result is a scalar (``dim=None``) or ``x`` reduced
    over ``dim``.
    """
    count = mask.to(x.dtype)
    count = count.sum() if dim is None else count.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1.0)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of ``x`` over the (boolean) mask, 0 when the mask is empty; no host sync."""
    mask = mask.bool()
    top = torch.where(mask, x, x.new_full((), float("-inf"))).max()
    return torch.where(mask.any(), top, x.new_zeros(()))


def seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-response token mean ``mean_t`` of docs/design.md: ``[B, T] -> [B]``; 0 for empty rows."""
    return masked_mean(x, mask, dim=-1)


def response_rows(mask: torch.Tensor) -> torch.Tensor:
    """Number of rows with at least one response token (0-d long tensor; no host sync)."""
    return (mask.bool().any(-1)).sum()


def check_agg(agg: str) -> None:
    if agg not in AGG_MODES:
        raise ValueError(f"unknown agg {agg!r}; valid: {', '.join(AGG_MODES)}")


def agg_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, agg: str, max_len: int | None = None
) -> torch.Tensor:
    """Reduce a per-token loss ``loss_mat [B, T]`` under ``mask [B, T]`` to a scalar.

    ``agg`` is one of :data:`AGG_MODES` (see the module docstring); ``max_len`` is the
    constant divisor of ``seq-mean-token-sum-norm`` (default T) and is ignored otherwise.
    With no response tokens at all every mode returns 0.
    """
    check_agg(agg)
    if loss_mat.dim() != 2 or loss_mat.shape != mask.shape:
        raise ValueError(
            f"loss_mat and mask must both be [B, T]; got {tuple(loss_mat.shape)} "
            f"and {tuple(mask.shape)}"
        )
    seq_len = loss_mat.shape[1]
    if agg == "token-mean":
        return masked_mean(loss_mat, mask)
    rows = response_rows(mask).to(loss_mat.dtype).clamp(min=1.0)
    if agg == "seq-mean-token-mean":
        return seq_mean(loss_mat, mask).sum() / rows
    norm = seq_len if max_len is None else max_len
    if norm <= 0:
        raise ValueError(f"max_len must be positive, got {norm}")
    return masked_sum(loss_mat, mask, dim=-1).sum() / (norm * rows)
