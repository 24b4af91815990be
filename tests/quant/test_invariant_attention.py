"""Batch-invariant attention (quarl.quant.kernels.invariant_attention) under TRITON_INTERPRET=1.

(i) Against a float64 causal GQA reference (K / V as the cache holds them: fp8 codes times
their scales) within a bound derived from the kernel's roundings. (ii) Invariance: a token's
output is bit-identical decoded alone from a paged cache, decoded in batches of 2-9
sequences of other lengths at any position, inside the engine's prefill of its whole
sequence packed among others, in an extend step over a cached prefix, and recomputed in the
learner's packed sequences (``invariant_varlen_attention``); model-dtype and fp8 caches.
Group sizes 1, 3 (21 tokens per 64-row tile, the last row padding) and 4; a head dim below
the block (24 of 32); contexts spanning several 16-key blocks, 32-key splits and pages of 4
tokens."""

import pytest
import torch

from quarl.quant.kv import dequantize_kv, quantize_kv

pytestmark = pytest.mark.usefixtures("needs_triton")

F32, BF16 = torch.float32, torch.bfloat16
PAGE, D = 4, 24
CASES = [(1, 2, BF16, False), (3, 2, BF16, False), (4, 1, F32, False), (3, 2, BF16, True), (2, 2, F32, True)]
IDS = [f"g{g}-hkv{h}-{str(dt).split('.')[-1]}{'-fp8' if f else ''}" for g, h, dt, f in CASES]


def _mod():
    from quarl.quant.kernels import invariant_attention

    return invariant_attention


def _bits(t):
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


