"""The grouped int4 MoE kernel on a GPU (run on the GPU machine; not part of CI): against the
dequantize + grouped GEMM path on Qwen3-30B-A3B's expert shapes at decode and prefill row
counts, inside a CUDA graph, and through the engine's QuantExperts."""

from __future__ import annotations

import pytest
import torch

from quarl.model.moe import sort_by_expert
from quarl.quant import quantize_weight, use_backend
from quarl.quant.experts import grouped_quant_linear

DEV = torch.device("cuda")
E, TOP_K = 128, 8
SHAPES = {"gate_up": (2 * 768, 2048), "down": (2048, 768)}  # (N, K) of one expert


def _rows(tokens: int, k_dim: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    ids = torch.stack([torch.randperm(E, device=DEV, generator=g)[:TOP_K] for _ in range(tokens)])
    order, offsets = sort_by_expert(ids, E)
    x = torch.randn(tokens * TOP_K, k_dim, device=DEV, generator=g, dtype=torch.bfloat16)
    return x, offsets


SCHEMES = ["w4a16", "w4a16-asym", "w8a8-int8", "w8a8-fp8"]


def _configs():
    from quarl.quant.kernels.moe_gemm import MoeConfig

    return [None, MoeConfig(16, 64, 4, 4), MoeConfig(16, 64, 4, 4, swap=True), MoeConfig(32, 64, 4, 4, swap=True),
            MoeConfig(64, 128, 4, 3, swap=True)]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("proj", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 8, 64, 512])
def test_kernel_equals_the_dequantize_path(scheme, proj, tokens):
    """Every tile config (both operand orders) against dequantize + grouped_mm; W8A8's rows go
    in as the GEMM sees them (quantized and dequantized per token), as grouped_quant_linear
    gives them to the kernel."""
    from quarl.quant import ops
    from quarl.quant.kernels.moe_gemm import grouped_gemm

    n, k = SHAPES[proj]
    qw = quantize_weight(0.02 * torch.randn(E * n, k, device=DEV), scheme)
    x, offsets = _rows(tokens, k, seed=tokens)
    with use_backend("auto"):
        want = grouped_quant_linear(x, qw, offsets, E).float()  # dequantize + grouped_mm
    fmt = qw.scheme.act_format
    seen = x if fmt == "none" else ops.quantize_input(x, fmt, torch.bfloat16)[2]
    for cfg in _configs():
        got = grouped_gemm(seen, offsets, qw, E, cfg).float()
        rel = float((got - want).norm() / want.norm())
        assert rel < 5e-3, (cfg, rel)  # the same bf16 operands, fp32 sums in another order, one rounding each


@pytest.mark.parametrize("scheme", SCHEMES)
def test_engine_experts_on_the_kernel_equal_the_dequantize_path(scheme):
    """QuantExperts (the engine's) of Qwen3-30B-A3B's expert shape, one layer: the Triton
    backend (the kernel) against the reference backend's dequantize path, decode and prefill
    row counts; and `auto` takes the kernel exactly where moe_rules.kernel_wins says."""
    from quarl.quant.kernels import moe_gemm
    from quarl.quant.kernels.moe_rules import kernel_wins
    from quarl.quant.experts import QuantExperts

    hidden, inter = SHAPES["down"][0], SHAPES["down"][1]
    qx = QuantExperts(hidden, inter, E, scheme, dtype=torch.bfloat16, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(0)
    qx.load_quantized({"gate_up_proj": 0.02 * torch.randn(E, 2 * inter, hidden, device=DEV, generator=g),
                       "down_proj": 0.02 * torch.randn(E, hidden, inter, device=DEV, generator=g)})
    for tokens in (4, 64, 1024):
        x = torch.randn(tokens, hidden, device=DEV, generator=g, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device=DEV, generator=g)[:TOP_K] for _ in range(tokens)])
        w = torch.softmax(torch.randn(tokens, TOP_K, device=DEV, generator=g), -1).bfloat16()
        calls = []
        real = moe_gemm.grouped_gemm

        def spy(*args, **kw):
            calls.append(1)
            return real(*args, **kw)

        with torch.inference_mode():
            with use_backend("reference"):
                want = qx(x, ids, w).float()
            with use_backend("triton"):
                got = qx(x, ids, w).float()
            moe_gemm.grouped_gemm = spy
            try:
                with use_backend("auto"):
                    qx(x, ids, w)
            finally:
                moe_gemm.grouped_gemm = real
        rel = float((got - want).norm() / want.norm())
        assert rel < 1e-2, (tokens, rel)
        assert len(calls) == (2 if kernel_wins(qx.scheme, tokens * TOP_K, E) else 0), tokens


