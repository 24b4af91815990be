"""Batch-invariant GEMMs ``y [M, N] = x [M, K] @ W.T (+ bias)`` (exact mode).

Batch-invariant: every output row is a function of that row of ``x`` (and of the weight and
bias) only, bit for bit, whatever M is and wherever the row sits in the batch. The rollout
engine decodes at M = its batch of sequences, the learner recomputes at M = thousands of
packed tokens; with these GEMMs the two get the same bits for the same token. The other
kernels of :mod:`.triton_kernels` are not invariant: their tile and split-K plan are chosen
from M (``dispatch``), and split-K, a different BK or a different MMA shape changes the order
in which a row's K products are summed; cuBLAS picks its algorithm by M as well.

Invariance by construction: what a row's bits depend on is fixed, what only moves work
around may follow M.

* Fixed per (N, K, kind), never a function of M nor of the GPU's SM count (engine and learner
  may run on different GPUs of one kind): the K walk. No split-K chosen by M, no stream-K, no
  atomics: K is cut into segments by K alone (:func:`k_segment`: one below 4096 columns, up
  to 8 of whole 128-column chunks above); each segment is walked from 0 in the same
  blocks (``BK`` for dense and W8A8, the packed 128-column chunk's sub-tiles for
  weight-only), ``acc = dot(x_blk, w_blk, acc)`` in fp32 (int32 for int8 x int8), the
  segments' sums added in order, then the epilogue (scales, bias, one rounding to the output
  dtype) element by element. Whether one program adds all of a tile's segments or each
  segment has its own program (decode sizes, the partials added by a second kernel in the
  same order) moves work, not arithmetic; the dot's
  input precision (fp32 inputs use ``"ieee"``, not tf32); fp8's accumulator promotion every
  BK products (``max_num_imprecise_acc = BK``, as :func:`.triton_kernels._w8a8_dot`), so
  fp8's BK is always 128; and the MMA family: on Hopper every tile is a whole number of
  warpgroup ``wgmma m64nNk16`` instructions (BM in 64, 128, 256), each output element one
  chain of k16 steps in K order.
* Chosen by M (:func:`invariant_config`): BM, BN, num_warps, num_stages, and for 16-bit
  dense weights BK between 64 and 128 (both chain the same k16 steps). These change which
  program computes a row and how the loads are pipelined, not the row's arithmetic: on an
  H100 every tile of the table gave the same bits as every other on the W1 shapes
  (``tests_gpu/quant/test_invariant_gpu.py``), while 16- and 32-row tiles (``mma.sync``)
  on packed int4 and fp8 tiles of another BK did not, so those are not in it. The grid grows
  with M: ``cdiv(M, BM)`` row tiles (grid axis 0) times ``cdiv(N, BN)`` column tiles.
* Rows past M are loaded as zeros and never stored: they meet a row's values only inside the
  MMA, where each output element is its own row's dot product. ``M`` is not specialized on
  (``do_not_specialize``): Triton would otherwise compile other variants for M == 1 and
  M % 16 == 0. Alignment specialization of the pointers (a row sliced out of a batch may be
  less aligned) changes only load vectorization, not arithmetic.

Under Triton's CPU interpreter (the CPU tests) the tile is one small fixed shape: its dot is
a NumPy matmul, whose summation order may follow the tile's shape.

Kinds (:func:`invariant_linear` picks one from the weight):

* dense: a 16-bit (or fp32) weight ``[N, K]`` (a tensor, or a ``bf16``-scheme
  :class:`~quarl.quant.qweight.QuantizedWeight`), converted to x's dtype first as
  ``quant_linear`` does;
* weight-only packed formats (int4 g128 sym / asym, int2, nvfp4, mxfp4): the packed
  ``[N, Kp * bits / 8]`` layout of :mod:`quarl.quant.reference` read directly, each
  ``[SUB, BN]`` sub-tile dequantized in registers to x's dtype (``value(code) * scale``
  rounded once, the weight :func:`.weight_only.dequantize` writes), then the dot; K runs over
  the 128-column chunks of the padded layout (x masked past K, padding codes are zeros);
* W8A8 int8 / fp8 on per-token codes ``xq [M, K]`` and fp32 scales ``sx [M]`` (what
  :func:`.act_quant.act_quant` makes, one program per row: itself row-local), epilogue
  ``acc * sx[:, None] * sw[None, :] (+ bias)`` as the existing W8A8 kernels.

W4A8 (int4 weights on int8 codes) is not covered yet.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from quarl.quant.kernels.act_quant import act_quant, interpreting
from quarl.quant.kernels.splitk import cdiv
from quarl.quant.kernels.triton_kernels import _group_param, dequant_subtile, w4_bf16
from quarl.quant.kernels.weight_only import _fmt, _group_params, _nchunk
from quarl.quant.qweight import QuantizedWeight

KINDS = ("dense", "weight_only", "w8a8")


class InvariantConfig(NamedTuple):
    """One GEMM's tile (:func:`invariant_config`)."""

    bm: int
    bn: int
    bk: int  # dense / w8a8 K block; weight-only kernels step by the packed sub-chunk instead
    num_warps: int = 4
    num_stages: int = 3


