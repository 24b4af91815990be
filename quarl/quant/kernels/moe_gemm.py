"""Grouped GEMM over MoE experts' quantized weights, dequantized in registers: int4 groups
(w4a16, w4a16-asym) and 8-bit codes with a scale per output channel (w8a8-int8, w8a8-fp8).

``grouped_gemm(x, offsets, qw, E)``: rows ``x [M, K]`` (bf16 / fp16) sorted by expert, expert
``e`` owning rows ``offsets[e-1]:offsets[e]`` (``offsets [E]`` int32 on x's device, as
:func:`quarl.model.moe.sort_by_expert` gives them, ``offsets[E-1] == M``), and one projection
of all experts quantized as its ``[E * N, K]`` view (:mod:`quarl.quant.experts`) -> ``[M, N]``
in x's dtype, ``x[rows of e] @ deq(W_e)^T`` for every expert. Expert ``e`` is the row block
``e N .. (e + 1) N`` of the stacked tensors, read as :mod:`quarl.quant.reference` lays them
out: int4 codes ``uint8 [E * N, Kp / 2]`` (per 128-column chunk, byte ``j`` holds column
``j`` in its low nibble and column ``64 + j`` in its high one), fp32 scales ``[E * N, Kp / G]``
and uint8 zero points of that shape (asymmetric); 8-bit codes ``int8 / e4m3 [E * N, K]`` and
fp32 scales ``[E * N]``. Each 64-column slice of a weight tile is dequantized in registers as
the reference does it (``(code - 8) * s``, ``(code - z) * s`` or ``code * s`` in fp32, rounded
to x's dtype: the very values ``ops.dequantize`` writes) and multiplied with fp32
accumulation; the 16-bit weight is never written out. Columns past K are masked. For W8A8 the
caller passes the rows as the GEMM sees them (quantized and dequantized per token): the same
operands as the learner's dequantize + grouped GEMM, so the two differ in summation order
only. (Decode is bound by reading the weights, so 16-bit MMAs on dequantized values cost
nothing there.)

Two operand orders (:class:`MoeConfig` ``swap``): ``x [BM, 64] @ W^T [64, BN]``, or for few
rows per expert ``W [BN, 64] @ x^T [64, BM]`` with the output tile stored transposed, so the
weight dequantized in registers is the dot's first operand (the operand Hopper's MMA reads
from registers) and a 16-row minimum tile pads the rows instead of the outputs.

Grid (no host sync, so CUDA graphs capture it): one program per (M-tile, N-tile) over a
bound on the M-tiles that any routing of ``M`` rows to ``E`` experts can need,
``cdiv(M, BM) + min(E, M)`` (each expert with rows adds at most one partial tile). Each
program maps its tile number to an expert on the device (:func:`expert_tile`): it reads all
``E`` offsets, counts every expert's tiles ``cdiv(rows_e, BM)``, and takes the expert whose
running sum of tiles covers its number (the block alignment of vLLM's fused MoE, made inside
each program instead of by a separate launch). Tiles past the last expert's exit at once;
experts with no rows own no tile. Tile numbers go through the grouped (``GROUP_M``) ordering
of the dense kernels, so neighbouring programs share an expert's weight tile in L2.

The tile config comes from one rule on the average rows per expert (:func:`pick_config`).
Exact mode (:mod:`.invariant_moe`) passes one fixed tile instead, and runs dense 16-bit experts
through the same kernel (:func:`grouped_gemm_dense`, weights read as they are), so that a row's
products are summed in one order whichever rows share its expert.

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
from quarl.quant.kernels.moe_rules import moe_kernel_supports
from quarl.quant.kernels.splitk import cdiv
from quarl.quant.kernels.triton_kernels import _group_param, _tile_ids, biased_f32, silu_mul_value, w4_bf16
from quarl.quant.qweight import QuantizedWeight
from quarl.quant.scheme import PACK_K

BK = PACK_K  # K columns per step of the loop: one packed chunk (two 64-column dots)


class MoeConfig(NamedTuple):
    """Tile of :func:`grouped_gemm`: ``bm`` rows (of one expert) x ``bn`` outputs, K walked in
    steps of :data:`BK` columns."""

    bm: int
    bn: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    swap: bool = False  # out^T = W x^T: the dequantized weight as the dot's first operand (few rows)


# The tiles `quarl bench gemm --moe --moe-tiles` times next to pick_config's choice: both
# operand orders at decode sizes (16 x 128 on 4 warps: 3.5-3.6 instructions a weight in the
# compiled loop against 16 x 64's 3.9-4.6, tests/quant/sass_count.py), larger tiles for prefill.
TILE_CANDIDATES = (
    MoeConfig(16, 64, 4, 4), MoeConfig(16, 64, 4, 4, swap=True), MoeConfig(16, 128, 8, 3, swap=True),
    MoeConfig(16, 128, 4, 4),
    MoeConfig(32, 64, 4, 4), MoeConfig(32, 64, 4, 4, swap=True), MoeConfig(64, 128, 4, 3),
    MoeConfig(64, 128, 8, 3, swap=True), MoeConfig(128, 128, 8, 3),
)


def tile_label(cfg: MoeConfig) -> str:
    """``kernel@BMxBN/wWARPS/sSTAGES`` (``T``: the swapped operand order)."""
    return f"kernel@{cfg.bm}x{cfg.bn}/w{cfg.num_warps}/s{cfg.num_stages}{'T' if cfg.swap else ''}"


def pick_config(m: int, num_experts: int, interpret: bool = False) -> MoeConfig:
    """The tile for ``m`` sorted rows over ``num_experts`` experts, from the average rows per
    expert: decode (<= 8) 16-row tiles, then 32 (the weight as the dot's first operand: 9% faster
    on Qwen3-30B-A3B's gate/up at 32 rows an expert on an H100, ``quarl bench gemm --moe
    qwen3-30b-a3b --moe-tiles``), 64 and 128 rows as experts fill up. Under the interpreter (CPU
    tests) 16 x 32 tiles: few programs, fast."""
    if interpret:
        return MoeConfig(16, 32, 4, 1)
    avg = m / max(num_experts, 1)
    if avg <= 8:
        return MoeConfig(16, 64, 4, 4)
    if avg <= 32:
        return MoeConfig(32, 64, 4, 4, swap=True)
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
def expert_tile(off_ptr, pid_t, E, EP: tl.constexpr, BM: tl.constexpr):
    """Tile ``pid_t`` -> ``(expert, first row, end of the expert's rows, whether the tile
    exists)``: every expert's tile count ``cdiv(rows_e, BM)`` from the offsets, and the expert
    whose running sum of tiles covers ``pid_t`` (module docstring)."""
    eids = tl.arange(0, EP)
    ends = tl.load(off_ptr + eids, mask=eids < E, other=0)
    starts = tl.load(off_ptr + eids - 1, mask=(eids > 0) & (eids < E), other=0)
    ntiles = (ends - starts + BM - 1) // BM
    cum = tl.cumsum(ntiles, 0)  # inclusive: expert e owns tiles cum[e] - ntiles[e] .. cum[e] - 1
    e = tl.sum((cum <= pid_t).to(tl.int32), 0)
    here = eids == e
    row_end = tl.sum(tl.where(here, ends, 0), 0)
    row0 = tl.sum(tl.where(here, starts + (pid_t - (cum - ntiles)) * BM, 0), 0)
    return e, row0, row_end, pid_t < tl.sum(ntiles, 0)


@triton.jit
def _group_param_t(ptr, offs_n, stride_n, k_first, N, SUB: tl.constexpr, G: tl.constexpr):
    """:func:`_group_param` for a weight tile laid out ``[BN, SUB]`` (outputs down the rows):
    ``[BN, 1]`` when the sub-tile sits in one group, else ``[BN, SUB]``."""
    nmask = offs_n[:, None] < N
    if G >= SUB:
        out = tl.load(ptr + offs_n[:, None] * stride_n + k_first // G, mask=nmask, other=0)
    else:
        cols = (k_first + tl.arange(0, SUB)) // G
        out = tl.load(ptr + offs_n[:, None] * stride_n + cols[None, :], mask=nmask, other=0)
    return out


@triton.jit
def _w_half(w_tile, packed, c, h, offs_j, s_base, z_base, offs_n, stride_sn, N, K,
            BITS: tl.constexpr, ASYM: tl.constexpr, G: tl.constexpr, SWAP: tl.constexpr, ROUND_BF16: tl.constexpr,
            PACKED_BF16: tl.constexpr):
    """Columns ``128 c + 64 h ..`` of the weight tile (``[64, BN]``, or ``[BN, 64]`` when
    ``SWAP``) as the values ``ops.dequantize`` writes. BITS 4: half ``h`` of the packed chunk
    ``packed`` with its group scales (and zero points); BITS 8: int8 / e4m3 codes loaded here,
    times their channel's scale; BITS 16: a dense 16-bit weight. In fp32 (the caller casts),
    except for ``PACKED_BF16`` (4-bit codes, bf16 rows): there in bf16, two weights an
    instruction (:func:`~quarl.quant.kernels.triton_kernels.w4_bf16`; under the interpreter,
    ``ROUND_BF16``, in fp32)."""
    k_first = c * 128 + h * 64
    if SWAP:
        nmask = offs_n[:, None] < N
    else:
        nmask = offs_n[None, :] < N
    if BITS == 4:
        if SWAP:
            s = _group_param_t(s_base, offs_n, stride_sn, k_first, N, 64, G)
        else:
            s = _group_param(s_base, offs_n, stride_sn, k_first, N, 64, G)
        z = 0
        if ASYM:
            if SWAP:
                z = _group_param_t(z_base, offs_n, stride_sn, k_first, N, 64, G)
            else:
                z = _group_param(z_base, offs_n, stride_sn, k_first, N, 64, G)
        if PACKED_BF16:
            w = w4_bf16(packed, h, z, s, ASYM, ROUND_BF16)
        elif ASYM:  # (2**23 + code: no conversion instruction, biased_f32)
            w = (biased_f32((packed >> (4 * h)) & 15) - biased_f32(z.to(tl.int32))) * s
        else:
            w = (biased_f32((packed >> (4 * h)) & 15) - 8388616.0) * s  # (2**23 + 8)
    else:
        ks = k_first + offs_j
        if SWAP:
            at = w_tile + ks[None, :]
            wmask = nmask & (ks[None, :] < K)
        else:
            at = w_tile + ks[:, None]
            wmask = nmask & (ks[:, None] < K)
        if w_tile.dtype.element_ty == tl.float8e4nv:  # (no `other` for e4m3: the bytes, zero where masked)
            code = tl.load(at.to(tl.pointer_type(tl.uint8)), mask=wmask, other=0).to(tl.float8e4nv, bitcast=True)
        else:
            code = tl.load(at, mask=wmask, other=0)
        w = code.to(tl.float32)
        if BITS == 8:
            if SWAP:
                w = w * tl.load(s_base + offs_n[:, None], mask=nmask, other=0)
            else:
                w = w * tl.load(s_base + offs_n[None, :], mask=nmask, other=0)
        # (BITS 16: a dense weight, read as it is)
    if ROUND_BF16:  # (the interpreter's fp32 operands that stand for bf16 ones)
        w = _round_bf16(w)
    return w


@triton.jit
def _packed_chunk(w_tile, c, offs_j, nmask, BITS: tl.constexpr, SWAP: tl.constexpr, PACKED_BF16: tl.constexpr):
    """Chunk ``c``'s packed bytes (BITS 4: 128 columns in 64 bytes a row; uint8 as loaded for the
    packed bf16 dequantization, else int32); nothing for 8-bit codes, which :func:`_w_half`
    loads per half."""
    if BITS == 4:
        if SWAP:
            packed = tl.load(w_tile + (c * 64 + offs_j)[None, :], mask=nmask, other=0)
        else:
            packed = tl.load(w_tile + (c * 64 + offs_j)[:, None], mask=nmask, other=0)
        if not PACKED_BF16:
            packed = packed.to(tl.int32)
    else:
        packed = 0
    return packed


@triton.jit
def _gated_value(acc_g, acc_u, dt: tl.constexpr, ROUND_BF16: tl.constexpr):
    """``silu(g) * u`` of the gate and up sums, each rounded to the output dtype first: the
    steps of the unfused path (the grouped GEMM's output, then the model's SiLU-and-mul,
    :func:`~quarl.quant.kernels.triton_kernels.silu_mul_value`). Under the interpreter's bf16
    stand-in every rounding is explicit (:func:`_round_bf16`)."""
    if ROUND_BF16:
        g = _round_bf16(acc_g)
        sg = _round_bf16(g / (1.0 + tl.exp(-g)))
        out = _round_bf16(sg * _round_bf16(acc_u))
    else:
        out = silu_mul_value(acc_g.to(dt).to(tl.float32), acc_u.to(dt).to(tl.float32), dt)
    return out


@triton.jit
def _store_tile(acc, acc_u, out_ptr, dst_ptr, rw_ptr, m_idx, n_idx, mmask, nmask, stride_om,
                GATED: tl.constexpr, SCATTER: tl.constexpr, ROUND_BF16: tl.constexpr):
    """The tile's outputs (``m_idx`` / ``n_idx``: its rows and columns, broadcast to the tile's
    orientation): ``silu(g) * u`` when GATED; with SCATTER, row ``m`` goes to row ``dst[m]``
    (its (token, slot) position) times that pair's routing weight ``rw[dst[m]]`` (the product
    of two rounded values, rounded once, as the unfused path multiplies them)."""
    dt = out_ptr.dtype.element_ty
    if GATED:
        y = _gated_value(acc, acc_u, dt, ROUND_BF16)
    elif SCATTER and ROUND_BF16:
        y = _round_bf16(acc)
    else:
        y = acc
    rows = m_idx.to(tl.int64)
    if SCATTER:
        rows = tl.load(dst_ptr + m_idx, mask=mmask, other=0)
        rw = tl.load(rw_ptr + rows, mask=mmask, other=0).to(tl.float32)
        y = y.to(dt).to(tl.float32) * rw
        if ROUND_BF16:
            y = _round_bf16(y)
    tl.store(out_ptr + rows * stride_om + n_idx, y.to(dt), mask=mmask & nmask)


@triton.jit
def grouped_gemm_kernel(
    x_ptr, off_ptr, w_ptr, s_ptr, z_ptr, out_ptr, src_ptr, dst_ptr, rw_ptr,
    N, K, E, NCHUNK, M_TILES,
    stride_xm, stride_wn, stride_sn, stride_om,
    BITS: tl.constexpr, ASYM: tl.constexpr, G: tl.constexpr, EP: tl.constexpr, SWAP: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, ROUND_BF16: tl.constexpr,
    PACKED_BF16: tl.constexpr, GATED: tl.constexpr, SLOTS: tl.constexpr, SCATTER: tl.constexpr,
):
    pid_t, pid_n = _tile_ids(tl.program_id(0), M_TILES * BM, N, BM, BN, GROUP_M)
    e, row0, row_end, exists = expert_tile(off_ptr, pid_t, E, EP, BM)
    if not exists:
        return
    offs_m = row0 + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_j = tl.arange(0, 64)
    # expert e's rows of the stacked [E * N, ...] tensors ([E * 2N, ...] when GATED: N gate
    # rows, then N up rows)
    first_row = e.to(tl.int64) * N * (2 if GATED else 1)
    s_base = s_ptr + first_row * stride_sn
    z_base = z_ptr + first_row * stride_sn
    if SLOTS > 0:  # sorted pair m reads its token's row of x (module docstring of grouped_gemm)
        x_row = tl.load(src_ptr + offs_m, mask=offs_m < row_end, other=0) // SLOTS
    else:
        x_row = offs_m.to(tl.int64)
    if SWAP:  # out^T tile [BN, BM] = W [BN, 64] @ x^T [64, BM]: the weight is the dot's first operand
        m_idx = offs_m[None, :]
        n_idx = offs_n[:, None]
        x_at = x_ptr + x_row[None, :] * stride_xm
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:  # out tile [BM, BN] = x [BM, 64] @ W^T [64, BN]
        m_idx = offs_m[:, None]
        n_idx = offs_n[None, :]
        x_at = x_ptr + x_row[:, None] * stride_xm
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    mmask = m_idx < row_end
    nmask = n_idx < N
    w_tile = w_ptr + (first_row + n_idx) * stride_wn
    w_tile_u = w_tile + N * stride_wn
    acc_u = acc
    for c in range(0, NCHUNK):
        packed = _packed_chunk(w_tile, c, offs_j, nmask, BITS, SWAP, PACKED_BF16)
        if GATED:
            packed_u = _packed_chunk(w_tile_u, c, offs_j, nmask, BITS, SWAP, PACKED_BF16)
        for h in tl.static_range(2):
            ks = c * 128 + h * 64 + offs_j
            w = _w_half(w_tile, packed, c, h, offs_j, s_base, z_base, offs_n, stride_sn, N, K,
                        BITS, ASYM, G, SWAP, ROUND_BF16, PACKED_BF16).to(x_ptr.dtype.element_ty)
            if GATED:
                w_u = _w_half(w_tile_u, packed_u, c, h, offs_j, s_base + N * stride_sn, z_base + N * stride_sn,
                              offs_n, stride_sn, N, K, BITS, ASYM, G, SWAP, ROUND_BF16,
                              PACKED_BF16).to(x_ptr.dtype.element_ty)
            if SWAP:
                x = tl.load(x_at + ks[:, None], mask=mmask & (ks[:, None] < K), other=0.0)
                acc = tl.dot(w, x, acc)
                if GATED:
                    acc_u = tl.dot(w_u, x, acc_u)
            else:
                x = tl.load(x_at + ks[None, :], mask=mmask & (ks[None, :] < K), other=0.0)
                acc = tl.dot(x, w, acc)
                if GATED:
                    acc_u = tl.dot(x, w_u, acc_u)
    _store_tile(acc, acc_u, out_ptr, dst_ptr, rw_ptr, m_idx, n_idx, mmask, nmask, stride_om,
                GATED, SCATTER, ROUND_BF16)


def grouped_gemm(x: torch.Tensor, offsets: torch.Tensor, qw: QuantizedWeight, num_experts: int,
                cfg: MoeConfig | None = None, *, gated: bool = False, order: torch.Tensor | None = None,
                slots: int = 0, route_weights: torch.Tensor | None = None) -> torch.Tensor:
    """``[M, N]`` in x's dtype: each expert's sorted rows of ``x [M, K]`` times its block of the
    packed ``qw [E * N, K]`` transposed (module docstring). Rows past ``offsets[E-1]`` are not
    written (there are none for :func:`~quarl.model.moe.sort_by_expert`'s offsets).

    The MoE block's steps around the GEMMs, fused (the unfused path's roundings, step by step):

    - ``gated``: ``qw`` is ``[E * 2N, K]``, each expert's N gate rows above its N up rows (the
      stacked ``gate_up_proj``); the output is ``silu(gate) * up``, ``[M, N]``.
    - ``order`` with ``slots = k`` (the gather): ``x [T, K]`` holds one row per token and the
      sorted (token, slot) pairs ``order [M]`` (:func:`~quarl.model.moe.sort_by_expert`) read
      token ``order[m] // k``'s row: no ``[M, K]`` copy of the rows.
    - ``order`` with ``route_weights [M]`` (the scatter; the pairs' routing weights in (token,
      slot) order): the output is in (token, slot) order, row ``order[m]`` holding sorted row
      ``m`` times its routing weight, ready for the sum over the slots."""
    if not moe_kernel_supports(qw.scheme):
        raise ValueError(f"the grouped MoE kernel runs int4 group and 8-bit per-channel weights, got {qw.scheme.name}")
    k = x.shape[1]
    if qw.in_features != k or qw.out_features % (num_experts * (2 if gated else 1)):
        raise ValueError(f"rows [{x.shape[0]}, {k}] vs experts' weight {tuple(qw.shape)} of {num_experts} experts"
                         + (" (gated: gate and up rows)" if gated else ""))
    bits = qw.scheme.weight_bits
    scales = qw.scales if bits == 4 else qw.scales.reshape(-1, 1)  # 8-bit: one fp32 scale per channel
    if qw.qdata.stride(1) != 1 or scales.stride(1) != 1 or (
            qw.zeros is not None and qw.zeros.stride() != scales.stride()):
        raise ValueError("the grouped MoE kernel reads row-contiguous codes, scales and zero points")
    nchunk = qw.qdata.shape[1] // (PACK_K // 2) if bits == 4 else cdiv(k, PACK_K)
    return _launch(x, offsets, qw.qdata, scales, qw.zeros, bits, qw.scheme.group_size or 1, num_experts, nchunk, cfg,
                   _Fusion(gated, order, slots, route_weights))


def grouped_gemm_dense(x: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor,
                       cfg: MoeConfig | None = None) -> torch.Tensor:
    """:func:`grouped_gemm` over dense experts ``weight [E, N, K]`` in x's dtype (bf16 / fp16),
    read as they are: one kernel for every format, so that a fixed tile gives the same
    per-row order of products for 16-bit and quantized experts alike (exact mode)."""
    e, n, k = weight.shape
    if weight.dtype != x.dtype or x.shape[1] != k:
        raise ValueError(f"rows {x.dtype} [{x.shape[0]}, {x.shape[1]}] vs experts' weight {weight.dtype} "
                         f"{tuple(weight.shape)}: one 16-bit dtype and K wanted")
    w = weight.reshape(e * n, k)
    w = w if w.stride(1) == 1 else w.contiguous()
    return _launch(x, offsets, w, w, None, 16, 1, e, cdiv(k, PACK_K), cfg)


class _Fusion(NamedTuple):
    """The steps :func:`grouped_gemm` fuses (its docstring)."""

    gated: bool = False
    order: torch.Tensor | None = None
    slots: int = 0
    route_weights: torch.Tensor | None = None

    def rows(self, x: torch.Tensor) -> int:
        """Rows of the GEMM (sorted pairs)."""
        if (self.slots or self.route_weights is not None) and self.order is None:
            raise ValueError("the gather (slots) and the scatter (route_weights) need the pairs' order")
        if self.order is not None and (self.order.dim() != 1 or self.order.device != x.device):
            raise ValueError(f"order must be 1-D on {x.device}, got {tuple(self.order.shape)} on {self.order.device}")
        if self.slots:
            if self.order.numel() > x.shape[0] * self.slots:
                raise ValueError(f"{self.order.numel()} pairs from {x.shape[0]} tokens of {self.slots} slots")
            return self.order.numel()
        if self.order is not None and self.order.numel() != x.shape[0]:
            raise ValueError(f"order of {self.order.numel()} pairs vs {x.shape[0]} rows")
        if self.route_weights is not None and self.route_weights.shape != (x.shape[0],):
            raise ValueError(f"route_weights {tuple(self.route_weights.shape)} vs {x.shape[0]} pairs")
        return x.shape[0]


def _launch(x: torch.Tensor, offsets: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor,
            zeros: torch.Tensor | None, bits: int, group: int, num_experts: int, nchunk: int,
            cfg: MoeConfig | None, fusion: _Fusion = _Fusion()) -> torch.Tensor:
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the grouped MoE kernel takes bf16 / fp16 rows, got {x.dtype}")
    if offsets.shape != (num_experts,) or offsets.dtype != torch.int32 or offsets.device != x.device:
        raise ValueError(f"offsets must be int32 [{num_experts}] on {x.device}, got {offsets.dtype} "
                         f"{tuple(offsets.shape)} on {offsets.device}")
    m, k = fusion.rows(x), x.shape[1]
    n = qdata.shape[0] // num_experts // (2 if fusion.gated else 1)
    dtype = x.dtype
    # the interpreter's bf16 stand-in (module docstring)
    emulate = interpreting(x) and dtype == torch.bfloat16
    route_weights = fusion.route_weights
    if emulate:
        x = x.float()
        if bits == 16:
            qdata = qdata.float()
        if route_weights is not None:
            route_weights = route_weights.float()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.to(dtype)
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = cfg or pick_config(m, num_experts, interpreting(x))
    m_tiles = tile_bound(m, num_experts, cfg.bm)
    order = fusion.order if fusion.order is not None else offsets
    grouped_gemm_kernel[(m_tiles * cdiv(n, cfg.bn),)](
        x, offsets, qdata, scales, zeros if zeros is not None else scales, out,
        order, order, route_weights if route_weights is not None else scales,
        n, k, num_experts, nchunk, m_tiles,
        x.stride(0), qdata.stride(0), scales.stride(0), out.stride(0),
        BITS=bits, ASYM=zeros is not None, G=group, EP=max(2, next_pow2(num_experts)),
        SWAP=cfg.swap, BM=cfg.bm, BN=cfg.bn, GROUP_M=cfg.group_m, ROUND_BF16=emulate,
        PACKED_BF16=bits == 4 and dtype == torch.bfloat16, GATED=fusion.gated, SLOTS=fusion.slots,
        SCATTER=route_weights is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out.to(dtype)
