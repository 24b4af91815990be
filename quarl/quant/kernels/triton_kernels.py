"""Triton kernels for the quantized GEMMs (imported lazily: needs triton).

Every kernel computes exactly the math of :mod:`quarl.quant.reference` (up to the
accumulation order of the dot products) and reads the packed layouts defined there:
for 4-bit formats a chunk of 128 K-columns is 64 bytes per output row, low nibbles
for columns 0..63 and high nibbles for 64..127, so a tile of packed bytes ``[64, BN]``
unpacks with one mask and one shift into two ``[64, BN]`` weight tiles that multiply
two contiguous ``[BM, 64]`` slices of x (2-bit: four quarters of 32). K is looped over
in such chunks; columns past the logical K are masked out of x, and the packed weights
there are exact zeros.

Kernels:
* ``act_quant_kernel``: per-token dynamic int8 / e4m3 quantizer (one program per row;
  the row stays in registers up to 32k columns), feeding the W8A8/W4A8/FP8 GEMMs.
* ``wo_gemm_kernel``: weight-only dequant GEMM (int4 sym/asym, int2 asym, nvfp4, mxfp4)
  with bf16/fp16 activations; dequantizes each tile in registers then runs a tensor-core
  dot. ``IS_SPLIT`` splits K over ``program_id(1)``; the last split of each tile adds
  the fp32 partials in a fixed order inside the same launch (``_store_tile``): one
  launch, deterministic. That is the small-M (decode) path.
* ``dequant_kernel``: packed weight -> bf16 ``[N, K]`` for the large-M path (cuBLAS GEMM).
* ``int8_gemm_kernel``: W8A8 int8 x int8 -> int32 (or e4m3 x e4m3 -> fp32) with both
  scales fused in the epilogue; ``w8a8_tma_kernel`` the same with TMA operand loads, a
  persistent grid and optional split-K, or GATED: a ``[gate; up]`` projection whose epilogue
  applies SiLU-and-mul and writes per-tile row maxima.
* ``act_quant_partials_kernel``: per-token codes of a tensor whose row maxima another kernel
  wrote as partials (the gated GEMM, the engine's SiLU-and-mul): one parallel pass.
* ``w4_swap_kernel``: int4 g128 weight-only GEMM for small M (see its docstring): weight
  tile K-contiguous, 16-bit dequant, swapped tensor-core dot (weights as the A operand).
* ``w4a8_gemm_kernel``: int4 g128 weights unpacked to int8, int8 x int8 dots per group,
  group scale applied to each group's int32 partial, token scale in the epilogue.

Rounding inside kernels uses the fp32 "magic number" trick (``(v + 1.5 * 2^23) - 1.5 *
2^23`` rounds to nearest even for ``|v| < 2^22``) and IEEE division (``div_rn``) where the
reference divides, so codes equal those of torch's ``round`` and ``/``. e4m3 activation
codes are stored as bytes through a uint8 view: on the GPU from the hardware conversion,
under the interpreter (whose fp8 cast truncates) built with integer arithmetic
(``_e4m3_byte``, a port of torch's own fp32 -> e4m3fn conversion); see ``e4m3_code``.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: kernels are never launched with PDL
    gdc_launch_dependents = gdc_wait = None

FMT_INT_SYM = 0
FMT_INT_ASYM = 1
FMT_NVFP4 = 2
FMT_MXFP4 = 3


@triton.jit
def wait_ahead(PDL: tl.constexpr):
    """First step of a kernel that may be a programmatic dependent launch
    (:func:`quarl.quant.kernels.device.dependent_launches`): wait until the kernel ahead on
    the stream has finished and its writes are visible, then let the next kernel be
    scheduled (it waits in turn). Nothing without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _rne(v):
    magic = tl.full(v.shape, 12582912.0, tl.float32)
    return (v + magic) - magic


@triton.jit
def _e4m3_byte(v):
    """fp32 -> e4m3fn byte (int32 in [0, 255]) exactly as torch casts ``clamp(v, +-448)``.

    A port of c10's ``fp8e4m3fn_from_fp32_value`` (integer round-to-nearest-even on the fp32
    bits; the subnormal range rounds by adding 2^14, whose fp32 ulp is e4m3's 2^-9), so no
    Triton fp8 conversion is involved. NaN -> 0x7f | sign, as torch's cast.
    """
    nan = v != v
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.minimum(tl.maximum(v, -448.0), 448.0).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    norm = (a + (((7 - 127) << 23) + 0x7FFFF) + ((a >> 20) & 1)) >> 20
    code = tl.where(a < (121 << 23), sub, norm)
    return tl.where(nan, 0x7F, code) | sign


# On the GPU the e4m3 codes come from the hardware conversion (``cvt.rn.satfinite.e4m3x2.f32``
# on sm89+; equal to torch's cast of the clamped value, checked on the H200 over every e4m3
# value, midpoint and subnormal: tests_gpu). It is ~3x fewer instructions per element than
# ``_e4m3_byte``, which kept the activation quantizer instruction-bound. Triton's interpreter
# truncates in that cast, so on CPU the codes are built as bytes: :data:`HW_E4M3` (below) says
# which, from how triton compiled these kernels.


