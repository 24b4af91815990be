"""The dequantized weight an aligned learner linear differentiates: a leaf made once per
weight version, whose gradient goes to the master weights (straight-through)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from quarl.quant import ops
from quarl.quant.kernels.w4_layout import RepackCache
from quarl.quant.qweight import QuantizedWeight

# > 0 inside :func:`deferring`: leaves keep their gradient until its exit. A plain global, not
# a ContextVar or an argument: the leaves' hooks run inside autograd's backward (on its device
# threads for CUDA tensors), which sees neither the caller's context variables nor its frames.
_DEFERRED = 0


@contextlib.contextmanager
def deferring() -> Iterator[None]:
    """Within this block every leaf's hook leaves the accumulated gradient on the leaf (the
    caller flushes the leaves it owns at exit: :func:`quarl.quant.linear.deferred_master_grads`)."""
    global _DEFERRED
    _DEFERRED += 1
    try:
        yield
    finally:
        _DEFERRED -= 1


class DequantizedLeaf:
    """The dequantized weight that ``F.linear`` differentiates where the engine's GEMM is a
    matmul over it (:mod:`quarl.quant.linear`): a leaf tensor made once per weight version, whose
    accumulated gradient a hook hands, row block by row block, to the master weights (at once,
    or at the exit of :func:`deferring`)."""

    def __init__(self, keep: bool = True, straight_through: bool = False) -> None:
        self.leaf: torch.Tensor | None = None
        self.of: QuantizedWeight | None = None
        self.masters: list[torch.Tensor] = []
        # False (:func:`~quarl.quant.linear.set_per_use_dequant`): no leaf; the linear runs _QATMatmul, which
        # dequantizes at each use and keeps nothing (one layer's dense weight at a time)
        self.keep = keep
        # with keep False, in compiled regions (:func:`~quarl.quant.linear.set_straight_through`): the weight
        # dequantized at each use, its gradient passed to the masters through autograd
        self.straight_through = straight_through

    def __deepcopy__(self, memo) -> "DequantizedLeaf":  # a copy's hook would feed this one's masters
        return DequantizedLeaf(self.keep, self.straight_through)

    def __getstate__(self) -> dict:
        return {"leaf": None, "of": None, "masters": [], "keep": self.keep, "straight_through": self.straight_through}

    def get(self, qw: QuantizedWeight, dtype: torch.dtype, repacked: RepackCache,
            masters: list[torch.Tensor]) -> torch.Tensor:
        if self.leaf is not None and self.of is qw and self.leaf.dtype == dtype:
            return self.leaf
        with torch.inference_mode(False), torch.no_grad():
            w = repacked.dequantized(qw, dtype, ops.dequantize)
            leaf = w.clone() if w.is_inference() else w.detach()
        self.flush()
        if any(p.requires_grad for p in masters):
            leaf.requires_grad_(True)
            leaf.register_post_accumulate_grad_hook(lambda t: None if _DEFERRED else self.flush())
        self.leaf, self.of, self.masters = leaf, qw, masters
        return leaf

    def flush(self) -> None:
        """Hand the leaf's accumulated gradient to the master weights (nothing if it has none)."""
        if self.leaf is not None and self.leaf.grad is not None:
            _grad_to_masters(self.leaf, self.masters)

    def drop(self) -> None:
        self.flush()
        self.leaf, self.of, self.masters = None, None, []


def _grad_to_masters(leaf: torch.Tensor, masters: list[torch.Tensor]) -> None:
    g, leaf.grad = leaf.grad, None
    row = 0
    for p in masters:
        part, row = g[row : row + p.shape[0]], row + p.shape[0]
        if not p.requires_grad:
            continue
        part = part.to(p.dtype)
        if p.grad is None:
            p.grad = part  # (a row block of a group's gradient: a view, no second copy of it)
        else:
            p.grad += part
