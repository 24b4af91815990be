"""Grouped int4 weight-only GEMM over MoE experts' packed weights (w4a16, w4a16-asym).

``moe_w4_gemm(x, offsets, qw, E)``: rows ``x [M, K]`` (bf16 / fp16) sorted by expert, expert
``e`` owning rows ``offsets[e-1]:offsets[e]`` (``offsets [E]`` int32 on x's device, as
:func:`quarl.model.moe.sort_by_expert` gives them, ``offsets[E-1] == M``), and one projection
of all experts quantized as its ``[E * N, K]`` view (:mod:`quarl.quant.experts`) -> ``[M, N]``
in x's dtype, ``x[rows of e] @ deq(W_e)^T`` for every expert. The packed weight is read as
:mod:`quarl.quant.reference` lays it out: codes ``uint8 [E * N, Kp / 2]`` (per 128-column
chunk, byte ``j`` holds column ``j`` in its low nibble and column ``64 + j`` in its high one),
fp32 scales ``[E * N, Kp / G]``, uint8 zero points of the same shape (asymmetric); expert
``e`` is the row block ``e N .. (e + 1) N``. Each ``[64, BN]`` tile of weights is dequantized in
registers as the reference does it (``(code - 8) * s`` or ``(code - z) * s`` in fp32, rounded
to x's dtype: the very values ``ops.dequantize`` writes) and multiplied by ``[BM, 64]`` of x
with fp32 accumulation; the bf16 weight is never written out. K past the logical width
(``Kp``'s padding) is masked out of x.

Grid (no host sync, so CUDA graphs capture it): one program per (M-tile, N-tile) over a
bound on the M-tiles that any routing of ``M`` rows to ``E`` experts can need,
``cdiv(M, BM) + min(E, M)`` (each expert with rows adds at most one partial tile). Each
program maps its tile number to an expert on the device: it reads all ``E`` offsets, counts
every expert's tiles ``cdiv(rows_e, BM)``, and takes the expert whose running sum of tiles
covers its number (the block alignment of vLLM's fused MoE, made inside each program
instead of by a separate launch). Tiles past the last expert's exit at once; experts with
no rows own no tile. Tile numbers go through the grouped (``GROUP_M``) ordering of the dense
kernels, so neighbouring programs share an expert's weight tile and a block of x in L2.

The tile config comes from one rule on the average rows per expert (:func:`pick_config`):
decode steps (a few rows per expert) take 16-row tiles, prefill larger ones. Not tuned yet
(no split of K: a decode step reaching few experts runs few programs).

Under the Triton interpreter (CPU tests), whose bf16 casts truncate and whose bf16 dots are
wrong, bf16 rows run as fp32 operands holding the same values (the weights rounded to bf16
in the kernel, ties to even) and the fp32 output is rounded once by torch; fp16 runs as on
the GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from quarl.quant.kernels.act_quant import interpreting, next_pow2
from quarl.quant.kernels.splitk import cdiv
from quarl.quant.kernels.triton_kernels import _group_param, _tile_ids
from quarl.quant.qweight import QuantizedWeight
from quarl.quant.scheme import PACK_K, QuantScheme

BK = PACK_K  # K columns per step of the loop: one packed chunk (two 64-column dots)


def supports(scheme: QuantScheme) -> bool:
    """Weight-only int4 with groups along K (w4a16, w4a16-asym): the schemes this kernel runs.
    (W4A8 shares the layout but quantizes activations; int2, fp4 keep the dequantize path.)"""
    return (scheme.weight_format == "int" and scheme.weight_bits == 4 and scheme.group_size is not None
            and not scheme.quantizes_activations and not scheme.per_tensor_scale)


class MoeConfig(NamedTuple):
    """Tile of :func:`moe_w4_gemm`: ``bm`` rows (of one expert) x ``bn`` outputs, K walked in
    steps of :data:`BK` columns."""

    bm: int
    bn: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8


def pick_config(m: int, num_experts: int, interpret: bool = False) -> MoeConfig:
    """The tile for ``m`` sorted rows over ``num_experts`` experts, from the average rows per
    expert: decode (<= 8) 16-row tiles, then 32, 64 and 128 rows as experts fill up. Under the
    interpreter (CPU tests) 16 x 32 tiles: few programs, fast."""
    if interpret:
        return MoeConfig(16, 32, 4, 1)
    avg = m / max(num_experts, 1)
    if avg <= 8:
        return MoeConfig(16, 64, 4, 4)
    if avg <= 32:
        return MoeConfig(32, 64, 4, 4)
    if avg <= 128:
        return MoeConfig(64, 128, 4, 3)
    return MoeConfig(128, 128, 8, 3)


def tile_bound(m: int, num_experts: int, bm: int) -> int:
    """M-tiles enough for any routing of ``m`` rows to ``num_experts`` experts."""
    return cdiv(m, bm) + min(num_experts, m)


@triton.jit
def _round_bf16(v):
    """fp32 ``v`` rounded to the nearest bf16 value (ties to even), kept in fp32."""
    b = v.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def moe_w4_kernel(
    x_ptr, off_ptr, w_ptr, s_ptr, z_ptr, out_ptr,
    N, K, E, NCHUNK, M_TILES,
    stride_xm, stride_wn, stride_sn, stride_om,
    ASYM: tl.constexpr, G: tl.constexpr, EP: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    pid_t, pid_n = _tile_ids(tl.program_id(0), M_TILES * BM, N, BM, BN, GROUP_M)
    # tile pid_t -> (expert, first row): every expert's tile count from the offsets
    eids = tl.arange(0, EP)
    ends = tl.load(off_ptr + eids, mask=eids < E, other=0)
    starts = tl.load(off_ptr + eids - 1, mask=(eids > 0) & (eids < E), other=0)
    ntiles = (ends - starts + BM - 1) // BM
    cum = tl.cumsum(ntiles, 0)  # inclusive: expert e owns tiles cum[e] - ntiles[e] .. cum[e] - 1
    if pid_t >= tl.sum(ntiles, 0):
        return
    e = tl.sum((cum <= pid_t).to(tl.int32), 0)
    here = eids == e
    row_end = tl.sum(tl.where(here, ends, 0), 0)
    row0 = tl.sum(tl.where(here, starts + (pid_t - (cum - ntiles)) * BM, 0), 0)

    offs_m = row0 + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_j = tl.arange(0, 64)
    mmask = offs_m[:, None] < row_end
    nmask = offs_n[None, :] < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    first_row = e.to(tl.int64) * N  # expert e's rows of the stacked [E * N, ...] tensors
    w_cols = w_ptr + (first_row + offs_n[None, :]) * stride_wn
    s_base = s_ptr + first_row * stride_sn
    z_base = z_ptr + first_row * stride_sn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for c in range(0, NCHUNK):
        packed = tl.load(w_cols + (c * 64 + offs_j)[:, None], mask=nmask, other=0).to(tl.int32)
        for h in tl.static_range(2):
            k_first = c * 128 + h * 64
            code = ((packed >> (4 * h)) & 15).to(tl.float32)
            s = _group_param(s_base, offs_n, stride_sn, k_first, N, 64, G)
            if ASYM:
                val = code - _group_param(z_base, offs_n, stride_sn, k_first, N, 64, G).to(tl.float32)
            else:
                val = code - 8.0
            w = val * s
            if ROUND_BF16:  # (the interpreter's fp32 operands that stand for bf16 ones)
                w = _round_bf16(w)
            w = w.to(x_ptr.dtype.element_ty)
            ks = k_first + offs_j
            x = tl.load(x_rows + ks[None, :], mask=mmask & (ks[None, :] < K), other=0.0)
            acc = tl.dot(x, w, acc)
    omask = mmask & nmask
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=omask)


def moe_w4_gemm(x: torch.Tensor, offsets: torch.Tensor, qw: QuantizedWeight, num_experts: int,
                cfg: MoeConfig | None = None) -> torch.Tensor:
    """``[M, N]`` in x's dtype: each expert's sorted rows of ``x [M, K]`` times its block of the
    packed ``qw [E * N, K]`` transposed (module docstring). Rows past ``offsets[E-1]`` are not
    written (there are none for :func:`~quarl.model.moe.sort_by_expert`'s offsets)."""
    if not supports(qw.scheme):
        raise ValueError(f"the grouped w4 kernel runs weight-only int4 group schemes, got {qw.scheme.name}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the grouped w4 kernel takes bf16 / fp16 rows, got {x.dtype}")
    m, k = x.shape
    if qw.in_features != k or qw.out_features % num_experts:
        raise ValueError(f"rows [{m}, {k}] vs experts' weight {tuple(qw.shape)} of {num_experts} experts")
    if offsets.shape != (num_experts,) or offsets.dtype != torch.int32 or offsets.device != x.device:
        raise ValueError(f"offsets must be int32 [{num_experts}] on {x.device}, got {offsets.dtype} "
                         f"{tuple(offsets.shape)} on {offsets.device}")
    n = qw.out_features // num_experts
    dtype = x.dtype
    # the interpreter's bf16 stand-in (module docstring)
    emulate = interpreting(x) and dtype == torch.bfloat16
    if emulate:
        x = x.float()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.to(dtype)
    if x.stride(1) != 1:
        x = x.contiguous()
    if qw.qdata.stride(1) != 1 or qw.scales.stride(1) != 1 or (
            qw.zeros is not None and qw.zeros.stride() != qw.scales.stride()):
        raise ValueError("the grouped w4 kernel reads row-contiguous codes, scales and zero points")
    cfg = cfg or pick_config(m, num_experts, interpreting(x))
    m_tiles = tile_bound(m, num_experts, cfg.bm)
    qdata, scales = qw.qdata, qw.scales
    zeros = qw.zeros if qw.zeros is not None else scales
    nchunk = qdata.shape[1] // (PACK_K // 2)
    moe_w4_kernel[(m_tiles * cdiv(n, cfg.bn),)](
        x, offsets, qdata, scales, zeros, out,
        n, k, num_experts, nchunk, m_tiles,
        x.stride(0), qdata.stride(0), scales.stride(0), out.stride(0),
        ASYM=qw.zeros is not None, G=qw.scheme.group_size, EP=max(2, next_pow2(num_experts)),
        BM=cfg.bm, BN=cfg.bn, GROUP_M=cfg.group_m, ROUND_BF16=emulate,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out.to(dtype)
