"""Batch-invariant GEMMs (quarl.quant.kernels.invariant) under TRITON_INTERPRET=1 on CPU.

For every kind: (i) the float64 reference within an fp32-accumulation bound; (ii) a row's
output is bit-identical alone (M = 1) and inside batches of M = 2, 7, 33, 130 at different
positions among other random rows; (iii) M = 0 and odd K. On CPU the interpreter runs each
tile's dot as one numpy matmul of a fixed shape, so this checks the kernels' structure (tile,
K order, masking, epilogue, no M-dependent choice); invariance on real tensor cores is for a
GPU run to check (docs/kernels.md).
"""


import pytest
import torch

from quarl.quant import quantize_weight
from quarl.quant import reference as ref
from tests.quant import sass_count

pytestmark = pytest.mark.usefixtures("needs_triton")

N, K = 40, 200  # N: the column tile is partial; K: not a multiple of BK nor of 128
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CASES = [
    ("dense", F32), ("dense", BF16), ("dense", F16),
    ("w4a16", F32), ("w4a16", BF16), ("w4a16-asym", F32), ("w4a16-asym", BF16), ("w2a16", F32), ("nvfp4", F32),
    ("mxfp4", F32),
    ("w8a8-int8", F32), ("w8a8-int8", BF16), ("w8a8-fp8", F32),
]
IDS = [f"{name}-{str(dt).split('.')[-1]}" for name, dt in CASES]


def _inv():
    from quarl.quant.kernels import invariant

    return invariant


def _weight(name, n=N, k=K):
    w = torch.randn(n, k)
    return w if name == "dense" else quantize_weight(w, name)


def _ref_operands(name, x, w):
    """(x, W) in float64 as the kernel multiplies them."""
    if name == "dense":
        return x.double(), w.to(x.dtype).double()
    if w.scheme.quantizes_activations:
        q, s = ref.quantize_activations(x, w.scheme.act_format)
        return q.double() * s.double()[:, None], w.dequantize(torch.float64)
    # weight-only: the kernel rounds each dequantized weight to x's dtype (exact in float64 for fp32)
    return x.double(), w.dequantize(x.dtype if x.dtype != F32 else torch.float64).double()


def _check_reference(name, x, w, b, y):
    """``|y - ref| <= (K + 4) u32 (|x| |W|^T + |b|) + u_out |ref|``: fp32 accumulation (and fp32
    operand rounding) plus one rounding to the output dtype."""
    xs, wd = _ref_operands(name, x, w)
    exact = xs @ wd.T + b.double()
    absdot = xs.abs() @ wd.abs().T + b.double().abs()
    u_out = {F32: 0.0, BF16: 2.0**-8, F16: 2.0**-11}[y.dtype]
    gamma = (xs.shape[1] + 4) * 2.0**-24
    allow = gamma * absdot + u_out * (exact.abs() + gamma * absdot)
    err = (y.double() - exact).abs()
    assert y.shape == exact.shape and y.dtype == x.dtype
    assert bool((err <= allow).all()), float((err / allow.clamp_min(1e-300)).max())


def _bits(t):
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _same_bits(a, b):
    return torch.equal(_bits(a.contiguous()), _bits(b.contiguous()))


