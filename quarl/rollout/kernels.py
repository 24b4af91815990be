"""Triton kernels of the rollout engine: paged attention (decode, prefill/extend) and sampling.

KV-cache layout (per layer, K and V alike): ``[num_blocks, block_size, Hkv, D]``.
Token ``t`` of a sequence with block table ``bt`` lives in block ``bt[t // block_size]``
at row ``t % block_size``; one (token, kv head) row of ``D`` values is contiguous,
so a tile of ``BLOCK_N`` tokens is gathered as ``BLOCK_N`` rows of ``D`` elements.

Attention is computed with an online softmax in base 2 (``exp2`` of scores scaled by
``scale * log2(e)``), accumulating in float32. GQA: the decode kernel handles all
``Hq / Hkv`` query heads of one KV head in one program, so each K/V tile is read once
per KV head; queries are padded to 16 rows for ``tl.dot``. Decode splits the context
into ``NUM_SPLITS`` chunks (flash-decoding) whose length is read from device memory,
so a CUDA graph captured once balances the splits at every context length.

fp8 KV cache (``KV_FP8``, a constexpr: the model-dtype path compiles as before): the
caches hold e4m3 codes, read as int32 words of four, and a float32 power-of-two scale per
(token, kv head) in ``[num_blocks, block_size, Hkv]``; each tile's codes are converted
exactly to the model dtype in registers and the scales multiply the scores (K) and the
probabilities (V), which gives the floats of :func:`quarl.quant.kv.dequantize_kv`'s rows.

The sampling kernel streams a row of logits once: it computes the log-sum-exp of
``logits / T`` online and the Gumbel-max choice with counter-based noise (see
:mod:`quarl.rollout.sampler` for the hash), so no full-vocabulary sort is done.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from quarl.quant.kernels.device import pdl
from quarl.quant.kernels.triton_kernels import HW_E4M3, e4m3_value, wait_ahead
from quarl.rollout import fp8_decode

LOG2E = 1.4426950408889634


@triton.jit
def _e4m3x4_to_bf16(w):
    """The 4 e4m3fn codes of each int32 word as bf16 (bytes 0..3), exact, in integer ops and
    one bf16x2 multiply per pair: each byte's sign and 7 low bits are moved into a bf16's
    sign, exponent and mantissa fields (the value / 2^120, subnormal for subnormal codes),
    then multiplied by 2^120. The hardware's e4m3 -> f16 -> bf16 conversions run at the
    conversion units' quarter rate, which bound the fp8-cache decode kernel."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 t0, t1, u0, u1, k;
        prmt.b32 t0, $4, 0, 0x1404;
        prmt.b32 t1, $4, 0, 0x3424;
        shr.b32 u0, t0, 4;
        shr.b32 u1, t1, 4;
        and.b32 t0, t0, 0x80008000;
        and.b32 t1, t1, 0x80008000;
        and.b32 u0, u0, 0x07F007F0;
        and.b32 u1, u1, 0x07F007F0;
        or.b32 t0, t0, u0;
        or.b32 t1, t1, u1;
        mov.b32 k, 0x7B807B80;
        mul.rn.bf16x2 t0, t0, k;
        mul.rn.bf16x2 t1, t1, k;
        mov.b32 {$0, $1}, t0;
        mov.b32 {$2, $3}, t1;
        }
        """,
        "=h,=h,=h,=h,r", [w], dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=1,
    )


@triton.jit
def _kv_rows(cache_ptr, scale_ptr, row, srow, offs_d, kv_mask, n_mask, dt: tl.constexpr, KV_FP8: tl.constexpr,
             HEAD_DIM: tl.constexpr, BF16X2: tl.constexpr):
    """``[BLOCK_N, BLOCK_D]`` K or V rows at element offsets ``row`` in the model dtype ``dt``,
    and with KV_FP8 their ``[BLOCK_N]`` float32 scales.

    KV_FP8: ``cache_ptr`` points at int32 words of 4 e4m3 codes (``row`` still counts codes),
    converted exactly to ``dt``, and ``scale_ptr`` at each row's power-of-two scale at offsets
    ``srow``; the value is code x scale
    (:func:`quarl.quant.kv.dequantize_kv`), and the caller multiplies the scale into the
    scores (K) or the probabilities (V): for a power of two that gives the same floats as
    the dot products over the scaled rows. Otherwise a plain load (the scales are unused)."""
    if KV_FP8:
        # The codes are read as int32 words (4 codes each, 16-byte loads) and unpacked in
        # registers into 4 planes (plane j: codes 4w + j), which are put back in order: read
        # as bytes, the dot's operand would be gathered from shared memory one byte at a time.
        nw: tl.constexpr = offs_d.shape[0] // 4
        offs_w = tl.arange(0, nw)
        w = tl.load(cache_ptr + row[:, None] // 4 + offs_w[None, :], mask=n_mask[:,
                                                                                 None] & (offs_w < HEAD_DIM // 4)[None,
                                                                                                                  :],
                    other=0)
        if HW_E4M3 and BF16X2 and dt == tl.bfloat16:  # (mul.bf16x2 needs sm90+)
            p0, p1, p2, p3 = _e4m3x4_to_bf16(w)
        else:
            p0 = e4m3_value(w & 0xFF).to(dt)
            p1 = e4m3_value((w >> 8) & 0xFF).to(dt)
            p2 = e4m3_value((w >> 16) & 0xFF).to(dt)
            p3 = e4m3_value((w >> 24) & 0xFF).to(dt)
        x = tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), [row.shape[0], offs_d.shape[0]])
        return x, tl.load(scale_ptr + srow, mask=n_mask, other=1.0)
    else:
        return tl.load(cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0), 1.0


@triton.jit
def _scores(q, k, k_s, qk_scale, PRECISION: tl.constexpr, KV_FP8: tl.constexpr):
    """``q k^T`` times ``qk_scale`` (and, fp8, each key's scale: see :func:`_kv_rows`)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if KV_FP8:
        s = s * k_s[None, :]
    return s * qk_scale


@triton.jit
def _probs_for_v(p, v_s, dt: tl.constexpr, KV_FP8: tl.constexpr):
    """The probabilities ``p`` as the operand of the dot with V rows (fp8: times each value
    row's scale first)."""
    if KV_FP8:
        out = (p * v_s[None, :]).to(dt)
    else:
        out = p.to(dt)
    return out


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, context_lens_ptr, split_len_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, qk_scale,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_sb, stride_st, stride_btb, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr, BF16X2: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_ahead(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    split_len = tl.load(split_len_ptr)
    start = split * split_len
    end = tl.minimum(ctx, start + split_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )
    m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + b * stride_btb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        page = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        row = page * stride_kb + (offs_n % PAGE) * stride_kt + kvh * stride_kh
        srow = page * stride_sb + (offs_n % PAGE) * stride_st + kvh  # fp8: the rows' scales
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k, k_s = _kv_rows(k_cache_ptr, k_scale_ptr, row, srow, offs_d, kv_mask, n_mask, q.dtype, KV_FP8, HEAD_DIM,
                          BF16X2)
        s = _scores(q, k, k_s, qk_scale, PRECISION, KV_FP8)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        # V after the scores: its unpacked tile is not live next to K's (fp8: registers)
        v, v_s = _kv_rows(v_cache_ptr, v_scale_ptr, row, srow, offs_d, kv_mask, n_mask, q.dtype, KV_FP8, HEAD_DIM,
                          BF16X2)
        acc = acc * alpha[:, None] + tl.dot(_probs_for_v(p, v_s, v.dtype, KV_FP8), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=o_mask,
        )
    else:
        # part_out [B, Hq, NUM_SPLITS, HEAD_DIM], part_lse [B, Hq, NUM_SPLITS], contiguous
        hq = tl.num_programs(1) * GROUP
        base = (b * hq + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], out, mask=o_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + base, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_ahead(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    hq = tl.num_programs(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    base = (b * hq + h) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    parts = tl.load(
        part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, cu_seqlens_q_ptr, kv_lens_ptr,
    out_ptr, qk_scale,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_sb, stride_st, stride_btb, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr, BF16X2: tl.constexpr,
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + seq)
    cached = kv_len - q_len  # tokens already in the cache before this step's
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + offs_m)[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :], other=0.0,
    )
    # Keys up to the last query of this tile (causal); none for a tile past the end.
    hi = tl.minimum(kv_len, cached + (m_block + 1) * BLOCK_M)
    hi = tl.where(m_block * BLOCK_M < q_len, hi, 0)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq * stride_btb
    q_pos = cached + offs_m
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_len
        page = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        row = page * stride_kb + (offs_n % PAGE) * stride_kt + kvh * stride_kh
        srow = page * stride_sb + (offs_n % PAGE) * stride_st + kvh
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k, k_s = _kv_rows(k_cache_ptr, k_scale_ptr, row, srow, offs_d, kv_mask, n_mask, q.dtype, KV_FP8, HEAD_DIM,
                          BF16X2)
        v, v_s = _kv_rows(v_cache_ptr, v_scale_ptr, row, srow, offs_d, kv_mask, n_mask, q.dtype, KV_FP8, HEAD_DIM,
                          BF16X2)
        s = _scores(q, k, k_s, qk_scale, PRECISION, KV_FP8)
        valid = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None] + tl.dot(_probs_for_v(p, v_s, v.dtype, KV_FP8), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(
        out_ptr + (q_start + offs_m)[:, None].to(tl.int64) * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :],
    )


@functools.lru_cache(maxsize=8)
def _has_bf16x2_mul(device: torch.device) -> bool:
    """The GPU has ``mul.bf16x2`` (sm90+): the fp8 cache's codes then unpack in integer ops."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _kv_args(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: tuple) -> tuple:
    """``(k, v, k_scale, v_scale, stride_sb, stride_st, fp8)`` kernel arguments: an fp8 cache
    as bytes with its ``[blocks, block_size, Hkv]`` scales, else the caches themselves (the
    scale pointers then unused)."""
    k_scale, v_scale = kv_scales
    if k_scale is None:
        return k_cache, v_cache, k_cache, v_cache, 0, 0, False
    if k_cache.dtype != torch.float8_e4m3fn or k_scale.stride() != v_scale.stride() or k_scale.stride(2) != 1:
        raise ValueError("an fp8 KV cache takes float8_e4m3fn codes and scales [blocks, block_size, Hkv] "
                         "with unit head stride (quarl.rollout.kv_cache.KVCache)")
    if k_cache.shape[-1] % 4 or k_cache.stride(-1) != 1 or any(st % 4 for st in k_cache.stride()[:-1]):
        raise ValueError(f"an fp8 KV cache is read as int32 words: head_dim must be a multiple of 4 with contiguous "
                         f"rows (got shape {tuple(k_cache.shape)}, strides {k_cache.stride()})")
    # int32 words of 4 codes each; the kernels' offsets stay in bytes (divided by 4 there)
    return (k_cache.view(torch.uint8).view(torch.int32), v_cache.view(torch.uint8).view(torch.int32), k_scale, v_scale,
            k_scale.stride(0), k_scale.stride(1), True)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    split_len: torch.Tensor,
    out: torch.Tensor,
    part_out: torch.Tensor | None,
    part_lse: torch.Tensor | None,
    num_splits: int,
    scale: float,
    block_n: int = 64,
    num_warps: int = 4,
    kv_scales: tuple = (None, None),
    kernel: str = "triton",
) -> torch.Tensor:
    """One query token per sequence over its paged context.

    q ``[B, Hq, D]``; caches ``[num_blocks, block_size, Hkv, D]``; block_tables
    ``[B, max_blocks]`` int32; context_lens ``[B]`` int32 (tokens to attend, the new
    one included, already in the cache); split_len ``[1]`` int32 tokens per split
    (a multiple of 64); out ``[B, Hq, D]``; part_out ``[B, Hq, S, D]`` and part_lse
    ``[B, Hq, S]`` float32 scratch when ``num_splits > 1``. ``kv_scales``: an fp8 cache's
    ``(k_scale, v_scale)``, each ``[num_blocks, block_size, Hkv]`` float32 (caches then
    float8_e4m3fn); ``(None, None)`` for a cache in the model dtype.
    ``kernel="cuda"``: an fp8 cache's split pass runs :mod:`quarl.rollout.fp8_decode`'s kernel
    with ``block_n // 16`` chunks per tile and ``num_warps`` warps (where
    :func:`~quarl.rollout.fp8_decode.supported`; else the Triton kernel).
    """
    b, hq, d = q.shape
    block_d = max(16, triton.next_power_of_2(d))
    if num_splits > 1:
        assert part_out is not None and part_lse is not None
    else:
        part_out = part_lse = out
    if kernel not in ("triton", "cuda"):
        raise ValueError(f"decode kernel must be 'triton' or 'cuda', got {kernel!r}")
    if kernel == "cuda" and fp8_decode.supported(q, k_cache, kv_scales):
        cfg = fp8_decode.Fp8DecodeConfig(warps=num_warps, stages=2, chunks=max(1, block_n // 16))
        fp8_decode.fp8_decode_attention(q, k_cache, v_cache, kv_scales, block_tables, context_lens, split_len, out,
                                        part_out, part_lse, num_splits, scale * LOG2E, cfg)
    else:
        _paged_decode_split(q, k_cache, v_cache, kv_scales, block_tables, context_lens, split_len, out, part_out,
                            part_lse, num_splits, scale, block_n, num_warps)
    if num_splits > 1:
        _decode_reduce_kernel[(b, hq)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=num_splits, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            num_warps=4, **pdl(q.device),
        )
    return out


def _paged_decode_split(q, k_cache, v_cache, kv_scales, block_tables, context_lens, split_len, out, part_out, part_lse,
                        num_splits: int, scale: float, block_n: int, num_warps: int) -> None:
    b, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    group = hq // hkv
    block_d = max(16, triton.next_power_of_2(d))
    k_arg, v_arg, ks, vs, stride_sb, stride_st, fp8 = _kv_args(k_cache, v_cache, kv_scales)
    _paged_decode_kernel[(b, hkv, num_splits)](
        q, k_arg, v_arg, ks, vs, block_tables, context_lens, split_len, out, part_out, part_lse, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_sb, stride_st,
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, BLOCK_D=block_d,
        PAGE=page, BLOCK_N=block_n, NUM_SPLITS=num_splits, PRECISION=_precision(q.dtype), KV_FP8=fp8,
        BF16X2=_has_bf16x2_mul(q.device),
        num_warps=num_warps, num_stages=2, **pdl(q.device),
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    out: torch.Tensor | None = None,
    kv_scales: tuple = (None, None),
) -> torch.Tensor:
    """Causal attention of new tokens over their sequences' paged context (prefill/extend).

    q ``[N, Hq, D]`` packs the new tokens of all sequences (``cu_seqlens_q [S+1]``
    int32); their K/V are already in the cache. ``kv_lens [S]`` int32 counts each
    sequence's cached + new tokens; new token ``i`` sits at position
    ``kv_len - q_len + i`` and sees keys ``0 .. kv_len - q_len + i``. ``kv_scales`` as in
    :func:`paged_decode_attention`.
    """
    n, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(q)
    num_seqs = kv_lens.shape[0]
    block_m = 64 if max_seqlen_q > 32 else 16
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, hq)
    k_arg, v_arg, ks, vs, stride_sb, stride_st, fp8 = _kv_args(k_cache, v_cache, kv_scales)
    _paged_prefill_kernel[grid](
        q, k_arg, v_arg, ks, vs, block_tables, cu_seqlens_q, kv_lens, out, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_sb, stride_st,
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), PAGE=page,
        BLOCK_M=block_m, BLOCK_N=64, PRECISION=_precision(q.dtype), KV_FP8=fp8, BF16X2=_has_bf16x2_mul(q.device),
        num_warps=4, num_stages=2,
    )
    return out


@triton.jit
def _hash32(x):
    # lowbias32 (C. Wellons) on int64 values in [0, 2^32); the masks keep uint32 wrap-around.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    return x


@triton.jit
def _sample_kernel(
    logits_ptr, stride_l, inv_temp_ptr, row_seed_ptr, noise_ptr, token_ptr, logprob_ptr, lse_ptr, V,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    inv_t = tl.load(inv_temp_ptr + row)
    seed = tl.load(row_seed_ptr + row)
    noise = tl.load(noise_ptr + row)
    m_run = tl.zeros([], dtype=tl.float32) - float("inf")
    s_run = tl.zeros([], dtype=tl.float32)
    best_key = tl.zeros([], dtype=tl.float32) - float("inf")
    best_x = tl.zeros([], dtype=tl.float32)
    best_idx = tl.zeros([], dtype=tl.int32)
    offs = tl.arange(0, BLOCK_V)
    base = logits_ptr + row.to(tl.int64) * stride_l
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m_run, tl.max(x, 0))
        s_run = s_run * tl.exp(m_run - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m_run = m_new
        h = _hash32((seed + cols.to(tl.int64) * 0x85EBCA6B) & 0xFFFFFFFF)
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        gumbel = -tl.log(-tl.log(u))
        key = tl.where(mask, x + gumbel * noise, float("-inf"))
        k_max = tl.max(key, 0)
        k_idx = tl.argmax(key, 0)
        x_at = tl.sum(tl.where(offs == k_idx, x, 0.0), 0)
        better = k_max > best_key
        best_x = tl.where(better, x_at, best_x)
        best_idx = tl.where(better, v0 + k_idx, best_idx)
        best_key = tl.where(better, k_max, best_key)
    lse = m_run + tl.log(s_run)
    tl.store(token_ptr + row, best_idx.to(tl.int64))
    tl.store(logprob_ptr + row, best_x - lse)
    tl.store(lse_ptr + row, lse)


def gumbel_sample(
    logits: torch.Tensor,
    inv_temp: torch.Tensor,
    row_seed: torch.Tensor,
    noise: torch.Tensor,
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Fill tokens ``[B]`` int64, logprobs ``[B]`` and lse ``[B]`` float32 from logits ``[B, V]``.

    Row ``i`` takes ``argmax(logits * inv_temp + noise * gumbel(row_seed, token))``
    and its log-prob under ``softmax(logits * inv_temp)``.
    """
    b, v = logits.shape
    if b == 0:
        return
    _sample_kernel[(b,)](
        logits, logits.stride(0), inv_temp, row_seed, noise, tokens, logprobs, lse, v,
        BLOCK_V=min(4096, triton.next_power_of_2(v)), num_warps=8,
    )
