"""The counting kernel of an MoE layer's expert order (interpreter) gives torch's stable sort's
permutation and sort_by_expert's offsets, element for element."""

from __future__ import annotations

import pytest
import torch

from quarl.model.moe import sort_by_expert
from quarl.quant.kernels.moe_sort import expert_order


@pytest.mark.parametrize("tokens,k,experts,dtype", [
    (1, 8, 128, torch.int64), (64, 8, 128, torch.int64), (37, 2, 8, torch.int16), (5, 4, 64, torch.int32),
    (0, 8, 16, torch.int64),
])
def test_expert_order_is_the_stable_sort(tokens, k, experts, dtype):
    gen = torch.Generator().manual_seed(tokens * 131 + experts)
    # a skewed routing: some experts many pairs, many none
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, k, dtype=torch.int64)
    ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.3, ids % 3, ids).to(dtype)
    order, ends = expert_order(ids.reshape(-1), experts)
    want_order, want_ends = sort_by_expert(ids.long(), experts)  # (the CPU path: torch's stable argsort)
    assert order.dtype == torch.int64 and ends.dtype == torch.int32
    assert torch.equal(order, want_order)
    assert torch.equal(ends, want_ends)
    assert int(ends[-1]) == tokens * k


def test_expert_order_refuses_a_batch_shape():
    with pytest.raises(ValueError, match="flat"):
        expert_order(torch.zeros(2, 3, dtype=torch.int64), 4)
