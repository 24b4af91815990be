"""The (token, slot) pairs of an MoE layer in expert order, by counting, in one launch.

:func:`quarl.model.moe.sort_by_expert` needs a stable order of the flattened expert ids
``[N * k]`` and each expert's end offset. torch's stable ``argsort`` runs a radix sort (about
27 us on an H100 for the 512 pairs of a 64-sequence decode step of Qwen3-30B-A3B, 48 times a
step), and the offsets take three more launches (zeros, scatter-add, cumsum). Here program
``e`` of a grid over the experts counts the ids below ``e`` (where expert ``e``'s rows
start), then walks the ids again in blocks and writes the index of each of its own pairs at
``start + its rank among them`` (a running count plus a cumulative sum inside the block: the
pairs keep their token order, as a stable sort keeps them), and ``start + count`` as the
expert's end offset. The order is the stable sort's, element for element.

Each program reads all the ids twice: ``E * 2 * N * k`` reads from L2, nothing at decode sizes;
:data:`MAX_PAIRS` bounds where it is used (the learner's and a prefill's tens of thousands of
pairs keep torch's sort). No host sync: CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quarl.quant.kernels.act_quant import interpreting

MAX_PAIRS = 8192  # above this many (token, slot) pairs torch's sort (the reads here grow as E x pairs)


@triton.jit
def _expert_order_kernel(ids_ptr, order_ptr, ends_ptr, total, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    below = tl.zeros((BLOCK,), dtype=tl.int32)
    for s in range(0, total, BLOCK):
        idx = s + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + idx, mask=idx < total, other=0).to(tl.int32)
        below += ((ids < e) & (idx < total)).to(tl.int32)
    pos = tl.sum(below, axis=0)
    for s in range(0, total, BLOCK):
        idx = s + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + idx, mask=idx < total, other=0).to(tl.int32)
        hit = ((ids == e) & (idx < total)).to(tl.int32)
        rank = tl.cumsum(hit, axis=0)  # 1-based among this block's pairs of expert e
        tl.store(order_ptr + pos + rank - 1, idx.to(tl.int64), mask=hit > 0)
        pos += tl.sum(hit, axis=0)
    tl.store(ends_ptr + e, pos)


def expert_order(flat_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order [P] int64, ends [E] int32)`` of expert ids ``flat_ids [P]`` (any integer dtype,
    each in ``0 .. E-1``): the stable sort's permutation (the pairs of one expert in their own
    order) and each expert's end in it, as :func:`quarl.model.moe.sort_by_expert` returns them."""
    if flat_ids.dim() != 1:
        raise ValueError(f"expert ids must be flat [pairs], not {tuple(flat_ids.shape)}")
    total = flat_ids.numel()
    order = torch.empty(total, dtype=torch.int64, device=flat_ids.device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=flat_ids.device)
    block = 64 if interpreting(flat_ids) else 1024
    _expert_order_kernel[(num_experts,)](flat_ids.contiguous(), order, ends, total, BLOCK=block, num_warps=4)
    return order, ends
