"""Batch-invariant causal attention over a paged KV cache (exact mode): one kernel for a token
decoded from the engine's cache, the engine's prefill, and the learner's packed sequences.

A query row is one (token, query head). Its output depends only on its q, its sequence's
keys and values up to its position, and the shapes below, bit for bit: not on how many
tokens, sequences or heads share the launch, nor on where the token sits among them.

How:

* one kernel for all callers (:func:`invariant_paged_attention`). Its program owns the
  query rows of up to ``TOK = BLOCK_R // GROUP`` consecutive new tokens of one sequence,
  all ``GROUP`` query heads of one KV head each (GQA), in a ``[BLOCK_R, BLOCK_D]`` tile
  padded with rows of zeros. A decode step is the case of one new token per sequence
  (``cu_seqlens_q = 0, 1, .., B``); the learner's packed sequences are written into a
  paged cache of the engine's page size first (:func:`invariant_varlen_attention`), so
  engine and learner run the very same compiled kernel;
* keys are cut into fixed splits of ``SPLIT`` keys from position 0 (a split-KV cut by key
  position alone, never by the batch); within a split they are visited in fixed ``BLOCK_N``
  blocks with a base-2 online softmax started from zero: per block ``m' = max(m, rowmax(s))``,
  ``acc = fma(acc, 2^(m - m'), p @ V)``, ``l = fma(l, 2^(m - m'), rowsum(p))``; the splits'
  states are then merged in order, each rescaled to the larger maximum (:func:`_merge`). A
  decode step of fewer (sequence, KV head) pairs than SMs runs one program per split and a
  second kernel merging them (:func:`inv_attention_merge_kernel`: the parallelism
  flash-decoding gives a long context); prefill, the learner and larger decode batches merge
  inside each program: the same operations, with explicit FMAs so that both kernels round
  alike. The tile shape ``(BLOCK_R, BLOCK_N, BLOCK_D)``, the
  split and ``num_warps`` come from :func:`attention_config`, a function of the head
  dimension only;
* a block (or a split) holding none of a row's visible keys (a prefill tile's later tokens
  see more keys than its earlier ones) leaves that row's ``m``, ``l`` and ``acc`` untouched
  (a select, not a multiplication by ``2^0``), so a row's arithmetic is the same sequence of
  operations whether its tile stops at its own position (decode) or runs further;
  invisible keys inside a block get a score of ``-inf`` (probability 0);
* fp8 KV cache: the e4m3 codes are converted exactly to the model dtype, the per-(token,
  kv head) power-of-two scales multiply the scores (K) and the probabilities (V), the
  formulation of :mod:`quarl.rollout.kernels`; the learner's K / V go through
  :func:`quarl.quant.kv.quantize_kv` into codes and scales as the engine's cache writes do.

The learner's backward is not this kernel's business (:func:`invariant_varlen_attention`
computes values; a caller that needs gradients recomputes them with any attention).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from quarl.quant.kernels.act_quant import interpreting, next_pow2
from quarl.quant.kernels.invariant import _bf16_rne, _dot16
from quarl.quant.kernels.triton_kernels import e4m3_value
from quarl.quant.kv import quantize_kv

LOG2E = 1.4426950408889634


class AttentionConfig(NamedTuple):
    """The fixed tile of the invariant attention kernel: a function of the head dim only."""

    block_r: int  # query rows per program: TOK tokens x GROUP heads, padded
    block_n: int  # keys per block
    block_d: int
    num_warps: int = 4
    num_stages: int = 2
    split: int = 512  # keys per split (a multiple of block_n): each split's softmax state from zero


def attention_config(head_dim: int, group: int, interpret: bool = False) -> AttentionConfig:
    """Tile for ``head_dim`` and a GQA ``group`` (query heads per KV head). Deliberately has no
    argument for the number of tokens or sequences; ``group`` only has to fit in BLOCK_R."""
    block_d = max(16, next_pow2(head_dim))
    cfg = AttentionConfig(64, 16, block_d, 4, 1, 32) if interpret else AttentionConfig(64, 64, block_d, 4, 2, 512)
    if group > cfg.block_r:
        raise ValueError(f"{group} query heads per KV head: the invariant attention takes at most {cfg.block_r}")
    return cfg


@triton.jit
def _kv_tile(cache_ptr, scale_ptr, row, srow, offs_d, n_ok, HEAD_DIM: tl.constexpr, dt: tl.constexpr,
             KV_FP8: tl.constexpr, INTERP_BF16: tl.constexpr):
    """``[BLOCK_N, BLOCK_D]`` K or V rows (model dtype, fp32 under INTERP_BF16) and with KV_FP8
    their ``[BLOCK_N]`` scales: e4m3 codes (bytes) converted exactly; keys past ``n_ok`` 0."""
    mask = n_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    raw = tl.load(cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0)
    if KV_FP8:
        x = e4m3_value(raw)  # exact in fp32 and in any 16-bit model dtype
        s = tl.load(scale_ptr + srow, mask=n_ok, other=1.0)
    else:
        x = raw
        s = 1.0
    if INTERP_BF16:
        return x.to(tl.float32), s
    else:
        return x.to(dt), s


@triton.jit
def _p_operand(p, v_s, dt: tl.constexpr, KV_FP8: tl.constexpr, INTERP_BF16: tl.constexpr):
    """The probabilities as the P @ V operand (fp8: times each value row's scale first),
    rounded to the model dtype."""
    if KV_FP8:
        p = p * v_s[None, :]
    if INTERP_BF16:
        return _bf16_rne(p)
    else:
        return p.to(dt)


@triton.jit
def _row_setup(cu_q_ptr, kv_len_ptr, s, qb, TOK: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows of program (sequence ``s``, token block ``qb``): ``(q_row, head, row_ok, lim, hi)``:
    each row's packed query index and head within the KV head's group, whether it is real,
    how many keys it sees (1 for padding rows: never an empty softmax) and the keys the
    program visits."""
    q0 = tl.load(cu_q_ptr + s)
    qlen = tl.load(cu_q_ptr + s + 1) - q0
    kv_len = tl.load(kv_len_ptr + s)
    first = kv_len - qlen  # position of the sequence's first new token
    r = tl.arange(0, BLOCK_R)
    qi = qb * TOK + r // GROUP
    row_ok = (r < TOK * GROUP) & (qi < qlen)
    lim = tl.where(row_ok, first + qi + 1, 1)
    hi = tl.where(qb * TOK < qlen, tl.minimum(kv_len, first + qb * TOK + TOK), 0)
    return q0 + qi, r % GROUP, row_ok, lim, hi


# (token counts, split counts and the block table's width change with every batch: not
# specialized, so that a new one never compiles another variant in the middle of a rollout)
@triton.jit(do_not_specialize=["T", "NSPLIT", "stride_bt"])
def inv_attention_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, cu_q_ptr, kv_len_ptr, out_ptr, ml_ptr, qk_scale, T, HQ, NSPLIT,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_sb, stride_st, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PAGE: tl.constexpr, KV_FP8: tl.constexpr, PRECISION: tl.constexpr,
    INTERP_BF16: tl.constexpr, PARTIAL: tl.constexpr,
):
    """Program (sequence, token block, kv head): causal attention of its query rows over the
    sequence's paged keys (see the module doc). PARTIAL (decode, one token per sequence): the
    program (sequence, split, kv head) computes its split's state only, into ``out_ptr``
    (``acc [T, Hq, NSPLIT, BLOCK_D]``) and ``ml_ptr`` (``m, l [2, T, Hq, NSPLIT]``), for
    :func:`inv_attention_merge_kernel`."""
    s = tl.program_id(0)
    kvh = tl.program_id(2)
    TOK: tl.constexpr = BLOCK_R // GROUP
    if PARTIAL:
        qb = 0
    else:
        qb = tl.program_id(1)
    q_row, g, row_ok, lim, hi = _row_setup(cu_q_ptr, kv_len_ptr, s, qb, TOK, GROUP, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    heads = kvh * GROUP + g
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_row[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)
    dt: tl.constexpr = q_ptr.dtype.element_ty
    bt_row = bt_ptr + s.to(tl.int64) * stride_bt
    m_t = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_t = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    if PARTIAL:
        lo = tl.program_id(1) * SPLIT
        end = tl.minimum(lo + SPLIT, hi)
    else:
        lo = 0
        end = hi
    for s0 in range(lo, end, SPLIT):  # splits of SPLIT keys from position 0, each from zero
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for n0 in range(s0, tl.minimum(s0 + SPLIT, hi), BLOCK_N):  # fixed blocks
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < hi
            page = tl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
            row = page * stride_kb + (offs_n % PAGE) * stride_kt + kvh * stride_kh
            srow = page * stride_sb + (offs_n % PAGE) * stride_st + kvh
            k, k_s = _kv_tile(k_ptr, ks_ptr, row, srow, offs_d, n_ok, HEAD_DIM, dt, KV_FP8, INTERP_BF16)
            sc = _dot16(q, tl.trans(k), tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32), PRECISION, INTERP_BF16)
            if KV_FP8:
                sc = sc * k_s[None, :]
            sc = tl.where(offs_n[None, :] < lim[:, None], sc * qk_scale, float("-inf"))
            live = n0 < lim  # the block holds some of the row's keys
            m_new = tl.where(live, tl.maximum(m_i, tl.max(sc, 1)), m_i)
            p = tl.exp2(sc - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            v, v_s = _kv_tile(v_ptr, vs_ptr, row, srow, offs_d, n_ok, HEAD_DIM, dt, KV_FP8, INTERP_BF16)
            pv = _dot16(_p_operand(p, v_s, dt, KV_FP8, INTERP_BF16), v, tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32),
                        PRECISION, INTERP_BF16)
            acc = tl.where(live[:, None], tl.fma(acc, alpha[:, None], pv), acc)
            l_i = tl.where(live, tl.fma(l_i, alpha, tl.sum(p, 1)), l_i)
            m_i = m_new
        if PARTIAL:
            at = _split_at(q_row, heads, tl.program_id(1), HQ, NSPLIT)
            tl.store(out_ptr + at[:, None] * BLOCK_D + offs_d[None, :], acc, mask=io_mask)
            tl.store(ml_ptr + at, m_i, mask=row_ok)
            tl.store(ml_ptr + T * HQ * NSPLIT + at, l_i, mask=row_ok)
        else:
            m_t, l_t, acc_t = _merge(m_t, l_t, acc_t, m_i, l_i, acc, s0 == 0, s0 < lim)
    if not PARTIAL:
        out = acc_t / tl.where(l_t > 0, l_t, 1.0)[:, None]
        tl.store(out_ptr + q_row[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _merge(m_t, l_t, acc_t, m_i, l_i, acc, first, live):
    """The running state of a row's splits ``(m_t, l_t, acc_t)`` with the next split's: the
    first split as it is, a split holding none of the row's keys (``live`` false) skipped, else
    both rescaled to the larger maximum; explicit FMAs, so that this kernel and the merge
    kernel round alike."""
    m_n = tl.where(live, tl.maximum(m_t, m_i), m_t)
    a = tl.exp2(m_t - m_n)
    b = tl.exp2(m_i - m_n)
    acc_n = tl.where(live[:, None], tl.fma(acc_t, a[:, None], acc * b[:, None]), acc_t)
    l_n = tl.where(live, tl.fma(l_t, a, l_i * b), l_t)
    return tl.where(first, m_i, m_n), tl.where(first, l_i, l_n), tl.where(first, acc, acc_n)


@triton.jit
def _split_at(q_row, heads, j, HQ, NSPLIT):
    """Index of (token row, head, split ``j``) in the partials ``[T, Hq, NSPLIT]``."""
    return (q_row.to(tl.int64) * HQ + heads) * NSPLIT + j


@triton.jit(do_not_specialize=["T", "NSPLIT"])
def inv_attention_merge_kernel(acc_ptr, ml_ptr, kv_len_ptr, out_ptr, T, HQ, NSPLIT, stride_ot, stride_oh,
                               GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                               SPLIT: tl.constexpr, BLOCK_G: tl.constexpr):
    """Decode: the splits of token ``t`` (one per sequence), kv head ``h`` merged in order, as
    :func:`inv_attention_kernel` merges them in one program (:func:`_merge`), then normalised."""
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = kvh * GROUP + g
    rows = tl.zeros([BLOCK_G], dtype=tl.int32) + t
    offs_d = tl.arange(0, BLOCK_D)
    io_mask = g_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    lim = tl.zeros([BLOCK_G], dtype=tl.int32) + tl.load(kv_len_ptr + t)  # (the decoded token sees every key)
    m_t = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_t = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    n_live = tl.cdiv(tl.load(kv_len_ptr + t), SPLIT)
    for j in range(0, n_live):
        at = _split_at(rows, heads, j, HQ, NSPLIT)
        acc = tl.load(acc_ptr + at[:, None] * BLOCK_D + offs_d[None, :], mask=io_mask, other=0.0)
        m_i = tl.load(ml_ptr + at, mask=g_ok, other=0.0)
        l_i = tl.load(ml_ptr + T * HQ * NSPLIT + at, mask=g_ok, other=0.0)
        m_t, l_t, acc_t = _merge(m_t, l_t, acc_t, m_i, l_i, acc, j == 0, j * SPLIT < lim)
    out = acc_t / tl.where(l_t > 0, l_t, 1.0)[:, None]
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _kv_operands(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: tuple) -> tuple:
    """``(k, v, k_scale, v_scale, stride_sb, stride_st, fp8)``: an fp8 cache as bytes with its
    ``[blocks, page, Hkv]`` scales (unit head stride), else the caches themselves."""
    k_scale, v_scale = kv_scales
    if k_scale is None:
        return k_cache, v_cache, k_cache, v_cache, 0, 0, False
    if k_cache.dtype != torch.float8_e4m3fn or v_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"scales given with a {k_cache.dtype} cache: an fp8 cache holds float8_e4m3fn codes")
    if k_scale.stride() != v_scale.stride() or k_scale.stride(2) != 1:
        raise ValueError("fp8 KV scales must be [blocks, page, Hkv] with unit head stride, K and V alike")
    return (k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale, v_scale, k_scale.stride(0),
            k_scale.stride(1), True)


def invariant_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, max_seqlen_q: int, scale: float,
    kv_scales: tuple = (None, None), out: torch.Tensor | None = None, split_programs: bool | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over their sequences' paged context, batch-invariant.

    q ``[N, Hq, D]`` packs the new tokens of S sequences (``cu_seqlens_q [S+1]`` int32);
    their K/V are already in ``k_cache`` / ``v_cache [blocks, page, Hkv, D]`` at the slots
    ``block_tables [S, max_blocks]`` (int32) gives. ``kv_lens [S]`` int32 counts each
    sequence's cached + new tokens; new token ``i`` sits at position ``kv_len - q_len + i``
    and sees keys ``0 .. kv_len - q_len + i``. Decode: one new token per sequence.
    ``kv_scales``: ``(k_scale, v_scale)`` ``[blocks, page, Hkv]`` fp32 of an fp8 cache.
    The arguments of :func:`quarl.rollout.kernels.paged_prefill_attention`.
    ``split_programs`` (decode): one program per key split and the merge kernel, or each
    program merging its splits in turn; the same bits either way (module doc), so the choice
    may follow the batch: None takes split programs where the unsplit grid (sequences x KV
    heads) would leave SMs idle (:func:`split_decode`)."""
    n, hq, d = q.shape
    _, page, hkv, dk = k_cache.shape
    if dk != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} against a cache of {hkv} KV heads of {dk}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("q and the caches need unit stride along the head dim (K and V caches alike)")
    group = hq // hkv
    interp = interpreting(q)
    cfg = attention_config(d, group, interp)
    if out is None:
        # the interpreter's float -> bf16 store truncates: there the kernel writes fp32 and
        # torch rounds (to nearest even, as the GPU's store conversion does)
        out = torch.empty(q.shape, dtype=torch.float32 if interp else q.dtype, device=q.device)
    s = kv_lens.shape[0]
    tok = cfg.block_r // group
    if n and s:
        k_arg, v_arg, ks, vs, stride_sb, stride_st, fp8 = _kv_operands(k_cache, v_cache, kv_scales)
        # decode (one new token per sequence) of few sequences: one program per split, then the
        # ordered merge (the same bits as the in-program merge of the other path)
        decode = max_seqlen_q == 1 and n == s
        partial = decode and (split_decode(s * hkv, q.device) if split_programs is None else split_programs)
        # splits of the longest context the table can hold (a CUDA graph's fixed grid; programs
        # past a sequence's end exit at once); the interpreter reads the longest one instead
        longest = int(kv_lens.max()) if interp else block_tables.shape[1] * page
        nsplit = max(1, triton.cdiv(longest, cfg.split))
        if partial:
            dest = torch.empty(n, hq, nsplit, cfg.block_d, dtype=torch.float32, device=q.device)
            ml = torch.empty(2, n, hq, nsplit, dtype=torch.float32, device=q.device)
            grid = (s, nsplit, hkv)
        else:
            dest, ml, grid = out, out, (s, triton.cdiv(max_seqlen_q, tok), hkv)
        inv_attention_kernel[grid](
            q, k_arg, v_arg, ks, vs, block_tables, cu_seqlens_q, kv_lens, dest, ml, scale * LOG2E, n, hq, nsplit,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_sb, stride_st,
            block_tables.stride(0), out.stride(0), out.stride(1),
            GROUP=group, HEAD_DIM=d, BLOCK_D=cfg.block_d, BLOCK_R=cfg.block_r, BLOCK_N=cfg.block_n, SPLIT=cfg.split,
            PAGE=page, KV_FP8=fp8, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            INTERP_BF16=interp and q.dtype == torch.bfloat16, PARTIAL=partial, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        if partial:
            inv_attention_merge_kernel[(s, hkv)](
                dest, ml, kv_lens, out, n, hq, nsplit, out.stride(0), out.stride(1),
                GROUP=group, HEAD_DIM=d, BLOCK_D=cfg.block_d, SPLIT=cfg.split, BLOCK_G=max(16, next_pow2(group)),
                num_warps=4,
            )
    return out.to(q.dtype)


def split_decode(programs: int, device: torch.device) -> bool:
    """Whether a decode step of ``programs`` (sequence, KV head) pairs runs a program per key
    split: where fewer pairs than SMs would leave the GPU part idle over long contexts (on an
    H100, 128 sequences x 2 KV heads of ~1k tokens, the split programs and their merge took
    1.76 ms a step of 28 layers against 1.54 for the kernel before splits existed). The
    interpreter always splits (the CPU tests' decode path; the other is the learner's)."""
    if device.type != "cuda":
        return True
    return programs < torch.cuda.get_device_properties(device).multi_processor_count


class PagedKV(NamedTuple):
    """Packed sequences' K / V laid out as an engine cache (:func:`page_packed_kv`)."""

    k: torch.Tensor  # [blocks, page, Hkv, D], model dtype or e4m3 codes
    v: torch.Tensor
    k_scale: torch.Tensor | None  # [blocks, page, Hkv] fp32 (fp8 only)
    v_scale: torch.Tensor | None
    block_tables: torch.Tensor  # `[S, max_blocks]` int32
    kv_lens: torch.Tensor  # one int32 length per sequence


class PageLayout(NamedTuple):
    """Where packed sequences' tokens go in an engine-like cache (:func:`page_layout`)."""

    slots: torch.Tensor  # int64 page * page_size + offset of each token
    block_tables: torch.Tensor  # `[S, max_blocks]` int32
    kv_lens: torch.Tensor  # one int32 length per sequence
    cu_seqlens: torch.Tensor  # int32 offsets of the sequences, 0 first
    num_pages: int
    max_len: int


def page_layout(seq_lens: list[int], page: int, device: torch.device) -> PageLayout:
    """Whole pages of ``page`` tokens for each of the packed sequences (lengths ``seq_lens``),
    sequence after sequence, as the engine's cache holds them. Computed on the host and sent
    once: a caller with several layers (the learner) makes it once per forward."""
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    t = int(lens.sum())
    pages = (lens + page - 1) // page
    first_page = torch.cumsum(pages, 0) - pages  # sequence after sequence
    width = max(int(pages.max()), 1) if len(seq_lens) else 1
    cols = torch.arange(width)
    table = torch.where(cols[None, :] < pages[:, None], first_page[:, None] + cols[None, :], 0).to(torch.int32)
    seq_of = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)
    token_in_seq = torch.arange(t) - (torch.cumsum(lens, 0) - lens)[seq_of]
    slots = first_page[seq_of] * page + token_in_seq
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    return PageLayout(slots.to(device), table.to(device), lens.to(torch.int32).to(device), cu.to(device),
                      int(pages.sum()), max(seq_lens, default=0))