def test_kernel_runs_inside_a_cuda_graph():
    from quarl.quant.kernels.moe_gemm import grouped_gemm

    n, k = SHAPES["gate_up"]
    qw = quantize_weight(0.02 * torch.randn(E * n, k, device=DEV), "w4a16")
    x, offsets = _rows(16, k, seed=3)
    for cfg in _configs():
        eager = grouped_gemm(x, offsets, qw, E, cfg)  # (compiles)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = grouped_gemm(x, offsets, qw, E, cfg)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), cfg


@pytest.mark.parametrize("tokens", [1, 64, 256, 1024, 2048])
def test_counting_expert_order_on_the_gpu_is_the_stable_sort(tokens):
    """sort_by_expert on the GPU (the counting kernel up to MAX_PAIRS pairs, torch's sort above)
    against torch's stable argsort and a bincount, inside a CUDA graph too."""
    g = torch.Generator(device=DEV).manual_seed(tokens)
    ids = torch.stack([torch.randperm(E, device=DEV, generator=g)[:TOP_K] for _ in range(tokens)])
    order, offsets = sort_by_expert(ids, E)
    flat = ids.reshape(-1)
    assert torch.equal(order, torch.argsort(flat, stable=True))
    assert torch.equal(offsets, torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sort_by_expert(ids, E)
    ids.copy_(torch.flip(ids, dims=(0,)))
    graph.replay()
    assert torch.equal(captured[0], torch.argsort(ids.reshape(-1), stable=True))



@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-asym"])
def test_kernel_weights_are_the_dequantized_values_bit_for_bit(scheme):
    """One-hot rows read the weights back: row ``j`` of expert ``e`` (a 1 in column ``j``)
    gives expert e's dequantized column ``j`` exactly, whatever the summation order (every
    other product is zero). So the kernel's in-register bf16 dequantization (packed bf16
    subtract and scale) equals ``dequantize``'s fp32 product rounded once, in every config."""
    from quarl.quant.kernels.moe_gemm import grouped_gemm

    e, n, k = 4, 192, 384
    qw = quantize_weight(0.05 * torch.randn(e * n, k, device=DEV), scheme)
    want = qw.dequantize(torch.bfloat16).view(e, n, k).transpose(1, 2).reshape(e * k, n)
    x = torch.eye(k, device=DEV, dtype=torch.bfloat16).repeat(e, 1)
    offsets = torch.arange(1, e + 1, device=DEV, dtype=torch.int32) * k
    for cfg in _configs():
        assert torch.equal(grouped_gemm(x, offsets, qw, e, cfg), want), cfg


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("tokens", [8, 64, 512])
def test_fused_steps_equal_the_unfused_ones(scheme, tokens):
    """The fused gather + gate/up + SiLU-and-mul and down + weighted scatter (what QuantExperts
    runs where the kernel takes both projections) against the same kernel unfused with torch's
    steps between: the scatter bit for bit; SiLU-and-mul as the engine's fused kernel computes
    it, torch's bits (one rounding step at most, seldom, where exp's last bit differs)."""
    from quarl.quant import ops
    from quarl.quant.kernels.moe_gemm import grouped_gemm

    hidden, inter = SHAPES["down"]
    g = torch.Generator(device=DEV).manual_seed(tokens)
    gate_up = quantize_weight(0.02 * torch.randn(E * 2 * inter, hidden, device=DEV, generator=g), scheme)
    down = quantize_weight(0.02 * torch.randn(E * hidden, inter, device=DEV, generator=g), scheme)
    x = torch.randn(tokens, hidden, device=DEV, generator=g, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=DEV, generator=g)[:TOP_K] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, TOP_K, device=DEV, generator=g), -1).bfloat16()
    order, offsets = sort_by_expert(ids, E)
    fmt = gate_up.scheme.act_format

    def seen(rows):
        return rows if fmt == "none" else ops.quantize_input(rows.contiguous(), fmt, torch.bfloat16)[2]

    rows = x.unsqueeze(1).expand(tokens, TOP_K, hidden).reshape(-1, hidden)[order]
    gate, up = grouped_gemm(seen(rows), offsets, gate_up, E).chunk(2, dim=-1)
    hidden_ref = torch.nn.functional.silu(gate) * up
    got = grouped_gemm(seen(x), offsets, gate_up, E, gated=True, order=order, slots=TOP_K)
    assert ((got.float() - hidden_ref.float()).abs() <= 2.0**-7 * hidden_ref.float().abs()).all()
    assert (got == hidden_ref).float().mean() > 0.999
    out = grouped_gemm(seen(hidden_ref), offsets, down, E)
    per_slot_ref = torch.empty_like(out).index_copy_(0, order, out) * w.reshape(-1, 1)
    per_slot = grouped_gemm(seen(hidden_ref), offsets, down, E, order=order, route_weights=w.reshape(-1))
    assert torch.equal(per_slot, per_slot_ref)
