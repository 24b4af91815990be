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


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-asym"])
@pytest.mark.parametrize("proj", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 8, 64, 512])
def test_kernel_equals_the_dequantize_path(scheme, proj, tokens):
    from quarl.quant.kernels.moe_w4 import moe_w4_gemm

    n, k = SHAPES[proj]
    qw = quantize_weight(0.02 * torch.randn(E * n, k, device=DEV), scheme)
    x, offsets = _rows(tokens, k, seed=tokens)
    with use_backend("auto"):
        want = grouped_quant_linear(x, qw, offsets, E).float()  # dequantize + grouped_mm
    got = moe_w4_gemm(x, offsets, qw, E).float()
    rel = float((got - want).norm() / want.norm())
    assert rel < 5e-3, rel  # the same bf16 weights, fp32 sums in another order, one bf16 rounding each


def test_kernel_runs_inside_a_cuda_graph():
    from quarl.quant.kernels.moe_w4 import moe_w4_gemm

    n, k = SHAPES["gate_up"]
    qw = quantize_weight(0.02 * torch.randn(E * n, k, device=DEV), "w4a16")
    x, offsets = _rows(16, k, seed=3)
    eager = moe_w4_gemm(x, offsets, qw, E)  # (compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_w4_gemm(x, offsets, qw, E)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