def _others(m, k, dtype):
    """Random rows of very different magnitudes (one all zero)."""
    o = torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]
    if m > 1:
        o[m // 3] = 0
    return o.to(dtype)


@pytest.mark.parametrize("name,dtype", CASES, ids=IDS)
def test_matches_float64_reference(name, dtype):
    inv = _inv()
    w, x, b = _weight(name), torch.randn(17, K).to(dtype), torch.randn(N).to(dtype)
    _check_reference(name, x, w, b, inv.invariant_linear(x, w, b))


@pytest.mark.parametrize("name,dtype", CASES, ids=IDS)
def test_row_is_bit_identical_at_any_batch_size_and_position(name, dtype):
    inv = _inv()
    w, b = _weight(name), torch.randn(N).to(dtype)
    row = torch.randn(1, K).to(dtype)
    alone = inv.invariant_linear(row, w, b)
    for m in (2, 7, 33, 130):  # (BM = 64 here: 130 rows span three row tiles)
        for pos in sorted({0, m // 2, m - 1} | ({63, 64} if m > 64 else set())):  # tile ends and starts included
            batch = _others(m, K, dtype)
            batch[pos] = row[0]
            y = inv.invariant_linear(batch, w, b)
            assert _same_bits(y[pos], alone[0]), (m, pos)
    # every row of one batch equals that row alone
    batch = _others(7, K, dtype)
    y = inv.invariant_linear(batch, w, b)
    for i in range(7):
        assert _same_bits(y[i], inv.invariant_linear(batch[i : i + 1], w, b)[0]), i


@pytest.mark.parametrize("name,dtype", CASES, ids=IDS)
def test_zero_rows(name, dtype):
    inv = _inv()
    y = inv.invariant_linear(torch.empty(0, K, dtype=dtype), _weight(name), torch.randn(N).to(dtype))
    assert y.shape == (0, N) and y.dtype == dtype


@pytest.mark.parametrize("name,k", [("dense", 131), ("w4a16", 129), ("w4a16-asym", 257), ("w2a16", 67),
                                    ("nvfp4", 129), ("w8a8-int8", 67), ("w8a8-fp8", 131)])
def test_odd_k(name, k):
    """K odd: dense / W8A8 blocks masked past K; packed formats read the padded chunks
    (K = 129 / 257: a last chunk of one real column), x masked past K. Leading dims kept."""
    inv = _inv()
    n = 24
    w, b = _weight(name, n, k), torch.randn(n)
    x = torch.randn(2, 5, k)
    y = inv.invariant_linear(x, w, b)
    assert y.shape == (2, 5, n)
    _check_reference(name, x.reshape(10, k), w, b, y.reshape(10, n))
    assert _same_bits(y[1, 3], inv.invariant_linear(x[1, 3], w, b))


def test_tile_choice_follows_m_only_where_the_k_walk_stays():
    """invariant_config may pick BM / BN / warps / stages by M, never the K walk: fp8's BK is
    always 128 (its accumulator promotion), a dense 16-bit BK is 64 or 128 (the same k16
    chain), every GPU tile a whole number of 64-row warpgroup MMAs; fp32 operands and the
    interpreter take one tile whatever M."""
    inv = _inv()
    for kind in inv.KINDS:
        for n, k in [(256, 1536), (1536, 1536), (8960, 1536), (1536, 8960), (151936, 1536)]:
            cfgs = {inv.invariant_config(kind, n, k, m) for m in (1, 7, 128, 256, 257, 6144, 10**6)}
            assert len({c.bk for c in cfgs}) == 1 or (kind == "dense" and {c.bk for c in cfgs} <= {64, 128})
            assert all(c.bm in (64, 128, 256) for c in cfgs)
            if kind == "w8a8":
                assert {c.bk for c in cfgs} == {128}
            assert cfgs <= set(inv.same_bits_tiles(kind))
            for fixed in ({inv.invariant_config(kind, n, k, m, interpret=True) for m in (1, 6144)},
                          {inv.invariant_config(kind, n, k, m, fp32=True) for m in (1, 6144)} if kind != "w8a8"
                          else {inv.invariant_config(kind, n, k, 1)}):
                assert len(fixed) == 1
    assert len(inv.same_bits_tiles("dense")) > 1  # (M does move the tile on a GPU)


def test_w4a8_is_not_covered():
    with pytest.raises(NotImplementedError, match="W4A8"):
        _inv().invariant_linear(torch.randn(3, K), _weight("w4a8-int8"))


def test_torch_cpu_matmul_for_contrast(record_property):
    """Not a check of torch: records whether torch's own fp32 CPU matmul gives a row the same
    bits alone and inside a batch (here, with torch 2.13 on 2 cores, it did not: M = 1 takes
    another BLAS path than M = 64, see reference.codes_linear), next to the invariant kernel,
    which must on the same data."""
    inv = _inv()
    w = torch.randn(N, K)
    batch = torch.randn(64, K)
    torch_same = all(_same_bits((batch @ w.T)[i], (batch[i : i + 1] @ w.T)[0]) for i in (0, 31, 63))
    record_property("torch_cpu_fp32_matmul_row_invariant", torch_same)
    y = inv.invariant_linear(batch, w)
    assert all(_same_bits(y[i], inv.invariant_linear(batch[i : i + 1], w)[0]) for i in (0, 31, 63))


@pytest.mark.parametrize("name,dtype", [("dense", BF16), ("dense", F32), ("w4a16", BF16), ("w4a16-asym", F32),
                                        ("w2a16", F32), ("w8a8-int8", BF16), ("w8a8-fp8", F32)])
def test_k_segments_one_program_each_or_all_in_one_give_the_same_bits(name, dtype):
    """K summed in segments (K = 500: four segments of 128 columns, the last partial): one
    program per segment plus the ordered addition of their partials (fp32; int8's int32 code
    sums, then the scales) equals the segments added inside each program, bit for bit, for
    rows alone and among others, with a bias; both within the fp32 bound of the float64
    reference."""
    inv = _inv()
    k, n = 500, 24
    w, b = _weight(name, n, k), torch.randn(n).to(dtype)
    gemm = {"dense": inv.dense_gemm, "w8a8-int8": _w8a8(inv, dtype), "w8a8-fp8": _w8a8(inv, dtype)}.get(
        name, inv.weight_only_gemm)
    x = _others(9, k, dtype)
    split = gemm(x, w, b, seg=128, parallel=True)
    inner = gemm(x, w, b, seg=128, parallel=False)
    assert _same_bits(split, inner)
    _check_reference(name, x, w, b, split)
    for i in (0, 4, 8):
        assert _same_bits(gemm(x[i : i + 1], w, b, seg=128, parallel=True)[0], inner[i])
    if name == "w8a8-int8":  # integer sums: any segments give the same bits
        assert _same_bits(gemm(x, w, b, seg=512), inner)
    elif dtype == F32:  # (fp32 output: one segment's sum differs in its last bits somewhere)
        assert not _same_bits(gemm(x, w, b, seg=512), inner)


def _w8a8(inv, dtype):
    """``gemm(x, qw, bias, seg=, parallel=)`` of the W8A8 kernel on x's per-token codes."""
    from quarl.quant.kernels.act_quant import act_quant

    def gemm(x, qw, bias, seg=None, parallel=None):
        xq, sx = act_quant(x.contiguous(), qw.scheme.act_format)
        return inv.w8a8_gemm(xq, sx, qw, bias, dtype, seg=seg, parallel=parallel)

    return gemm


def test_k_segment_is_a_function_of_k_in_whole_chunks():
    inv = _inv()
    assert inv.k_segment(1536) >= 1536 and inv.k_segment(4095) >= 4095  # one segment below K_SPLIT_MIN
    for k in (4096, 8960, 18944, 27648):
        seg = inv.k_segment(k)
        segments = -(-k // seg)
        assert seg % 128 == 0 and segments == min(8, k // 2048)


def test_the_int4_decode_tile_dequantizes_in_packed_bf16():
    """The weight-only kernel's decode tile (W1's shapes: N < 4096) compiled for Hopper (no GPU
    needed): int4 codes to bf16 in inline PTX and bf16 arithmetic (``w4_bf16``, as the MoE
    kernel), about 8 instructions a weight in the K loop; the fp32 unpacking, scaling and
    conversion before it spent 11.7."""
    cfg = _inv().invariant_config("weight_only", 1536, 1536, 64)
    got = sass_count.count("invariant", cfg.bm, cfg.bn, cfg.num_warps, cfg.num_stages)
    assert got["loop"] / got["weights_per_thread"] < 9.0, got
    assert "FMUL" not in got["ops"] and got["ops"]["HMUL2"] == got["weights_per_thread"] // 2, got