def invariant_config(kind: str, n: int, k: int, m: int, interpret: bool = False,
                     fp32: bool = False) -> InvariantConfig:
    """The tile of ``kind`` for an ``[N, K]`` weight at ``m`` rows (``fp32``: fp32 operands).

    ``m`` picks among tiles of one K walk only (module doc): BK is a function of (kind, N, K)
    for packed and 8-bit weights and 64 or 128 for 16-bit dense ones, BM at least 64. From an
    H100 sweep of the W1 shapes (``.. M <= 256``: decode and small batches, where the column
    tiles alone must fill the SMs; above: the learner's micro-batches). fp32 operands and the
    interpreter take one fixed tile."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; valid: {', '.join(KINDS)}")
    if interpret:
        return InvariantConfig(64, 64, 32, num_warps=4, num_stages=1)
    small = m <= SMALL_M
    if kind == "dense":
        if fp32:
            return InvariantConfig(64, 32, 64)
        if small:
            return InvariantConfig(128, 128, 128, 8) if n >= 8192 else InvariantConfig(64, 64, 128)
        if n <= 512:
            return InvariantConfig(64, 128, 64, num_stages=4)
        if k >= 4096:
            return InvariantConfig(128, 128, 128, 8)
        return InvariantConfig(256, 128, 64, 8) if n >= 4096 else InvariantConfig(128, 128, 64, 8)
    if kind == "weight_only":  # (bk unused: the packed chunk's sub-tiles set the K steps)
        if fp32:
            return InvariantConfig(64, 32, 64)
        if small:
            return InvariantConfig(128, 64, 64) if n >= 4096 else InvariantConfig(64, 32, 64)
        return InvariantConfig(128, 64, 64) if n <= 512 else InvariantConfig(256, 128, 64, 8)
    # w8a8: BK 128 always (fp8 promotes its accumulator every BK products)
    if small:
        return InvariantConfig(128, 128, 128, 8) if n >= 4096 else InvariantConfig(64, 64, 128)
    return InvariantConfig(128, 128, 128, 8) if n >= 8192 else InvariantConfig(64, 128, 128)


# Rows up to which a GEMM takes the decode-sized tiles of invariant_config.
SMALL_M = 256


# K from which the dense and weight-only GEMMs sum K in segments (k_segment)
K_SPLIT_MIN = 4096


def k_segment(k: int) -> int:
    """Columns of K per segment (a multiple of 128; ``>= k``: one segment), a function of K
    alone: below :data:`K_SPLIT_MIN` one, from there ``min(8, K // 2048)`` segments of whole
    128-column chunks. Each segment is summed from zero and the segments' sums are added in
    order, whatever M: at decode sizes one program per segment (grid axis 2, fp32 partials
    added by :func:`inv_segments_kernel`: the parallelism split-K gives the down projection,
    whose few output tiles would leave most SMs idle), above :data:`SMALL_M` rows the same
    additions inside each program (the same bits: ``tests_gpu/quant/test_invariant_gpu.py``).
    The W8A8 kernel segments alike (BK 128 divides the segments)."""
    chunks = cdiv(k, 128)
    parts = min(8, k // 2048) if k >= K_SPLIT_MIN else 1
    return cdiv(chunks, parts) * 128


def _partial(segments: int, m: int, parallel: bool | None) -> bool:
    """Whether a GEMM of ``segments`` K segments runs one program per segment (decode sizes)."""
    return segments > 1 and (m <= SMALL_M if parallel is None else parallel)


def _add_segments(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                  scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    segs, m, n = part.shape
    bm, bn = 16, 256
    sa, sb = scales if scales is not None else (part, part)
    inv_segments_kernel[(cdiv(m, bm), cdiv(n, bn))](
        part, sa, sb, bias if bias is not None else part, out, m, n, segs, out.stride(0),
        BM=bm, BN=bn, HAS_SCALES=scales is not None, HAS_BIAS=bias is not None, num_warps=4,
    )


def same_bits_tiles(kind: str) -> tuple[InvariantConfig, ...]:
    """Every tile :func:`invariant_config` may return for ``kind`` on a GPU with 16-bit (or
    8-bit) operands: the set the GPU test checks for identical bits."""
    shapes = [(n, k) for n in (256, 1536, 8960, 151936) for k in (1536, 8960)]
    return tuple(sorted({invariant_config(kind, n, k, m) for n, k in shapes for m in (1, SMALL_M + 1)}))


# --------------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["M"])
def inv_dense_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, SEG_K, stride_xm, stride_wn, stride_om,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    INTERP_BF16: tl.constexpr, SEGMENTED: tl.constexpr, PARTIAL: tl.constexpr,
):
    """``out = x [M, K] @ w [N, K].T (+ bias)``; x and w of one dtype, fp32 accumulation, K in
    segments of ``SEG_K`` columns (:func:`k_segment`), each summed from zero, the segments'
    sums added in order. PARTIAL: this program's segment (grid axis 2) into ``out`` as an fp32
    partial ``[segments, M, N]`` for :func:`inv_segments_kernel`."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mmask = offs_m[:, None] < M
    nmask = offs_n[None, :] < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    zero = tl.zeros([BM, BN], dtype=tl.float32)
    if SEGMENTED:
        seg_lo, seg_hi = _segments(K, SEG_K, PARTIAL)
        total = zero
        for seg in range(seg_lo, seg_hi):  # one fixed order over K, whatever M
            k0 = seg * SEG_K
            acc = _dense_walk(x_rows, w_cols, offs_k, mmask, nmask, k0, tl.minimum(SEG_K, K - k0), K, zero,
                              BK, PRECISION, INTERP_BF16)
            total = tl.where(seg == seg_lo, acc, total + acc)
    else:  # (one segment: one accumulator, no running total held beside it)
        total = _dense_walk(x_rows, w_cols, offs_k, mmask, nmask, 0, K, K, zero, BK, PRECISION, INTERP_BF16)
    _inv_finish(total, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, PARTIAL)


@triton.jit
def _dense_walk(x_rows, w_cols, offs_k, mmask, nmask, k0, length, K, acc, BK: tl.constexpr,
                PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr):
    """``acc`` plus the products of columns ``k0 .. k0 + length`` in steps of BK."""
    for kb in range(0, tl.cdiv(length, BK)):
        ks = k0 + kb * BK + offs_k
        a = tl.load(x_rows + ks[None, :], mask=mmask & (ks[None, :] < K), other=0.0)
        b = tl.load(w_cols + ks[:, None], mask=nmask & (ks[:, None] < K), other=0.0)
        acc = _dot16(a, b, acc, PRECISION, INTERP_BF16)
    return acc


@triton.jit(do_not_specialize=["M"])
def inv_weight_only_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, gs_ptr, bias_ptr, out_ptr, M, N, K, NCHUNK, SEG_C,
    stride_xm, stride_wn, stride_sn, stride_om,
    FMT: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr, SEGMENTED: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    """``out = x @ deq(W).T (+ bias)`` on quarl's packed sub-byte layout: per 128-column chunk,
    ``8 / BITS`` sub-tiles ``[SUB, BN]`` (one shift and mask each), each dequantized to x's
    dtype then one dot, always in the order chunk 0, sub 0 .. chunk NCHUNK - 1, last sub,
    in segments of ``SEG_C`` chunks as :func:`inv_dense_kernel` (the same columns: the dense
    kernel on the dequantized weight gives the same bits). FMT as
    :data:`.triton_kernels.FMT_INT_SYM` etc."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    NSUB: tl.constexpr = 8 // BITS
    SUB: tl.constexpr = 128 // NSUB
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_j = tl.arange(0, SUB)
    mmask = offs_m[:, None] < M
    nmask = offs_n[None, :] < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    gscale = 1.0
    if FMT == 2:
        gscale = tl.load(gs_ptr)
    zero = tl.zeros([BM, BN], dtype=tl.float32)
    if SEGMENTED:
        seg_lo, seg_hi = _segments(NCHUNK, SEG_C, PARTIAL)
        total = zero
        for seg in range(seg_lo, seg_hi):
            acc = _packed_walk(x_rows, w_cols, s_ptr, z_ptr, offs_n, offs_j, mmask, nmask, stride_sn, N, K, gscale,
                               seg * SEG_C, tl.minimum(NCHUNK, (seg + 1) * SEG_C), zero, x_ptr.dtype.element_ty,
                               FMT, BITS, G, SUB, NSUB, PRECISION, INTERP_BF16)
            total = tl.where(seg == seg_lo, acc, total + acc)
    else:  # (one segment: one accumulator)
        total = _packed_walk(x_rows, w_cols, s_ptr, z_ptr, offs_n, offs_j, mmask, nmask, stride_sn, N, K, gscale,
                             0, NCHUNK, zero, x_ptr.dtype.element_ty, FMT, BITS, G, SUB, NSUB, PRECISION, INTERP_BF16)
    _inv_finish(total, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, PARTIAL)


@triton.jit
def _packed_walk(x_rows, w_cols, s_ptr, z_ptr, offs_n, offs_j, mmask, nmask, stride_sn, N, K, gscale, c_lo, c_hi, acc,
                 XT: tl.constexpr, FMT: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, SUB: tl.constexpr,
                 NSUB: tl.constexpr, PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr):
    """``acc`` plus the products of the packed chunks ``c_lo .. c_hi`` (each sub-tile
    dequantized to ``XT``, x's dtype, then one dot)."""
    PACKED_BF16: tl.constexpr = BITS == 4 and FMT <= 1 and XT == tl.bfloat16  # (FMT 0 / 1: int sym / asym)
    for c in range(c_lo, c_hi):
        packed = tl.load(w_cols + (c * SUB + offs_j)[:, None], mask=nmask, other=0)
        if not PACKED_BF16:
            packed = packed.to(tl.int32)
        for i in tl.static_range(NSUB):
            k_first = c * 128 + i * SUB
            if PACKED_BF16:  # the same values in bf16 arithmetic, bytes unpacked in PTX (w4_bf16)
                z = 0
                if FMT == 1:
                    z = _group_param(z_ptr, offs_n, stride_sn, k_first, N, SUB, G)
                s = _group_param(s_ptr, offs_n, stride_sn, k_first, N, SUB, G)
                val = w4_bf16(packed, i, z, s, FMT == 1, INTERP_BF16)
            else:
                val = dequant_subtile(packed, i, s_ptr, z_ptr, offs_n, stride_sn, k_first, N, gscale, FMT, BITS,
                                      SUB, G)
            if INTERP_BF16:  # the interpreter's fp32 -> bf16 cast truncates: round in fp32 bits
                w = _bf16_rne(val)
            else:
                w = val.to(XT)
            ks = k_first + offs_j
            a = tl.load(x_rows + ks[None, :], mask=mmask & (ks[None, :] < K), other=0.0)
            acc = _dot16(a, w, acc, PRECISION, INTERP_BF16)
    return acc


@triton.jit(do_not_specialize=["M"])
def inv_w8a8_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, K, SEG_K, stride_am, stride_bn, stride_om,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr, ACC_INT: tl.constexpr,
    SEGMENTED: tl.constexpr, PARTIAL: tl.constexpr,
):
    """``out = (a [M, K] @ b [N, K].T) * sa[:, None] * sb[None, :] (+ bias)``: int8 codes with an
    int32 accumulator (exact: the order cannot matter) or e4m3 codes with fp32 accumulation,
    promoted every BK products; K in segments as :func:`inv_dense_kernel` (PARTIAL: the
    segment's unscaled sum, int32 or fp32, into ``out``)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mmask = offs_m[:, None] < M
    nmask = offs_n[None, :] < N
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    b_cols = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn
    if ACC_INT:
        zero = tl.zeros([BM, BN], dtype=tl.int32)
    else:
        zero = tl.zeros([BM, BN], dtype=tl.float32)
    if SEGMENTED:
        seg_lo, seg_hi = _segments(K, SEG_K, PARTIAL)
        total = zero
        for seg in range(seg_lo, seg_hi):
            k0 = seg * SEG_K
            acc = _code_walk(a_rows, b_cols, offs_k, mmask, nmask, k0, tl.minimum(SEG_K, K - k0), K, zero, BK, ACC_INT)
            total = tl.where(seg == seg_lo, acc, total + acc)
    else:
        total = _code_walk(a_rows, b_cols, offs_k, mmask, nmask, 0, K, K, zero, BK, ACC_INT)
    if PARTIAL:
        _inv_finish(total, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, True)
    else:
        _inv_store(_code_scales(total, sa_ptr, sb_ptr, offs_m, offs_n, M, N), bias_ptr, out_ptr, offs_m, offs_n,
                   M, N, stride_om, HAS_BIAS)


@triton.jit
def _code_walk(a_rows, b_cols, offs_k, mmask, nmask, k0, length, K, acc, BK: tl.constexpr, ACC_INT: tl.constexpr):
    """``acc`` plus the code products of columns ``k0 .. k0 + length`` in steps of BK."""
    for kb in range(0, tl.cdiv(length, BK)):
        ks = k0 + kb * BK + offs_k
        a = tl.load(a_rows + ks[None, :], mask=mmask & (ks[None, :] < K), other=0.0)
        b = tl.load(b_cols + ks[:, None], mask=nmask & (ks[:, None] < K), other=0.0)
        if ACC_INT:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BK)
    return acc


@triton.jit
def _code_scales(total, sa_ptr, sb_ptr, offs_m, offs_n, M, N):
    """The code GEMM's sum times the row's and the column's scales, in fp32."""
    sa = tl.load(sa_ptr + offs_m, mask=offs_m < M, other=0.0)
    sb = tl.load(sb_ptr + offs_n, mask=offs_n < N, other=0.0)
    return total.to(tl.float32) * sa[:, None] * sb[None, :]


@triton.jit
def _dot16(a, b, acc, PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation. INTERP_BF16 (Triton's CPU interpreter only, which
    multiplies bf16 tiles as raw integers): the bf16 operands as fp32, whose products are the
    same exact values the GPU's bf16 MMA forms."""
    if INTERP_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _bf16_rne(v):
    """fp32 ``v`` rounded to the nearest bf16 value (ties to even), kept in fp32 (finite v)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _segments(total, seg, PARTIAL: tl.constexpr):
    """The K segments this program sums: its own (grid axis 2) for a partial, else all."""
    if PARTIAL:
        lo = tl.program_id(2)
        hi = lo + 1
    else:
        lo = 0
        hi = tl.cdiv(total, seg)
    return lo, hi


@triton.jit
def _inv_finish(total, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS: tl.constexpr,
                PARTIAL: tl.constexpr):
    """The output tile (:func:`_inv_store`), or the segment's fp32 partial into ``out_ptr``
    (``[segments, M, N]``, dense) for :func:`inv_segments_kernel`."""
    if PARTIAL:
        omask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        part = out_ptr + tl.program_id(2).to(tl.int64) * M * N
        tl.store(part + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], total, mask=omask)
    else:
        _inv_store(total, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def inv_segments_kernel(part_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, SEGS, stride_om,
                        BM: tl.constexpr, BN: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The segments' partials ``[SEGS, M, N]`` (fp32, or int32 code sums) added in order (the
    first as it is, as the kernels' own loop over segments adds them), times the W8A8 scales
    (HAS_SCALES, as :func:`_code_scales`), then :func:`_inv_store`'s epilogue."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    omask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    at = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    ptrs = part_ptr + at
    total = tl.load(ptrs, mask=omask, other=0)
    for _ in range(1, SEGS):
        ptrs += M * N  # (M <= SMALL_M rows: no overflow)
        total = total + tl.load(ptrs, mask=omask, other=0)
    if HAS_SCALES:
        total = _code_scales(total, sa_ptr, sb_ptr, offs_m, offs_n, M, N)
    _inv_store(total, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS)


@triton.jit
def _inv_store(acc, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS: tl.constexpr):
    """fp32 tile (+ bias in fp32), rounded once to out's dtype; elementwise, so row-local."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    omask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=omask)


# ------------------------------------------------------------------------------- launchers


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _out(m: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # The interpreter's float -> 16-bit cast truncates: there the kernel writes fp32 and torch
    # rounds (to nearest even, as the GPU's store conversion does); elementwise either way.
    return torch.empty(m, n, dtype=torch.float32 if device.type != "cuda" else dtype, device=device)


def _precision(dtype: torch.dtype) -> str:
    # fp32 operands: true fp32 products, never tf32 (whose use could differ between builds)
    return "ieee" if dtype == torch.float32 else "tf32"


def _interp_bf16(x: torch.Tensor) -> bool:
    return interpreting(x) and x.dtype == torch.bfloat16


def _grid(m: int, n: int, cfg: InvariantConfig) -> tuple[int, int]:
    return (cdiv(m, cfg.bm), cdiv(n, cfg.bn))


def dense_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               cfg: InvariantConfig | None = None, seg: int | None = None,
               parallel: bool | None = None) -> torch.Tensor:
    """Batch-invariant ``x [M, K] @ w [N, K].T (+ bias)`` in x's dtype (w is cast to it).
    ``seg``: columns per K segment (default :func:`k_segment`); ``parallel``: one program per
    segment (default: at decode sizes); both for tests."""
    x = _rows(x)
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"x has K = {k}, weight {tuple(w.shape)}")
    w = w.to(x.dtype)
    w = w if w.stride(-1) == 1 else w.contiguous()
    cfg = cfg or invariant_config("dense", n, k, m, interpreting(x), fp32=x.dtype == torch.float32)
    out = _out(m, n, x.dtype, x.device)
    seg = seg or k_segment(k)
    segs = cdiv(k, seg)
    partial = _partial(segs, m, parallel)
    if m and n:
        dest = torch.empty(segs, m, n, dtype=torch.float32, device=x.device) if partial else out
        inv_dense_kernel[_grid(m, n, cfg) + ((segs,) if partial else ())](
            x, w, bias if bias is not None else w, dest, m, n, k, seg, x.stride(0), w.stride(0), out.stride(0),
            BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, HAS_BIAS=bias is not None, PRECISION=_precision(x.dtype),
            INTERP_BF16=_interp_bf16(x), SEGMENTED=segs > 1, PARTIAL=partial, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        if partial:
            _add_segments(dest, bias, out)
    return out.to(x.dtype)


def weight_only_gemm(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                     cfg: InvariantConfig | None = None, seg: int | None = None,
                     parallel: bool | None = None) -> torch.Tensor:
    """Batch-invariant ``x [M, K] @ deq(W).T (+ bias)`` for a packed weight-only scheme
    (``seg``, ``parallel``: as :func:`dense_gemm`'s)."""
    sc = qw.scheme
    if not sc.packed or sc.quantizes_activations:
        raise ValueError(f"{sc.name}: the weight-only invariant GEMM takes packed weight-only schemes")
    x = _rows(x)
    m, k = x.shape
    n = qw.shape[0]
    if qw.shape[1] != k:
        raise ValueError(f"x has K = {k}, weight {qw.shape}")
    cfg = cfg or invariant_config("weight_only", n, k, m, interpreting(x), fp32=x.dtype == torch.float32)
    scales, zeros, gs = _group_params(qw)
    out = _out(m, n, x.dtype, x.device)
    seg = seg or k_segment(k)
    nchunk = _nchunk(qw)
    segs = cdiv(nchunk, seg // 128)
    partial = _partial(segs, m, parallel)
    if m and n:
        dest = torch.empty(segs, m, n, dtype=torch.float32, device=x.device) if partial else out
        inv_weight_only_kernel[_grid(m, n, cfg) + ((segs,) if partial else ())](
            x, qw.qdata, scales, zeros, gs, bias if bias is not None else scales, dest, m, n, k, nchunk, seg // 128,
            x.stride(0), qw.qdata.stride(0), scales.stride(0), out.stride(0),
            FMT=_fmt(qw), BITS=sc.weight_bits, G=sc.group_size, BM=cfg.bm, BN=cfg.bn,
            HAS_BIAS=bias is not None, PRECISION=_precision(x.dtype), INTERP_BF16=_interp_bf16(x),
            SEGMENTED=segs > 1, PARTIAL=partial, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if partial:
            _add_segments(dest, bias, out)
    return out.to(x.dtype)


def w8a8_gemm(xq: torch.Tensor, sx: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
              out_dtype: torch.dtype, cfg: InvariantConfig | None = None, seg: int | None = None,
              parallel: bool | None = None) -> torch.Tensor:
    """Batch-invariant ``(xq [M, K] @ W.T) * sx[:, None] * sw[None, :] (+ bias)`` on per-token
    codes (int8 or e4m3, matching the weight's) and their fp32 scales; K in segments as
    :func:`dense_gemm` (``seg``, ``parallel``: as its; int8's integer sums are the same in
    any segments)."""
    sc = qw.scheme
    if sc.act_format not in ("int8", "fp8") or sc.packed or sc.group_size is not None:
        raise ValueError(f"{sc.name}: the W8A8 invariant GEMM takes w8a8-int8 / w8a8-fp8 weights")
    if xq.dtype != qw.qdata.dtype:
        raise ValueError(f"codes of dtype {xq.dtype} on a {qw.qdata.dtype} weight")
    xq = xq if xq.stride(-1) == 1 else xq.contiguous()
    m, k = xq.shape
    n = qw.shape[0]
    if qw.shape[1] != k:
        raise ValueError(f"codes have K = {k}, weight {qw.shape}")
    cfg = cfg or invariant_config("w8a8", n, k, m, interpreting(xq))
    out = _out(m, n, out_dtype, xq.device)
    seg = seg or k_segment(k)
    segs = cdiv(k, seg)
    partial = _partial(segs, m, parallel)
    acc_int = xq.dtype == torch.int8
    if m and n:
        dest = out
        if partial:
            dest = torch.empty(segs, m, n, dtype=torch.int32 if acc_int else torch.float32, device=xq.device)
        inv_w8a8_kernel[_grid(m, n, cfg) + ((segs,) if partial else ())](
            xq, qw.qdata, sx, qw.scales, bias if bias is not None else sx, dest, m, n, k, seg,
            xq.stride(0), qw.qdata.stride(0), out.stride(0),
            BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, HAS_BIAS=bias is not None, ACC_INT=acc_int,
            SEGMENTED=segs > 1, PARTIAL=partial, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if partial:
            _add_segments(dest, bias, out, (sx, qw.scales))
    return out.to(out_dtype)


def invariant_linear(x: torch.Tensor, qw_or_weight: QuantizedWeight | torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y [..., N]``: the scheme's GEMM of ``x [..., K]`` (per-token quantization first for
    W8A8), batch-invariant in every row; output in x's dtype. A tensor weight is dense."""
    lead = x.shape[:-1]
    x2 = _rows(x)
    w = qw_or_weight
    if isinstance(w, torch.Tensor):
        y = dense_gemm(x2, w, bias)
    elif not w.scheme.quantizes_weights:
        y = dense_gemm(x2, w.qdata, bias)
    elif w.scheme.quantizes_activations:
        if w.scheme.packed:
            raise NotImplementedError(f"{w.scheme.name}: no batch-invariant W4A8 kernel yet")
        xq, sx = act_quant(x2.contiguous(), w.scheme.act_format)  # one program per row: row-local
        y = w8a8_gemm(xq, sx, w, bias, x.dtype)
    else:
        y = weight_only_gemm(x2, w, bias)
    return y.view(*lead, y.shape[-1])