@triton.jit
def _e4m3_satfinite(v):
    """fp32 -> e4m3fn byte (int32) by the hardware's satfinite conversion, one value per
    conversion. Triton's own cast converts pairs and splits each 16-bit result with a shift,
    which ptxas (CUDA 12.8, the one triton 3.6 ships) folded into the conversion's merge
    operand taken from a stale register: in ``act_quant_kernel`` with ``WRITE_DQ`` at
    K = 768 every odd column's code came out wrong."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 h; cvt.rn.satfinite.e4m3x2.f32 h, 0f00000000, $1; cvt.u32.u16 $0, h; }",
        "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1,
    )


# whether these kernels run compiled for the GPU (not under triton's interpreter, which
# ``triton.jit`` chose from TRITON_INTERPRET when it decorated them): no environment read here
HW_E4M3 = tl.constexpr(type(_e4m3_satfinite).__name__ != "InterpretedFunction")


@triton.jit
def e4m3_code(v):
    """fp32 -> e4m3fn byte (int32 in [0, 255]) exactly as torch's ``clamp(v, +-448)`` + cast."""
    if HW_E4M3:
        # no clamp: the satfinite conversion takes +-inf and finite values past +-448 to
        # +-448 (what the clamp does first in torch) and NaN to 0x7f; torch's cast gives
        # NaN the input's sign bit. Every other code already carries the input's sign (zeros
        # included), so or-ing it in unconditionally is exact and needs no NaN test.
        return _e4m3_satfinite(v) | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)
    else:
        return _e4m3_byte(v)


@triton.jit
def e4m3_value(b):
    """fp32 value of e4m3fn bytes ``b`` (uint8, sign bit included), exact: the hardware
    conversion on the GPU, integer arithmetic under the interpreter. NaN bytes are not
    decoded (the quantizers here never write them)."""
    if HW_E4M3:
        return b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        bi = b.to(tl.int32)
        return _e4m3_value(bi & 0x7F) * (1.0 - 2.0 * ((bi >> 7) & 1).to(tl.float32))


@triton.jit
def e4m3_byte_kernel(v_ptr, q_ptr, n, BLOCK: tl.constexpr):
    """``q = e4m3_code(v)`` elementwise (tests the conversion alone)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + offs, mask=offs < n, other=0.0)
    tl.store(q_ptr + offs, e4m3_code(v).to(tl.uint8), mask=offs < n)


@triton.jit
def act_scale(amax, IS_FP8: tl.constexpr):
    """Per-token scale from the row's absolute maximum: ``amax * fp32(1 / qmax)``, 1 for a
    zero row. A multiply, so torch (which turns division by a scalar into a multiply by
    its reciprocal on CUDA) and these kernels agree bit for bit."""
    inv_qmax = 1.0 / 448.0 if IS_FP8 else 1.0 / 127.0
    return tl.where(amax > 0, amax * inv_qmax, 1.0)


@triton.jit
def act_inv_scale(s):
    """``fp32(1 / s)``, correctly rounded (IEEE division, as torch's ``1.0 / s``), once per row."""
    return tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)


@triton.jit
def store_act_codes(q_ptr, v, inv_s, msk, IS_FP8: tl.constexpr):
    """Codes of fp32 values ``v`` under the row's reciprocal scale ``inv_s`` (one fp32
    product per element, as the reference): e4m3 bytes (through a uint8 pointer) or int8
    clamped to +-127. Returns the codes' values in fp32."""
    t = v * inv_s
    if IS_FP8:
        c = e4m3_code(t)
        tl.store(q_ptr, c.to(tl.uint8), mask=msk)
        return _e4m3_value(c & 0x7F) * (1.0 - 2.0 * ((c >> 7) & 1).to(tl.float32))
    else:
        t = tl.minimum(tl.maximum(_rne(t), -127.0), 127.0)
        tl.store(q_ptr, t.to(tl.int8), mask=msk)
        return t


