"""The engine's LoRA decode kernels against torch (TRITON_INTERPRET=1 on CPU, small shapes).

The interpreter mishandles bf16 loads, so the CPU tests run the kernels on float32 tensors
(``h.to(b.dtype)`` is then exact); bf16 runs in the engine's GPU tests."""

from __future__ import annotations

import pytest
import torch

from quarl.rollout import lora_kernels


@pytest.mark.parametrize("m,k,r", [(1, 96, 16), (7, 300, 48), (33, 520, 192), (64, 128, 64)])
def test_shrink_matches_matmul(m, k, r):
    """Split K (ragged last slice, R over several blocks): the float32 product."""
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g)
    a = torch.randn(r, k, generator=g)
    want = x.double() @ a.double().T
    got = lora_kernels.lora_shrink(x, a)
    assert got.dtype == torch.float32 and got.shape == (m, r)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("segments", [[(0, 0)], [(0, 0), (64, -1), (96, 16)], [(0, -1), (32, 0), (64, 16), (128, 32)]])
def test_expand_adds_each_members_block_into_its_columns(segments):
    """``y += s * h B^T`` over each adapted member's columns only (a block-diagonal B whose
    off-block entries are garbage: they must not be read); the columns of members without an
    adapter are left as they were."""
    g = torch.Generator().manual_seed(len(segments))
    rank, m = 16, 5
    starts = [s for s, _ in segments] + [160 if len(segments) > 1 else 64]
    n = starts[-1]
    r_total = 16 * sum(c >= 0 for _, c in segments)
    y = torch.randn(m, n, generator=g)
    h = torch.randn(m, r_total, generator=g)
    b = torch.randn(n, r_total, generator=g)  # garbage off the members' blocks
    want = y.double().clone()
    for (lo, col), hi in zip(segments, starts[1:]):
        if col >= 0:
            prod = h[:, col : col + rank].double() @ b[lo:hi, col : col + rank].double().T
            want[:, lo:hi] += 0.5 * prod
    got = y.clone()
    lora_kernels.lora_expand(got, h, b, 0.5, segments, rank)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    for (lo, col), hi in zip(segments, starts[1:]):
        if col < 0:
            assert torch.equal(got[:, lo:hi], y[:, lo:hi])


def test_expandable_needs_a_common_block_and_a_dot_rank():
    assert lora_kernels.expandable([(0, 0), (3584, 64)], 64)
    assert not lora_kernels.expandable([(0, 0), (24, 16)], 16)  # no 16-column block divides 24
    assert not lora_kernels.expandable([(0, 0)], 24) and not lora_kernels.expandable([(0, 0)], 8)
    with pytest.raises(ValueError, match="no common column block"):
        lora_kernels.lora_expand(torch.zeros(1, 40), torch.zeros(1, 32), torch.zeros(40, 32), 1.0, [(0, 0), (24, 16)], 16)


def test_group_adapter_runs_the_kernels_where_they_apply(monkeypatch):
    """A fused group's adapters through the kernels give the addmm path's values."""
    from quarl.model.lora import add_lora, lora_modules
    from quarl.model.presets import build_random_model
    from quarl.rollout.fused import fuse_projections

    model = build_random_model("tiny", seed=4, std=0.2)
    add_lora(model, rank=16, alpha=32, targets=("q_proj", "v_proj", "gate_proj", "up_proj"))
    with torch.no_grad():
        for _, _, ad in lora_modules(model):
            ad.A.normal_(0, 0.2)
            ad.B.normal_(0, 0.2)
    fuse_projections(model)
    group = model.layers[0].self_attn._fused_qkv.adapters
    assert group.kernels and group.segments == [(0, 0), (64, -1), (96, 16)]
    x = torch.randn(6, 64)
    y = torch.randn(6, 128)
    with torch.no_grad():
        want = y.clone()
        group.add_into(want, x)  # CPU tensors: the addmm path
        monkeypatch.setattr(lora_kernels, "applies", lambda rows: True)
        got = y.clone()
        group.add_into(got, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - y).abs().max() > 0.05


def test_one_adapter_adds_in_place_where_the_kernels_apply(monkeypatch):
    """``add_into`` (o_proj / down_proj in the engine): ``y + s B (A x)`` in place; False and
    ``y`` untouched where the kernels do not apply (here: CPU rows)."""
    g = torch.Generator().manual_seed(3)
    x, a, b = torch.randn(3, 2, 80, generator=g), torch.randn(32, 80, generator=g), torch.randn(48, 32, generator=g)
    y = torch.randn(3, 2, 48, generator=g)
    want = y.double() + 0.25 * (x.double() @ a.double().T) @ b.double().T
    kept = y.clone()
    assert not lora_kernels.add_into(kept, x, a, b, 0.25) and torch.equal(kept, y)
    monkeypatch.setattr(lora_kernels, "applies", lambda rows: rows.shape == (6, 80))
    got = y.clone()
    assert lora_kernels.add_into(got, x, a, b, 0.25)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