class Cache:
    """A paged cache of several sequences, pages handed out in a shuffled order."""

    def __init__(self, seqs_kv, hkv, dtype, fp8):
        num_pages = sum(-(-k.shape[0] // PAGE) for k, _ in seqs_kv) + 5  # some never used
        gen = torch.Generator().manual_seed(7)
        free = torch.randperm(num_pages, generator=gen).tolist()
        cdt = torch.float8_e4m3fn if fp8 else dtype
        self.k = torch.zeros(num_pages, PAGE, hkv, D, dtype=cdt)
        self.v = torch.zeros_like(self.k)
        self.ks = torch.ones(num_pages, PAGE, hkv) if fp8 else None
        self.vs = torch.ones(num_pages, PAGE, hkv) if fp8 else None
        width = max(-(-k.shape[0] // PAGE) for k, _ in seqs_kv)
        self.table = torch.zeros(len(seqs_kv), width, dtype=torch.int32)
        for s, (k, v) in enumerate(seqs_kv):
            for j in range(-(-k.shape[0] // PAGE)):
                page = free.pop()
                self.table[s, j] = page
                rows = slice(j * PAGE, (j + 1) * PAGE)
                n = k[rows].shape[0]
                for x, cache, sc in ((k, self.k, self.ks), (v, self.v, self.vs)):
                    if fp8:
                        codes, scale = quantize_kv(x[rows])
                        cache[page, :n] = codes
                        sc[page, :n] = scale
                    else:
                        cache[page, :n] = x[rows]

    @property
    def scales(self):
        return (self.ks, self.vs)


def _seq(n, hq, hkv, dtype, spread=1.0):
    """q, k, v of one sequence of n tokens."""
    return (torch.randn(n, hq, D).mul(spread).to(dtype), torch.randn(n, hkv, D).mul(spread).to(dtype),
            torch.randn(n, hkv, D).to(dtype))


def _decode(seqs, hkv, dtype, fp8, split_programs=None):
    """Decode step: the last token of each (q, k, v) sequence, over a cache of all its tokens
    (``split_programs``: the kernel's choice of path, as on a GPU by the batch)."""
    cache = Cache([(k, v) for _, k, v in seqs], hkv, dtype, fp8)
    q = torch.stack([q[-1] for q, _, _ in seqs])
    b = len(seqs)
    cu = torch.arange(b + 1, dtype=torch.int32)
    lens = torch.tensor([k.shape[0] for _, k, _ in seqs], dtype=torch.int32)
    return _mod().invariant_paged_attention(q, cache.k, cache.v, cache.table, cu, lens, 1, D**-0.5, cache.scales,
                                            split_programs=split_programs)


def _prefill(seqs, hkv, dtype, fp8, cached=None):
    """Engine prefill of whole sequences packed together (``cached[i]``: tokens of sequence i
    already in the cache, only the rest are new queries)."""
    cache = Cache([(k, v) for _, k, v in seqs], hkv, dtype, fp8)
    cached = cached or [0] * len(seqs)
    q = torch.cat([q[c:] for (q, _, _), c in zip(seqs, cached)])
    qlens = [q.shape[0] - c for (q, _, _), c in zip(seqs, cached)]
    cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor([k.shape[0] for _, k, _ in seqs], dtype=torch.int32)
    return _mod().invariant_paged_attention(q, cache.k, cache.v, cache.table, cu, lens, max(qlens), D**-0.5,
                                            cache.scales), cu


def _learner(seqs, fp8):
    q, k, v = (torch.cat([s[i] for s in seqs]) for i in range(3))
    return _mod().invariant_varlen_attention(q, k, v, [s[0].shape[0] for s in seqs], D**-0.5, PAGE, fp8)


def _reference(q, k, v, fp8):
    """float64 causal attention of one sequence ``q [n, Hq, D]`` over ``k, v [n, Hkv, D]``, and
    ``sum_j p_j |v_j|`` (the scale of the P @ V rounding) and ``max_j sum_d |q_d k_jd|``."""
    if fp8:
        k, v = (dequantize_kv(*quantize_kv(x), F32) for x in (k, v))
    g = q.shape[1] // k.shape[1]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("ihd,jhd->hij", q64, k64) * D**-0.5
    n = q.shape[0]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    p = torch.softmax(s, -1)
    out = torch.einsum("hij,jhd->ihd", p, v64)
    pv_abs = torch.einsum("hij,jhd->ihd", p, v64.abs())
    qk_abs = torch.einsum("ihd,jhd->hij", q64.abs(), k64.abs()).amax(-1).transpose(0, 1)[..., None]
    return out, pv_abs, qk_abs


def _check_reference(out, q, k, v, fp8, rows=slice(None)):
    """``|out - ref| <= (u_p + (D + 2) u32 |q||k| / sqrt(D) + 64 u32) sum_j p_j |v_j| + u_out |ref|``:
    scores from fp32 dots (products exact), probabilities rounded once to the model dtype for the
    P @ V dot, fp32 sums and one rounding of the output."""
    ref, pv_abs, qk_abs = (t[rows] for t in _reference(q, k, v, fp8))
    u = {F32: 2.0**-24, BF16: 2.0**-8}[q.dtype]
    u32 = 2.0**-24
    allow = (u + (D + 2) * u32 * qk_abs * D**-0.5 * 2 + 64 * u32) * pv_abs + u * ref.abs() + 1e-30
    err = (out.double() - ref).abs()
    assert out.dtype == q.dtype and out.shape == ref.shape
    assert bool((err <= allow).all()), float((err / allow).max())


@pytest.mark.parametrize("group,hkv,dtype,fp8", CASES, ids=IDS)
def test_prefill_and_varlen_match_float64_reference(group, hkv, dtype, fp8):
    seqs = [_seq(n, group * hkv, hkv, dtype) for n in (37, 5, 20)]
    out, cu = _prefill(seqs, hkv, dtype, fp8)
    packed = _learner(seqs, fp8)
    for i, (q, k, v) in enumerate(seqs):
        _check_reference(out[cu[i] : cu[i + 1]], q, k, v, fp8)
        _check_reference(packed[cu[i] : cu[i + 1]], q, k, v, fp8)


@pytest.mark.parametrize("group,hkv,dtype,fp8", CASES, ids=IDS)
def test_decode_matches_float64_reference(group, hkv, dtype, fp8):
    seqs = [_seq(n, group * hkv, hkv, dtype) for n in (1, 16, 17, 50)]
    out = _decode(seqs, hkv, dtype, fp8)
    for i, (q, k, v) in enumerate(seqs):
        _check_reference(out[i : i + 1], q, k, v, fp8, rows=slice(-1, None))


@pytest.mark.parametrize("group,hkv,dtype,fp8", CASES, ids=IDS)
def test_token_is_bit_identical_decoded_prefilled_or_recomputed(group, hkv, dtype, fp8):
    """The last token of a 37-token sequence (3 key blocks, the last partial; 10 pages): its
    output decoded alone is the reference bits; every other way of computing it must give them."""
    hq = group * hkv
    target = _seq(37, hq, hkv, dtype)
    alone = _decode([target], hkv, dtype, fp8)[0]
    for b in (2, 5, 9):  # decode batches: other sequences of other lengths, the target anywhere
        for pos in sorted({0, b // 2, b - 1}):
            seqs = [_seq(int(n), hq, hkv, dtype, spread=3.0) for n in torch.randint(1, 60, (b,))]
            seqs[pos] = target
            assert _same_bits(_decode(seqs, hkv, dtype, fp8)[pos], alone), ("decode", b, pos)
    for before, after in ((0, 0), (1, 2), (3, 0)):  # prefill / learner packs: other sequences around it
        others = [_seq(int(n), hq, hkv, dtype, spread=3.0) for n in torch.randint(1, 40, (before + after,))]
        seqs = others[:before] + [target] + others[before:]
        out, cu = _prefill(seqs, hkv, dtype, fp8)
        assert _same_bits(out[cu[before + 1] - 1], alone), ("prefill", before, after)
        packed = _learner(seqs, fp8)
        assert _same_bits(packed[cu[before + 1] - 1], alone), ("learner", before, after)
    for cached in (1, 16, 30, 36):  # extend: part of the sequence already cached
        out, _ = _prefill([target], hkv, dtype, fp8, cached=[cached])
        assert _same_bits(out[-1], alone), ("extend", cached)


@pytest.mark.parametrize("group,hkv,dtype,fp8", CASES[:2] + CASES[3:4], ids=IDS[:2] + IDS[3:4])
def test_every_token_of_a_prefill_equals_its_decode(group, hkv, dtype, fp8):
    """Token t of a sequence computed inside the learner's packed batch equals decoding it with
    a cache of t + 1 tokens, for every t (each row position of the interpreter's 64-row tiles,
    64 // group tokens each: 70 tokens span two for every group here)."""
    q, k, v = _seq(70, group * hkv, hkv, dtype)
    other = _seq(9, group * hkv, hkv, dtype)
    packed = _learner([other, (q, k, v)], fp8)[9:]
    for t in range(70):
        dec = _decode([(q[: t + 1], k[: t + 1], v[: t + 1])], hkv, dtype, fp8)[0]
        assert _same_bits(packed[t], dec), t


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_decode_split_by_split_equals_the_learners_in_program_merge(fp8):
    """A 100-token sequence spans four 32-key splits (the interpreter's): a token decoded at
    and around each split boundary, by one program per split and the merge kernel or by the
    in-program merge a large decode batch takes, equals the same token in the learner's packed
    sequences (the splits merged inside one program)."""
    q, k, v = _seq(100, 6, 2, BF16)
    other = _seq(9, 6, 2, BF16)
    packed = _learner([other, (q, k, v)], fp8)[9:]
    assert _mod().attention_config(D, 3, interpret=True).split == 32
    for t in (0, 31, 32, 33, 63, 64, 65, 99):
        for split in (True, False):  # a program per split (few sequences) or merged in-program (many)
            dec = _decode([(q[: t + 1], k[: t + 1], v[: t + 1]), other], 2, BF16, fp8, split)[0]
            assert _same_bits(packed[t], dec), (t, split)
    _check_reference(packed, q, k, v, fp8)


def test_page_packed_kv_layout():
    mod = _mod()
    k = torch.arange(11 * 2 * 4, dtype=F32).view(11, 2, 4)
    kv = mod.page_packed_kv(k, -k, [6, 1, 4], page=4)
    assert kv.block_tables.tolist() == [[0, 1], [2, 0], [3, 0]] and kv.kv_lens.tolist() == [6, 1, 4]
    assert torch.equal(kv.k[1, :2], k[4:6]) and torch.equal(kv.k[2, 0], k[6]) and torch.equal(kv.v[3], -k[7:11])
    fp8 = mod.page_packed_kv(k, k, [6, 1, 4], page=4, kv_fp8=True)
    codes, scales = quantize_kv(k)
    assert torch.equal(fp8.k[1, :2].view(torch.uint8), codes[4:6].view(torch.uint8))
    assert torch.equal(fp8.k_scale[3], scales[7:11])


def test_decode_splits_only_where_the_pairs_leave_sms_idle():
    from quarl.quant.kernels.invariant_attention import split_decode

    assert split_decode(10**6, torch.device("cpu"))  # (the interpreter: the split path always)
    if torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert split_decode(sms - 1, torch.device("cuda")) and not split_decode(sms, torch.device("cuda"))


def test_config_has_no_token_count_argument_and_refuses_large_groups():
    import inspect

    mod = _mod()
    assert list(inspect.signature(mod.attention_config).parameters) == ["head_dim", "group", "interpret"]
    assert mod.attention_config(128, 7) == mod.AttentionConfig(64, 64, 128, 4, 2, 512)
    with pytest.raises(ValueError, match="at most"):
        mod.attention_config(128, 65)