@triton.jit
def act_quant_kernel(
    x_ptr, q_ptr, s_ptr, dq_ptr, K, stride_xm, stride_qm, stride_dm,
    IS_FP8: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, WRITE_DQ: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row per program. ONE_PASS (BLOCK >= K): the row stays in registers, x is read once.
    WRITE_DQ: also ``codes * scale`` rounded to dq's dtype (what ``act_dequant_kernel`` gives)."""
    wait_ahead(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        msk = offs < K
        v = tl.load(x_ptr + row * stride_xm + offs, mask=msk, other=0.0).to(tl.float32)
        a = tl.max(tl.abs(v), axis=0)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            msk = k0 + offs < K
            v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=msk, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        a = tl.max(amax, axis=0)
    s = act_scale(a, IS_FP8)
    tl.store(s_ptr + row, s)
    inv_s = act_inv_scale(s)
    for k0 in range(0, K, BLOCK):
        msk = k0 + offs < K
        if not ONE_PASS:
            v = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=msk, other=0.0).to(tl.float32)
        c = store_act_codes(q_ptr + row * stride_qm + k0 + offs, v, inv_s, msk, IS_FP8)
        if WRITE_DQ:
            tl.store(dq_ptr + row * stride_dm + k0 + offs, (c * s).to(dq_ptr.dtype.element_ty), mask=msk)


@triton.jit
def act_dequant_kernel(q_ptr, s_ptr, out_ptr, K, stride_qm, stride_om, IS_FP8: tl.constexpr, BLOCK: tl.constexpr):
    """``out = codes * scale`` per token, in fp32, rounded once to out's dtype (e4m3 read as bytes)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    msk = cols < K
    if IS_FP8:
        b = tl.load(q_ptr + row * stride_qm + cols, mask=msk, other=0).to(tl.int32)
        v = _e4m3_value(b & 0x7F) * (1.0 - 2.0 * ((b >> 7) & 1).to(tl.float32))
    else:
        v = tl.load(q_ptr + row * stride_qm + cols, mask=msk, other=0).to(tl.float32)
    s = tl.load(s_ptr + row)
    tl.store(out_ptr + row * stride_om + cols, (v * s).to(out_ptr.dtype.element_ty), mask=msk)


@triton.jit
def _dense_parts(offs_m, offs_n, M, N):
    """Partials layout ``part [n_split, M, N]``: (offsets of a tile's elements inside one
    split's slab, the slab size), for :func:`_store_tile`."""
    return offs_m[:, None].to(tl.int64) * N + offs_n[None, :], N * M


@triton.jit
def _store_tile(
    acc, out_ptr, part_ptr, cnt_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om,
    pid_tile, pid_k, n_split, part_off, split_stride, IS_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Write an fp32 tile (+ bias) as the output dtype.

    Split-K: each split stores its partial sum to ``part_ptr + pid_k * split_stride +
    part_off`` (fp32; :func:`_dense_parts` or the TMA kernel's compact tail layout), then
    bumps the tile's counter; the split that arrives last adds the partials in split
    order (so the result does not depend on arrival order: deterministic), writes the
    output and resets the counter for the next launch (CUDA-graph replays included).
    """
    omask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if IS_SPLIT:
        tl.store(part_ptr + pid_k * split_stride + part_off, acc, mask=omask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_tile, 1, sem="acq_rel")
        if arrived == n_split - 1:
            acc = tl.zeros_like(acc)
            for sp in range(0, n_split):
                acc += tl.load(part_ptr + sp * split_stride + part_off, mask=omask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=omask)
            tl.atomic_xchg(cnt_ptr + pid_tile, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _tile_ids(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped ordering of output tiles so neighbouring programs share weight tiles in L2:
    ``(pid_m, pid_n)`` of tile number ``pid``."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _e2m1_value(code):
    """fp32 value of e2m1 codes (int32, sign-magnitude s|ee|m)."""
    e = (code >> 1) & 3
    m = code & 1
    twice = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
    sign = 1.0 - 2.0 * ((code >> 3) & 1).to(tl.float32)
    return twice.to(tl.float32) * 0.5 * sign


@triton.jit
def _e4m3_value(b):
    """fp32 value of non-negative e4m3 bytes (int32)."""
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e > 0, normal, m.to(tl.float32) * 0.001953125)


@triton.jit
def _group_param(ptr, offs_n, stride_n, k_first, N, SUB: tl.constexpr, G: tl.constexpr):
    """Per-group tensor ``[N, Kp/G]`` for the rows k_first..k_first+SUB of a weight tile.

    One row ``[1, BN]`` when the whole sub-tile sits in one group, else ``[SUB, BN]``.
    """
    nmask = offs_n[None, :] < N
    if G >= SUB:
        out = tl.load(ptr + offs_n[None, :] * stride_n + k_first // G, mask=nmask, other=0)
    else:
        rows = (k_first + tl.arange(0, SUB)) // G
        out = tl.load(ptr + offs_n[None, :] * stride_n + rows[:, None], mask=nmask, other=0)
    return out


@triton.jit
def biased_f32(v):
    """``2**23 + v`` as fp32 for int32 ``0 <= v < 2**23`` (codes, zero points): ``v``'s bits
    put in that power's mantissa, no int-to-float conversion (which runs at a sixteenth of the
    FP32 rate on Hopper and caps a 4-bit GEMM's dequantization near half the memory
    bandwidth). The difference of two, or one less ``2**23 + c``, is exact: ``v - z`` or
    ``v - c`` as the conversion would give it."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True)


# bf16 `128 + code` of four packed bytes' low nibbles (`$2`: the bytes, four to a register;
# `$0`, `$1`: two bf16 each): mask the nibbles, then one PRMT a pair sets each code byte under a
# 0x43 high byte. W4_HIGH shifts the high nibbles down first.
W4_LOW = tl.constexpr("{ .reg .b32 t; and.b32 t, $2, 0x0f0f0f0f; "
                       "prmt.b32 $0, t, 0x43434343, 0x5140; prmt.b32 $1, t, 0x43434343, 0x7362; }")
W4_HIGH = tl.constexpr("{ .reg .b32 t; shr.u32 t, $2, 4; and.b32 t, t, 0x0f0f0f0f; "
                        "prmt.b32 $0, t, 0x43434343, 0x5140; prmt.b32 $1, t, 0x43434343, 0x7362; }")


@triton.jit
def w4_bf16(packed, h: tl.constexpr, z, s, ASYM: tl.constexpr, F32: tl.constexpr):
    """bf16 weights ``(code - z) * s`` of the packed bytes' nibble ``h`` (codes 0..15), their
    zero points (uint8 ``z``, or 8) and scales ``s``: the bf16 whose bits are ``code | 0x4300`` is
    ``128 + code``, less ``128 + z``, exactly. Four bytes become four such bf16 in three
    instructions (``W4_LOW``, inline PTX: Triton's own byte-to-int16 extension costs three PRMTs
    a pair). Then times the scale in bf16 (fp32 scales that hold bf16 values, as the quantizer
    rounds them, ``reference.bf16_scale``): one rounding of the exact product, the bf16 that
    ``ops.dequantize`` writes from its fp32 product. Packed bf16 arithmetic, two weights an
    instruction; the chain reads only loads and constants, so where the weight is a register
    operand of the MMA the compiler converts the packed bytes to that layout and dequantizes
    there, with no trip of the dequantized tile through shared memory. ``F32`` (the interpreter,
    which runs no PTX and whose bf16 arithmetic is wrong): the same bits built with integer ops,
    the difference and the exact product in fp32, for the caller to round."""
    if F32:
        code = ((packed >> (4 * h)) & 15).to(tl.int16)
        v = (code | 0x4300).to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        v = tl.inline_asm_elementwise(W4_LOW if h == 0 else W4_HIGH, "=r,=r,r", [packed], dtype=tl.bfloat16,
                                      is_pure=True, pack=4)
    if ASYM:
        zb = (z.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
        if F32:
            zb = zb.to(tl.float32)
        v = v - zb
    else:
        v = v - 136.0  # 128 + 8
    if F32:
        return v * s
    return v * s.to(tl.bfloat16)


@triton.jit
def dequant_subtile(packed, i, s_ptr, z_ptr, offs_n, stride_sn, k_first, N, gscale,
                    FMT: tl.constexpr, BITS: tl.constexpr, SUB: tl.constexpr, G: tl.constexpr):
    """Sub-tile ``i`` of a packed ``[SUB, BN]`` chunk (columns ``k_first ..`` of the weight)
    as fp32 weight values: the codes' values (int formats minus their zero point, fp4 by
    table) times their group scale (nvfp4: e4m3 times ``gscale``; mxfp4: e8m0). FMT as
    :data:`FMT_INT_SYM` etc."""
    CODE_MASK: tl.constexpr = (1 << BITS) - 1
    HALF: tl.constexpr = 1 << (BITS - 1)
    code = (packed >> (BITS * i)) & CODE_MASK
    if FMT == 2 or FMT == 3:
        val = _e2m1_value(code)
    elif FMT == 0:
        val = biased_f32(code) - (8388608.0 + HALF)
    else:
        val = biased_f32(code) - biased_f32(_group_param(z_ptr, offs_n, stride_sn, k_first, N, SUB, G).to(tl.int32))
    s = _group_param(s_ptr, offs_n, stride_sn, k_first, N, SUB, G)
    if FMT == 2:
        s = _e4m3_value(s.to(tl.int32)) * gscale
    elif FMT == 3:
        s = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return val * s


@triton.jit
def wo_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, gs_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, NCHUNK, CHUNKS_PER_SPLIT, N_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_om,
    FMT: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, IS_SPLIT: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, POST_SCALE: tl.constexpr,
):
    # POST_SCALE (int formats, G % 128 == 0): multiply each chunk's fp32 partial product by
    # its group scale instead of scaling the [128, BN] weight tile: fewer multiplies.
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BM, BN, GROUP_M)
    pid_k = tl.program_id(1)
    NSUB: tl.constexpr = 8 // BITS
    SUB: tl.constexpr = 128 // NSUB
    CODE_MASK: tl.constexpr = (1 << BITS) - 1
    HALF: tl.constexpr = 1 << (BITS - 1)
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
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    c_lo = pid_k * CHUNKS_PER_SPLIT
    c_hi = tl.minimum(c_lo + CHUNKS_PER_SPLIT, NCHUNK)
    for c in range(c_lo, c_hi):
        packed = tl.load(w_cols + (c * SUB + offs_j)[:, None], mask=nmask, other=0).to(tl.int32)
        if POST_SCALE:
            part = tl.zeros([BM, BN], dtype=tl.float32)
            for i in tl.static_range(NSUB):
                k_first = c * 128 + i * SUB
                code = (packed >> (BITS * i)) & CODE_MASK
                if FMT == 0:
                    ival = biased_f32(code) - (8388608.0 + HALF)
                else:
                    ival = biased_f32(code) - biased_f32(
                        _group_param(z_ptr, offs_n, stride_sn, k_first, N, SUB, G).to(tl.int32))
                ks = k_first + offs_j
                x = tl.load(x_rows + ks[None, :], mask=mmask & (ks[None, :] < K), other=0.0)
                part = tl.dot(x, ival.to(x_ptr.dtype.element_ty), part)
            acc += part * _group_param(s_ptr, offs_n, stride_sn, c * 128, N, SUB, G)
        else:
            for i in tl.static_range(NSUB):
                k_first = c * 128 + i * SUB
                w = dequant_subtile(packed, i, s_ptr, z_ptr, offs_n, stride_sn, k_first, N, gscale,
                                    FMT, BITS, SUB, G).to(x_ptr.dtype.element_ty)
                ks = k_first + offs_j
                x = tl.load(x_rows + ks[None, :], mask=mmask & (ks[None, :] < K), other=0.0)
                acc += tl.dot(x, w)
    part_off, split_stride = _dense_parts(offs_m, offs_n, M, N)
    _store_tile(acc, out_ptr, part_ptr, cnt_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om,
                tl.program_id(0), pid_k, N_SPLIT, part_off, split_stride, IS_SPLIT, HAS_BIAS)


@triton.jit
def int8_gemm_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, KBLOCKS_PER_SPLIT, N_SPLIT,
    stride_am, stride_bn, stride_om,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IS_SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, ACC_INT: tl.constexpr,
    PDL: tl.constexpr,
):
    """``out = (a [M, K] @ b [N, K].T) * sa[:, None] * sb[None, :]`` (+ bias): int8 x int8
    with int32 accumulation, or e4m3 x e4m3 with fp32 accumulation (the dot's result type
    follows the operands)."""
    wait_ahead(PDL)
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BM, BN, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mmask = offs_m[:, None] < M
    nmask = offs_n[None, :] < N
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    b_cols = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn
    if ACC_INT:
        acc = tl.zeros([BM, BN], dtype=tl.int32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    kb_lo = pid_k * KBLOCKS_PER_SPLIT
    kb_hi = tl.minimum(kb_lo + KBLOCKS_PER_SPLIT, tl.cdiv(K, BK))
    for kb in range(kb_lo, kb_hi):
        ks = kb * BK + offs_k
        a = tl.load(a_rows + ks[None, :], mask=mmask & (ks[None, :] < K), other=0.0)
        b = tl.load(b_cols + ks[:, None], mask=nmask & (ks[:, None] < K), other=0.0)
        acc = _w8a8_dot(a, b, acc, BK, ACC_INT)
    part_off, split_stride = _dense_parts(offs_m, offs_n, M, N)
    _w8a8_store(acc, sa_ptr, sb_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om,
                tl.program_id(0), pid_k, N_SPLIT, part_off, split_stride, IS_SPLIT, HAS_BIAS)


@triton.jit
def _w8a8_dot(a, b, acc, BK: tl.constexpr, ACC_INT: tl.constexpr):
    """``acc + a @ b`` for 8-bit tiles ``a [BM, BK]``, ``b [BK, BN]``: int32 accumulation
    (triton 3.6 wants ``out_dtype`` to match an int32 accumulator), or fp32 for e4m3.

    e4m3: Hopper's fp8 MMA keeps a narrow (~14-bit) accumulator, and Triton's sm90 default
    never promotes it to fp32 over the whole K loop (percent-level relative error at K = 4096,
    enough to move the engine's log-probs away from the learner's). Promote after every tile
    of BK products, as cuBLAS does without fast accumulation."""
    if ACC_INT:
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    else:
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=BK)
    return acc


@triton.jit
def _w8a8_scaled(acc, sa, sb_ptr, offs_n, N):
    """``acc * sa[:, None] * sb[None, :]`` in fp32: token scales ``sa`` (loaded) times the
    channel scales at ``offs_n``."""
    sb = tl.load(sb_ptr + offs_n, mask=offs_n < N, other=0.0)
    return acc.to(tl.float32) * sa[:, None] * sb[None, :]


@triton.jit
def _w8a8_store(
    acc, sa_ptr, sb_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om,
    pid_tile, pid_k, n_split, part_off, split_stride, IS_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """W8A8 epilogue: ``acc * sa[:, None] * sb[None, :]`` (token and channel scales), then
    :func:`_store_tile`."""
    sa = tl.load(sa_ptr + offs_m, mask=offs_m < M, other=0.0)
    y = _w8a8_scaled(acc, sa, sb_ptr, offs_n, N)
    _store_tile(y, out_ptr, part_ptr, cnt_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om,
                pid_tile, pid_k, n_split, part_off, split_stride, IS_SPLIT, HAS_BIAS)


@triton.jit
def silu_mul_value(g, u, dt: tl.constexpr):
    """``dt(dt(silu(g)) * u)`` for fp32 ``g``, ``u`` holding ``dt`` values: the reference's
    rounding steps (``quarl.model.transformer``'s SiLU-and-mul in the activation dtype)."""
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    return (s * u).to(dt)


@triton.jit
def _gated_store(
    acc_g, acc_u, sa_ptr, sb_ptr, out_ptr, amax_ptr, offs_m, offs_n, M, N, stride_om, n_tiles, pid_n,
):
    """Gated W8A8 epilogue: ``g`` and ``u`` rounded to the output dtype exactly as
    :func:`_w8a8_store` rounds a plain output, then ``silu(g) * u`` (:func:`silu_mul_value`)
    stored ``[M, N]``, and the tile's per-row ``max |y|`` stored to ``amax [M, n_tiles]`` at
    column ``pid_n`` (the per-token quantizer of the next GEMM reduces those partials)."""
    dt = out_ptr.dtype.element_ty
    sa = tl.load(sa_ptr + offs_m, mask=offs_m < M, other=0.0)
    g = _w8a8_scaled(acc_g, sa, sb_ptr, offs_n, N).to(dt).to(tl.float32)
    u = _w8a8_scaled(acc_u, sa, sb_ptr + N, offs_n, N).to(dt).to(tl.float32)
    y = silu_mul_value(g, u, dt)
    omask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], y, mask=omask)
    amax = tl.max(tl.where(omask, tl.abs(y.to(tl.float32)), 0.0), axis=1)
    tl.store(amax_ptr + offs_m.to(tl.int64) * n_tiles + pid_n, amax, mask=offs_m < M)


