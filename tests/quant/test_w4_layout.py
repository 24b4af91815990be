"""The fragment layouts of the CUDA W4A16 kernels and their cache, checked on CPU.

The kernels themselves need a GPU (tests_gpu/quant runs them against the reference);
here the layout it reads is checked against the mma.sync.m16n8k16 fragment definition,
by emulating the kernel's register unpacking in torch.
"""

import pytest
import torch

from quarl.quant import get_scheme, quantize_weight, reference_linear
from quarl.quant.kernels import w4_layout as cuda_w4
from quarl.quant.kernels.w4_layout import RepackCache


def _rand_codes(n, kp, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (n, kp), generator=g, dtype=torch.uint8)


def test_repack_round_trip_with_padding():
    codes = _rand_codes(100, 256)  # N not a multiple of the 64-column slab
    frag = cuda_w4.repack_codes(codes)
    assert frag.shape == (2, 16, 32, 4) and frag.dtype == torch.int32
    assert torch.equal(cuda_w4.unpack_frag_codes(frag, 100), codes)


def _emulate_fragments(frag: torch.Tensor, n: int) -> torch.Tensor:
    """Codes [N, Kp] as the kernel's registers see them: word i of lane (g, t), shifted by
    4q and masked with 0x000F000F, is the bf16x2 register of fragment half q & 1 of tile
    2i + (q >> 1); mma.m16n8k16's B fragment holds B[2t + 8h][g] (low half) and
    B[2t + 8h + 1][g] (high half) in register h (PTX ISA, "Matrix fragments for mma.m16n8k16")."""
    s, ks = frag.shape[:2]
    words = frag.to(torch.int64) & 0xFFFFFFFF
    w = torch.full((s * 64, ks * 16), -1, dtype=torch.int64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            for q in range(4):
                reg = (words[:, :, lane, i] >> (4 * q)) & 0x000F000F
                lo, hi = reg & 0xF, reg >> 16
                tile, h = 2 * i + (q >> 1), q & 1
                col = 8 * tile + g
                for half, val in ((0, lo), (1, hi)):
                    k = 2 * t + 8 * h + half
                    rows = torch.arange(s) * 64 + col
                    cols = torch.arange(ks) * 16 + k
                    w[rows[:, None], cols[None, :]] = val
    assert (w >= 0).all(), "some weight is fed by no register"
    return w[:n]


def test_registers_hold_the_mma_fragments():
    codes = _rand_codes(70, 128, seed=1)
    frag = cuda_w4.repack_codes(codes)
    assert torch.equal(_emulate_fragments(frag, 70), codes.to(torch.int64))


def _bf16_bits(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.int16).view(torch.bfloat16).double()


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-asym"])
def test_emulated_kernel_math_equals_reference(scheme):
    """(0x4300 | u) + bf16(-(128 + z)) = u - z exactly, and sum_g s_g sum_k x_k (u - z)
    over the emulated fragments equals the reference GEMM (float64)."""
    torch.manual_seed(0)
    n, k = 70, 200
    w = torch.randn(n, k)
    qw = quantize_weight(w, get_scheme(scheme))
    fw = cuda_w4.repack_w4(qw)
    codes = _emulate_fragments(fw.qdata, n)  # [N, Kp]
    kp = codes.shape[1]
    groups = kp // 128
    assert fw.scales.shape == (groups, 128) and torch.equal(fw.scales[:, :n], qw.scales.t())
    biased = _bf16_bits(0x4300 | codes)  # 128 + u
    if fw.negz is None:
        negz = torch.full((groups, n), 0xC308C308, dtype=torch.int64)
    else:
        negz = fw.negz[:, :n].to(torch.int64) & 0xFFFFFFFF
        assert torch.equal(negz >> 16, negz & 0xFFFF)  # both halves the same
    sub = _bf16_bits(negz & 0xFFFF).t().repeat_interleave(128, dim=1)  # [N, Kp]
    deq_int = biased + sub
    zeros = qw.zeros.double() if qw.zeros is not None else torch.full((n, groups), 8.0, dtype=torch.float64)
    assert torch.equal(deq_int, codes.double() - zeros.repeat_interleave(128, dim=1))
    x = torch.randn(5, k, dtype=torch.float64)
    xp = torch.nn.functional.pad(x, (0, kp - k))
    per_group = torch.einsum("mgk,ngk->mng", xp.view(5, groups, 128), deq_int.view(n, groups, 128))
    y = (per_group * fw.scales[:, :n].t().double()[None]).sum(-1)
    y_ref = reference_linear(x, qw, None)
    assert torch.allclose(y, y_ref, rtol=1e-12, atol=1e-12)


def test_fragment_cache_rebuilds_in_place_after_copy():
    torch.manual_seed(0)
    sch = get_scheme("w4a16-asym")
    qa, qb = quantize_weight(torch.randn(64, 256), sch), quantize_weight(torch.randn(64, 256), sch)
    target = qa.clone()
    cache = RepackCache()
    with torch.inference_mode():  # the engine builds it while generating
        fw = cache.get(target)
    assert cache.get(target) is fw  # cached
    ptrs = [t.data_ptr() for t in fw if t is not None]
    target.copy_(qb)  # in-place load: the derived layout must follow, in the same storage
    assert not cache.is_fresh(target)
    fw2 = cache.get(target)
    assert [t.data_ptr() for t in fw2 if t is not None] == ptrs
    want = cuda_w4.repack_w4(qb)
    for a, b in zip(fw2, want):
        assert torch.equal(a, b)


def test_repack_rejects_other_formats():
    qw = quantize_weight(torch.randn(64, 128), get_scheme("w2a16"))
    with pytest.raises(ValueError, match="int4 weights with group 128"):
        cuda_w4.repack_w4(qw)


def test_wgmma_words_round_trip():
    frag = cuda_w4.repack_codes(_rand_codes(130, 384, seed=2))
    words = cuda_w4.wgmma_words(frag)
    assert words.shape == (3, 3, 4, 2, 32, 4)
    assert torch.equal(cuda_w4.unwgmma_words(words), frag)


def _emulate_wgmma_fragments(words: torch.Tensor, n: int) -> torch.Tensor:
    """Codes [N, Kp] as the wgmma kernel's registers see them. Warp w of the warpgroup holds
    rows 16 w .. 16 w + 15 of the 64 x 16 A tile of step kk, with the m16n8k16 A layout
    (PTX ISA, "wgmma register fragments"): register r of lane (g, t) holds A[g + 8 (r & 1)]
    [2 t + 8 (r >> 1)] (low half) and the next column (high half). The kernel takes word
    4 h + i = kk of its 32 bytes and makes registers 0, 1, 2, 3 from shifts 0, 8, 4, 12."""
    s, groups = words.shape[:2]
    u = words.to(torch.int64) & 0xFFFFFFFF
    w = torch.full((s * 64, groups * 128), -1, dtype=torch.int64)
    shift = {0: 0, 1: 8, 2: 4, 3: 12}
    for warp in range(4):
        for h in range(2):
            for i in range(4):
                kk = 4 * h + i
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for r in range(4):
                        reg = (u[:, :, warp, h, lane, i] >> shift[r]) & 0x000F000F  # [S, G]
                        row = 16 * warp + g + 8 * (r & 1)
                        for half, val in ((0, reg & 0xF), (1, reg >> 16)):
                            col = 16 * kk + 2 * t + 8 * (r >> 1) + half
                            rows = torch.arange(s) * 64 + row
                            cols = torch.arange(groups) * 128 + col
                            w[rows[:, None], cols[None, :]] = val
    assert (w >= 0).all(), "some weight is fed by no register"
    return w[:n]


def test_wgmma_registers_hold_the_wgmma_a_fragments():
    codes = _rand_codes(70, 256, seed=3)
    words = cuda_w4.wgmma_words(cuda_w4.repack_codes(codes))
    assert torch.equal(_emulate_wgmma_fragments(words, 70), codes.to(torch.int64))


def test_both_layouts_follow_in_place_loads_and_row_refreshes():
    torch.manual_seed(1)
    sch = get_scheme("w4a16-asym")
    qa, qb = quantize_weight(torch.randn(192, 256), sch), quantize_weight(torch.randn(192, 256), sch)
    target = qa.clone()
    cache = RepackCache()
    copies = {lay: cache.get(target, lay) for lay in cuda_w4.LAYOUTS}
    assert not torch.equal(copies["frag"].qdata.flatten()[:8], copies["wgmma"].qdata.flatten()[:8])
    # a part of the rows is loaded (as a fused q/k/v weight loads q): slabs 1..2 only
    for f, t in target.tensors().items():
        t[64:192].copy_(qb.tensors()[f][64:192])
    assert not cache.is_fresh(target)
    cache.refresh(target, rows=(64, 192))
    assert cache.is_fresh(target)
    mixed = qa.clone()
    for f, t in mixed.tensors().items():
        t[64:192].copy_(qb.tensors()[f][64:192])
    for lay, fw in copies.items():
        want = cuda_w4.repack_w4(mixed, lay)
        got = cache.get(target, lay)
        assert got.qdata.data_ptr() == fw.qdata.data_ptr()
        for a, b in zip(got, want):
            assert torch.equal(a, b), lay
    with pytest.raises(ValueError, match="unknown w4 layout"):
        cuda_w4.repack_w4(qa, "marlin")


def test_cache_follows_a_new_weight_object():
    """A different weight (QATLinear's next quantized weight) is repacked, never served the
    old copy, even where the new tensors carry the same versions."""
    sch = get_scheme("w4a16")
    qa, qb = quantize_weight(torch.randn(64, 256), sch), quantize_weight(torch.randn(64, 256), sch)
    cache = RepackCache()
    fa = cache.get(qa)
    ptr = fa.qdata.data_ptr()
    assert not cache.is_fresh(qb)
    fb = cache.get(qb)
    assert fb.qdata.data_ptr() == ptr  # rebuilt in the same storage (same shapes)
    assert torch.equal(fb.qdata, cuda_w4.repack_w4(qb).qdata)


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-asym"])
def test_a_dense_copy_stays_at_its_address_and_follows_loads_and_row_refreshes(scheme):
    """``RepackCache(dense=True)`` (the engine's ``dense_weights``) keeps one dequantized copy:
    after an in-place load it holds the new weight's values in the same storage (CUDA graphs
    read that address), a row refresh rewrites only those rows, and the learner's
    ``drop_dequantized`` leaves it alone."""
    def dequantize(q, dtype):
        return q.dequantize(dtype)

    sc = get_scheme(scheme)
    g = torch.Generator().manual_seed(7)
    qw = quantize_weight(torch.randn(192, 256, generator=g), sc)
    cache = RepackCache(dense=True)
    d = cache.dequantized(qw, torch.bfloat16, dequantize)
    assert torch.equal(d, qw.dequantize(torch.bfloat16))
    assert cache.dequantized(qw, torch.bfloat16, dequantize) is d and cache.layouts() == ("dense-torch.bfloat16",)
    new = quantize_weight(torch.randn(192, 256, generator=g), sc)
    qw.copy_(new)
    cache.refresh(qw)
    got = cache.dequantized(qw, torch.bfloat16, dequantize)
    assert got.data_ptr() == d.data_ptr() and torch.equal(got, new.dequantize(torch.bfloat16))
    part = quantize_weight(torch.randn(64, 256, generator=g), sc)  # rows 64..127, as a fused q/k/v part loads
    for f, t in part.tensors().items():
        getattr(qw, f)[64:128].copy_(t)
    cache.refresh(qw, (64, 128))
    want = new.dequantize(torch.bfloat16)
    want[64:128] = part.dequantize(torch.bfloat16)
    assert cache.is_fresh(qw) and torch.equal(cache.dequantized(qw, torch.bfloat16, dequantize), want)
    assert cache.dequantized(qw, torch.bfloat16, dequantize).data_ptr() == d.data_ptr()
    cache.drop_dequantized()
    assert cache.layouts() == ("dense-torch.bfloat16",)


def test_the_dense_plan_runs_a_plain_gemm_on_the_kept_copy(monkeypatch, needs_triton):
    """Through the fast path's dispatch: a weight whose owner keeps a dense copy runs the
    ``dequant`` plan on it (the copy is made once, not per call), with the values of
    ``F.linear`` over the dequantized weight."""
    from quarl.quant.kernels import launch, weight_only

    sc = get_scheme("w4a16")
    g = torch.Generator().manual_seed(3)
    qw = quantize_weight(torch.randn(128, 256, generator=g), sc)
    x = torch.randn(100, 256, generator=g).to(torch.bfloat16)  # M = 100: the dequant plan off the GPU
    want = torch.nn.functional.linear(x, weight_only.dequantize(qw, torch.bfloat16))
    made = []
    monkeypatch.setattr(weight_only, "dequantize", lambda q, dt, _d=weight_only.dequantize: made.append(1) or _d(q, dt))
    cache = RepackCache(dense=True)
    for _ in range(3):
        assert torch.equal(launch.linear(x, qw, None, cache), want)
    assert len(made) == 1


def test_gated_rows_pair_each_gate_row_with_its_up_row_in_one_thread():
    """The "wgmma-gated" order: a permutation; the thread holding permuted row p (p % 16 < 8,
    the kernel's row0) also holds p + 8, and the epilogue's column ``(p >> 4) * 8 + (p & 7)``
    (w4a16.cu's gated_col) is p's gate row j, with p + 8 its up row I + j."""
    n = 96
    order = cuda_w4.gated_rows(n)
    assert sorted(order.tolist()) == list(range(n))
    for p in range(n):
        if p % 16 < 8:
            j = (p >> 4) * 8 + (p & 7)
            assert order[p] == j and order[p + 8] == n // 2 + j
    with pytest.raises(ValueError, match="I % 8 == 0"):
        cuda_w4.gated_rows(88)


@pytest.mark.parametrize("name", ["w4a16", "w4a16-asym"])
def test_gated_layout_is_the_wgmma_layout_of_the_reordered_rows(name):
    torch.manual_seed(4)
    qw = quantize_weight(torch.randn(160, 384), name)
    order = cuda_w4.gated_rows(160)
    got = cuda_w4.repack_w4(qw, "wgmma-gated")
    codes = cuda_w4.ref.unpack_4bit(qw.qdata)
    assert torch.equal(_emulate_wgmma_fragments(got.qdata, 160), codes[order].to(torch.int64))
    assert torch.equal(got.scales[:, :160], qw.scales[order].t())
    if qw.zeros is not None:
        plain = cuda_w4.repack_w4(qw, "wgmma")
        assert torch.equal(got.negz[:, :160], plain.negz[:, order])