def page_packed_kv(k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], page: int, kv_fp8: bool = False,
                   layout: PageLayout | None = None) -> PagedKV:
    """K / V ``[T, Hkv, D]`` of packed sequences (lengths ``seq_lens``, summing to T) written
    into whole pages of ``page`` tokens, sequence after sequence, as the engine's cache holds
    them; with ``kv_fp8`` as e4m3 codes and scales (:func:`quarl.quant.kv.quantize_kv`).
    ``layout``: :func:`page_layout` of the same lengths, made once for several calls."""
    t, hkv, d = k.shape
    if sum(seq_lens) != t or v.shape != k.shape:
        raise ValueError(f"sequence lengths {seq_lens} for K {tuple(k.shape)}, V {tuple(v.shape)}")
    dev = k.device
    layout = layout or page_layout(seq_lens, page, dev)
    caches, scales = [], []
    for x in (k, v):
        if kv_fp8:
            codes, sc = quantize_kv(x)
            cache = torch.zeros(layout.num_pages, page, hkv, d, dtype=codes.dtype, device=dev)
            cache.view(torch.uint8).view(-1, hkv, d).index_copy_(0, layout.slots, codes.view(torch.uint8))
            s_cache = torch.ones(layout.num_pages, page, hkv, dtype=torch.float32, device=dev)
            s_cache.view(-1, hkv).index_copy_(0, layout.slots, sc)
            scales.append(s_cache)
        else:
            cache = torch.zeros(layout.num_pages, page, hkv, d, dtype=x.dtype, device=dev)
            cache.view(-1, hkv, d).index_copy_(0, layout.slots, x)
            scales.append(None)
        caches.append(cache)
    return PagedKV(caches[0], caches[1], scales[0], scales[1], layout.block_tables, layout.kv_lens)


def invariant_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], scale: float,
                               page: int, kv_fp8: bool = False, layout: PageLayout | None = None) -> torch.Tensor:
    """Causal attention within each of the packed sequences of ``q [T, Hq, D]``, ``k, v
    [T, Hkv, D]`` (lengths ``seq_lens``): the learner's side of exact mode. K / V are paged
    as the engine's cache (``page`` = its block size; ``kv_fp8``: its fp8 cache) and the
    kernel of :func:`invariant_paged_attention` runs with every token a new one. ``layout``:
    :func:`page_layout` of ``seq_lens`` and ``page`` on q's device, made once per forward."""
    layout = layout or page_layout(seq_lens, page, q.device)
    kv = page_packed_kv(k.contiguous(), v.contiguous(), seq_lens, page, kv_fp8, layout)
    return invariant_paged_attention(q.contiguous(), kv.k, kv.v, kv.block_tables, layout.cu_seqlens, kv.kv_lens,
                                     layout.max_len, scale, (kv.k_scale, kv.v_scale))
