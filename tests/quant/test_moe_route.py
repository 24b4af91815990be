"""The one-launch MoE routing kernel (interpreter) against quarl.model.moe.route's torch ops:
the same experts in the same order, the same weights up to the float32 softmax's last bits."""

from __future__ import annotations

import pytest
import torch

from quarl.model.moe import route
from quarl.quant.kernels.moe_route import route_topk


@pytest.mark.parametrize("tokens,experts,k,norm", [
    (7, 128, 8, True), (5, 128, 8, False), (9, 60, 4, True), (3, 8, 2, True), (4, 64, 6, True), (0, 16, 2, True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_topk_is_route(needs_triton, tokens, experts, k, norm, dtype):
    gen = torch.Generator().manual_seed(tokens * 7 + experts + k)
    logits = (torch.randn(tokens, experts, generator=gen) * 2).to(dtype)
    weights, ids = route_topk(logits, k, norm, dtype)
    want_w, want_ids, _ = route(logits, k, norm, dtype)
    assert weights.dtype == dtype and ids.dtype == torch.int64 and ids.shape == (tokens, k)
    assert torch.equal(ids, want_ids)
    # float32: a few ulps (the softmax's sum in another order); bfloat16: one rounding step apart at
    # most (the interpreter's float32 -> bfloat16 cast truncates where a GPU rounds to nearest)
    tol = dict(rtol=2e-6, atol=1e-8) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=0)
    torch.testing.assert_close(weights, want_w, **tol)
    if norm and tokens:
        torch.testing.assert_close(weights.double().sum(-1), torch.ones(tokens, dtype=torch.float64),
                                   rtol=0, atol=3e-2 if dtype == torch.bfloat16 else 1e-6)


def test_route_topk_reads_a_strided_row_and_breaks_ties_by_expert(needs_triton):
    """Equal bf16 logits are common among 128 experts: both routes take the lower expert id."""
    # a slice of a wider buffer (row stride 40), and ties: experts 3 and 5 equal, 9 and 1 equal
    buf = torch.full((2, 40), -3.0)
    logits = buf[:, :12]
    logits[:, [3, 5]] = 2.0
    logits[:, [9, 1]] = 1.0
    logits[1, 7] = 4.0
    weights, ids = route_topk(logits, 4, False, torch.float32)
    assert ids.tolist() == [[3, 5, 1, 9], [7, 3, 5, 1]]
    assert torch.equal(route(logits, 4, False, torch.float32)[1], ids)  # the torch ops' rule too
    probs = torch.softmax(logits.double(), dim=-1)
    torch.testing.assert_close(weights.double(), probs.gather(1, ids), rtol=1e-6, atol=0)


def test_route_topk_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="experts"):
        route_topk(torch.zeros(2, 300), 8, True, torch.float32)
    with pytest.raises(ValueError, match="top_k"):
        route_topk(torch.zeros(2, 4), 8, True, torch.float32)
    with pytest.raises(ValueError, match="tokens, experts"):
        route_topk(torch.zeros(2, 3, 4), 2, True, torch.float32)
