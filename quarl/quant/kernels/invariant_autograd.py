"""The autograd pieces of exact mode's forward (:mod:`.invariant_model`, :mod:`.invariant_moe`):
a forward through a batch-invariant kernel whose backward is the ordinary path's."""

from __future__ import annotations

import torch


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class Recomputed(torch.autograd.Function):
    """``fast(*inputs)`` forward (the invariant kernel); the backward differentiates
    ``ref(*inputs)`` (the ordinary torch path of the same function), recomputed from the
    saved inputs."""

    @staticmethod
    def forward(ctx, fast, ref, *inputs):  # type: ignore[override]
        ctx.ref = ref
        ctx.save_for_backward(*inputs)
        return fast(*inputs)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        needs = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs)]
            out = ctx.ref(*leaves)
            wanted = [t for t, need in zip(leaves, needs) if need]
            grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (None, None, *[next(grads) if need else None for need in needs])


def invariant_or_recomputed(fast, ref, *inputs: torch.Tensor) -> torch.Tensor:
    """``fast(*inputs)``; where gradients flow through it, as :class:`Recomputed` (the
    backward of ``ref``)."""
    if needs_grad(*inputs):
        return Recomputed.apply(fast, ref, *inputs)
    return fast(*inputs)