@triton.jit
def w8a8_tma_kernel(
    a_desc, b_desc, sa_ptr, sb_ptr, bias_ptr, out_ptr, amax_ptr, part_ptr, cnt_ptr,
    M, N, K, stride_om, NUM_PROGS, KBLOCKS_PER_SPLIT, N_SPLIT, T_WHOLE,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACC_INT: tl.constexpr, GATED: tl.constexpr, IS_SPLIT: tl.constexpr,
    WS: tl.constexpr,
    PDL: tl.constexpr,
):
    """The math of ``int8_gemm_kernel`` for large M: operand tiles come through
    TMA descriptors (``a [M, K]`` block ``[BM, BK]``, ``b [N, K]`` block ``[BN, BK]``; the
    copy engine zero-fills past M, N and K, so the loop has no masks or address math) and
    the grid is persistent: ``NUM_PROGS`` programs walk the work items in grouped tile order.

    Work items: the first ``T_WHOLE`` tiles whole, then each remaining tile cut along K into
    ``N_SPLIT`` items (adjacent in the walk) whose partials are summed through
    ``_store_tile`` (compact layout ``part [N_SPLIT, tiles - T_WHOLE, BM, BN]``). Without
    IS_SPLIT every tile is whole. ``T_WHOLE = 0`` splits every tile (M = 128-512: too few
    tiles of 128 x 128 to fill the GPU, and smaller tiles re-read the operands from L2);
    ``T_WHOLE`` = the tiles of the full waves splits only the last, partial wave (the
    data-parallel + stream-K hybrid: at M = 1024, 7B qkv has 288 tiles of 128 x 128 for
    132 SMs, so a whole-tile grid leaves the third wave 82% idle).

    GATED (a gate/up projection, no bias, no split): ``b`` is ``[2 N, K]``, gate rows then up
    rows. A tile computes its N columns of both halves and stores ``silu(g) * u`` through
    :func:`_gated_store` (``out [M, N]``, row maxima to ``amax_ptr``): the MLP's SiLU-and-mul
    costs no launch and ``g``, ``u`` never reach memory. WS: Triton's warp specialization of
    the item loop (loads in a producer warp)."""
    wait_ahead(PDL)
    kblocks = tl.cdiv(K, BK)
    n_tiles = tl.cdiv(N, BN)
    tiles = tl.cdiv(M, BM) * n_tiles
    n_items = T_WHOLE + (tiles - T_WHOLE) * N_SPLIT
    for item in tl.range(tl.program_id(0), n_items, NUM_PROGS, warp_specialize=WS):
        in_tail = item >= T_WHOLE
        tail = tl.maximum(item - T_WHOLE, 0)
        tile = tl.where(in_tail, T_WHOLE + tail // N_SPLIT, item)
        pid_k = tail % N_SPLIT
        kb_lo = pid_k * KBLOCKS_PER_SPLIT
        kb_hi = tl.where(in_tail, tl.minimum(kb_lo + KBLOCKS_PER_SPLIT, kblocks), kblocks)
        pid_m, pid_n = _tile_ids(tile, M, N, BM, BN, GROUP_M)
        if ACC_INT:
            acc = tl.zeros([BM, BN], dtype=tl.int32)
        else:
            acc = tl.zeros([BM, BN], dtype=tl.float32)
        if GATED:
            acc_u = tl.zeros_like(acc)
        for kb in range(kb_lo, kb_hi):
            a = a_desc.load([pid_m * BM, kb * BK])
            acc = _w8a8_dot(a, b_desc.load([pid_n * BN, kb * BK]).T, acc, BK, ACC_INT)
            if GATED:
                acc_u = _w8a8_dot(a, b_desc.load([N + pid_n * BN, kb * BK]).T, acc_u, BK, ACC_INT)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        if GATED:
            _gated_store(acc, acc_u, sa_ptr, sb_ptr, out_ptr, amax_ptr, offs_m, offs_n, M, N, stride_om, n_tiles, pid_n)
        else:
            # compact partials of tail tile (tile - T_WHOLE); unused by whole tiles
            part_off = (tile - T_WHOLE).to(tl.int64) * (BM * BN) + tl.arange(0, BM)[:, None] * BN + tl.arange(0,
                                                                                                              BN)[None,
                                                                                                                  :]
            split_stride = (tiles - T_WHOLE).to(tl.int64) * (BM * BN)
            if IS_SPLIT:
                if in_tail:
                    _w8a8_store(acc, sa_ptr, sb_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N,
                                stride_om, tile, pid_k, N_SPLIT, part_off, split_stride, True, HAS_BIAS)
                else:
                    _w8a8_store(acc, sa_ptr, sb_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N,
                                stride_om, tile, pid_k, N_SPLIT, part_off, split_stride, False, HAS_BIAS)
            else:
                _w8a8_store(acc, sa_ptr, sb_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om,
                            tile, pid_k, N_SPLIT, part_off, split_stride, False, HAS_BIAS)


@triton.jit
def act_quant_partials_kernel(
    y_ptr, amax_ptr, q_ptr, s_ptr, K, P, stride_y, stride_q,
    IS_FP8: tl.constexpr, BLOCK: tl.constexpr, PBLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per-token codes of ``y [M, K]`` whose row maxima come as partials ``amax [M, P]``
    (written by the kernel that made ``y``: the gated GEMM or the SiLU-and-mul). Grid
    ``(M, cdiv(K, BLOCK))``: every program reduces its row's partials (max is exact, so all
    agree), column block 0 stores the scale. Same codes as ``act_quant_kernel``."""
    wait_ahead(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_p = tl.arange(0, PBLOCK)
    a = tl.zeros([PBLOCK], dtype=tl.float32)
    for p0 in range(0, P, PBLOCK):
        a = tl.maximum(a, tl.load(amax_ptr + row * P + p0 + offs_p, mask=p0 + offs_p < P, other=0.0))
    s = act_scale(tl.max(a, axis=0), IS_FP8)
    if tl.program_id(1) == 0:
        tl.store(s_ptr + row, s)
    inv_s = act_inv_scale(s)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    msk = cols < K
    v = tl.load(y_ptr + row * stride_y + cols, mask=msk, other=0.0).to(tl.float32)
    store_act_codes(q_ptr + row * stride_q + cols, v, inv_s, msk, IS_FP8)


@triton.jit
def w4a8_gemm_kernel(
    a_ptr, w_ptr, sa_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, NCHUNK, CHUNKS_PER_SPLIT, N_SPLIT,
    stride_am, stride_wn, stride_sn, stride_om,
    G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IS_SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """int8 activations x int4 (symmetric, G in {64, 128}) weights; see module docstring."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BM, BN, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_j = tl.arange(0, 64)
    mmask = offs_m[:, None] < M
    nmask = offs_n[None, :] < N
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    c_lo = pid_k * CHUNKS_PER_SPLIT
    c_hi = tl.minimum(c_lo + CHUNKS_PER_SPLIT, NCHUNK)
    for c in range(c_lo, c_hi):
        packed = tl.load(w_cols + (c * 64 + offs_j)[:, None], mask=nmask, other=0).to(tl.int32)
        w_lo = ((packed & 15) - 8).to(tl.int8)
        w_hi = ((packed >> 4) - 8).to(tl.int8)
        k_lo = c * 128 + offs_j
        a_lo = tl.load(a_rows + k_lo[None, :], mask=mmask & (k_lo[None, :] < K), other=0)
        a_hi = tl.load(a_rows + (k_lo + 64)[None, :], mask=mmask & (k_lo[None, :] + 64 < K), other=0)
        s_lo = tl.load(s_ptr + offs_n.to(tl.int64) * stride_sn + (c * 128) // G, mask=offs_n < N, other=0.0)
        if G == 128:
            part = tl.dot(a_lo, w_lo, out_dtype=tl.int32)
            part = tl.dot(a_hi, w_hi, part, out_dtype=tl.int32)
            acc += part.to(tl.float32) * s_lo[None, :]
        else:
            s_hi = tl.load(s_ptr + offs_n.to(tl.int64) * stride_sn + (c * 128 + 64) // G, mask=offs_n < N, other=0.0)
            acc += tl.dot(a_lo, w_lo, out_dtype=tl.int32).to(tl.float32) * s_lo[None, :]
            acc += tl.dot(a_hi, w_hi, out_dtype=tl.int32).to(tl.float32) * s_hi[None, :]
    sa = tl.load(sa_ptr + offs_m, mask=offs_m < M, other=0.0)
    y = acc * sa[:, None]
    part_off, split_stride = _dense_parts(offs_m, offs_n, M, N)
    _store_tile(y, out_ptr, part_ptr, cnt_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om,
                tl.program_id(0), pid_k, N_SPLIT, part_off, split_stride, IS_SPLIT, HAS_BIAS)


@triton.jit
def dequant_kernel(
    w_ptr, s_ptr, z_ptr, gs_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
    FMT: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
):
    """One 128-column chunk of BN rows per program: ``out[n, k] = value(code) * scale``."""
    pid_n = tl.program_id(0)
    c = tl.program_id(1)
    NSUB: tl.constexpr = 8 // BITS
    SUB: tl.constexpr = 128 // NSUB
    CODE_MASK: tl.constexpr = (1 << BITS) - 1
    HALF: tl.constexpr = 1 << (BITS - 1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_j = tl.arange(0, SUB)
    nmask = offs_n[:, None] < N
    rows = offs_n[:, None].to(tl.int64)
    packed = tl.load(w_ptr + rows * stride_wn + c * SUB + offs_j[None, :], mask=nmask, other=0).to(tl.int32)
    gscale = 1.0
    if FMT == 2:
        gscale = tl.load(gs_ptr)
    # groups of 128 columns: the chunk is group c, so one scale (and zero point) a row, loaded
    # once, instead of one gather per element
    ROW_GROUP: tl.constexpr = G == 128
    if ROW_GROUP:
        s_row = tl.load(s_ptr + rows * stride_sn + c, mask=nmask, other=0)
        if FMT == 1:
            z_row = tl.load(z_ptr + rows * stride_sn + c, mask=nmask, other=0).to(tl.float32)
    for i in tl.static_range(NSUB):
        ks = c * 128 + i * SUB + offs_j
        code = (packed >> (BITS * i)) & CODE_MASK
        if ROW_GROUP:
            sv = s_row
            if FMT == 1:
                zv = z_row
        else:
            gidx = ks[None, :] // G
            sv = tl.load(s_ptr + rows * stride_sn + gidx, mask=nmask, other=0)
            if FMT == 1:
                zv = tl.load(z_ptr + rows * stride_sn + gidx, mask=nmask, other=0).to(tl.float32)
        if FMT == 2 or FMT == 3:
            val = _e2m1_value(code)
        else:
            val = code.to(tl.float32)
        if FMT == 0:
            val = val - HALF
        elif FMT == 1:
            val = val - zv
        if FMT == 2:
            sv = _e4m3_value(sv.to(tl.int32)) * gscale
        elif FMT == 3:
            sv = (sv.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        tl.store(out_ptr + rows * stride_on + ks[None, :], (val * sv).to(out_ptr.dtype.element_ty),
                 mask=nmask & (ks[None, :] < K))


# ------------------------------------------------------------------ int4 g128 small-M path
# The weight tile is read K-contiguous ([BN, 64] packed bytes per 128-column chunk: each
# row's 64 bytes are 4 x 16-byte loads) and its codes become 16-bit floats by OR-ing them
# into the mantissa of 128 (bf16) or 1024 (fp16): exact, no int->float conversion.


@triton.jit
def _store_tile_nm(
    acc, out_ptr, part_ptr, cnt_ptr, bias_ptr, offs_n, offs_m, M, N, stride_om,
    pid_tile, pid_k, n_split, IS_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """``_store_tile`` for a transposed fp32 tile ``acc [BN, BM]`` (out[m, n] = acc[n, m]).

    Kept as its own copy: delegating via ``tl.trans(acc)`` made the M = 64 swap kernel
    markedly slower (docs/kernels.md)."""
    omask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    tile_off = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    optrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    if IS_SPLIT:
        tl.store(part_ptr + pid_k * N * M + tile_off, acc, mask=omask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_tile, 1, sem="acq_rel")
        if arrived == n_split - 1:
            acc = tl.zeros_like(acc)
            for sp in range(0, n_split):
                acc += tl.load(part_ptr + sp * N * M + tile_off, mask=omask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
            tl.store(optrs, acc.to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(cnt_ptr + pid_tile, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
        tl.store(optrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def w4_swap_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, NCHUNK, CHUNKS_PER_SPLIT, N_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_om,
    ASYM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IS_SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, INTERP: tl.constexpr = False,
):
    """int4 g128 (sym/asym) weight-only GEMM with swapped operands: ``out.T [BN, BM] =
    deq(W) [BN, K] @ x.T [K, BM]``. The dequantized weight tile is the MMA's A operand
    (registers; N fills the 64-row MMA side), the few activation rows the B operand, so
    M = 1..64 wastes no weight traffic. Group scale (and zero point) per 128-column chunk:
    the chunk's fp32 partial is scaled once (post-scale). Grid (n tiles, K splits, m tiles).

    Dequantization: bf16 bits ``0x4300 | code`` = 128 + code, minus (128 + zero) with a
    packed 16-bit subtraction (``add.bf16x2``, two weights per instruction); exact (small
    integers). fp16 activations use ``0x6400 | code`` = 1024 + code instead."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_j = tl.arange(0, 64)
    nmask = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    x_cols = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm  # [1, BM]
    xmask_m = offs_m[None, :] < M
    s_rows = s_ptr + offs_n.to(tl.int64) * stride_sn
    z_rows = z_ptr + offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    c_lo = pid_k * CHUNKS_PER_SPLIT
    c_hi = tl.minimum(c_lo + CHUNKS_PER_SPLIT, NCHUNK)
    for c in range(c_lo, c_hi):
        packed = tl.load(w_rows + (c * 64 + offs_j)[None, :], mask=nmask[:, None], other=0)
        k_lo = c * 128 + offs_j
        xt_lo = tl.load(x_cols + k_lo[:, None], mask=xmask_m & (k_lo[:, None] < K), other=0.0)
        xt_hi = tl.load(x_cols + (k_lo + 64)[:, None], mask=xmask_m & (k_lo[:, None] + 64 < K), other=0.0)
        p16 = packed.to(tl.int16)
        if x_ptr.dtype.element_ty == tl.float16:
            lo = ((p16 & 15) | 0x6400).to(tl.float16, bitcast=True)
            hi = ((p16 >> 4) | 0x6400).to(tl.float16, bitcast=True)
            base = 1024.0
        else:
            lo = ((p16 & 15) | 0x4300).to(tl.bfloat16, bitcast=True)
            hi = ((p16 >> 4) | 0x4300).to(tl.bfloat16, bitcast=True)
            base = 128.0
        if ASYM:
            zb = tl.load(z_rows + c, mask=nmask, other=0).to(tl.float32)[:, None] + base
        else:
            zb = base + 8.0
        if INTERP:  # the interpreter's bf16 arithmetic is wrong; same exact math in fp32
            lo = lo.to(tl.float32) - zb
            hi = hi.to(tl.float32) - zb
        else:
            if ASYM:
                zb = zb.to(lo.dtype)
            lo = lo - zb
            hi = hi - zb
        part = tl.dot(lo.to(x_ptr.dtype.element_ty), xt_lo)
        part = tl.dot(hi.to(x_ptr.dtype.element_ty), xt_hi, part)
        s = tl.load(s_rows + c, mask=nmask, other=0.0)
        acc += part * s[:, None]
    _store_tile_nm(acc, out_ptr, part_ptr, cnt_ptr, bias_ptr, offs_n, offs_m, M, N, stride_om,
                   pid_n + pid_m * tl.num_programs(0), pid_k, N_SPLIT, IS_SPLIT, HAS_BIAS)
