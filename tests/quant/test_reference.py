"""Reference quantizers: analytic error bounds, layouts, pack/unpack round trips."""

import pytest
import torch

from quarl.quant import get_scheme, quantize_weight, reference_linear
from quarl.quant import reference as ref
from quarl.quant.qweight import stored_layout

SHAPE = (24, 200)  # K not a multiple of 128: exercises padding


def _heavy_tailed(shape):
    w = torch.randn(shape) * 0.02
    w[0, 3] = 0.5  # an outlier
    w[1] = 0.0  # an all-zero row
    return w


def _groups(t, g):
    return ref.pad_k(t).view(t.shape[0], -1, g)


@pytest.mark.parametrize("name", ["w4a16", "w4a8-int8", "w4a16-asym", "w2a16"])
def test_int_group_error_within_half_step(name):
    sc = get_scheme(name)
    w = _heavy_tailed(SHAPE)
    qw = quantize_weight(w, sc)
    err = (qw.dequantize() - w).abs()
    s = qw.scales.repeat_interleave(sc.group_size, dim=1)[:, : w.shape[1]]
    # asymmetric: the bf16 scale may be up to 2^-8 short of (hi - lo) / top, so the group's top
    # can lie that far past the top code (symmetric: past +-(2^(b-1) - 1), a code that is there)
    slack = 0.0 if sc.symmetric else (2**sc.weight_bits - 1) * 2**-8
    assert torch.all(err <= s * (0.5 + slack) * (1 + 1e-5) + 1e-12)
    assert torch.all(qw.dequantize()[1] == 0)


def test_bf16_scale_hand_values():
    # 0.1 = 0x3DCCCCCD in fp32 -> 0x3DCD0000 = 0.10009765625 (nearest); 1 + 3 2^-9 -> 1 + 2^-7
    # (ties to even: 1 + 2^-8 -> 1); 2^-140 -> 2^-133, the smallest positive bf16
    got = ref.bf16_scale(torch.tensor([1.0, 1.0 + 3 * 2**-9, 1.0 + 2**-8, 0.1, 2.0**-140, 6.0]))
    assert got.tolist() == [1.0, 1.0 + 2**-7, 1.0, 0.10009765625, 2.0**-133, 6.0]


@pytest.mark.parametrize("name", ["w4a16", "w4a8-int8", "w4a16-asym", "w2a16"])
def test_int_group_scales_are_the_nearest_bf16_values(name):
    """The scale is the exact one (``amax * fp32(1 / qmax)``, asymmetric: of ``hi - lo``)
    rounded to the nearest bf16 value: a bf16 value within half a bf16 step (2^-8 relative)."""
    sc = get_scheme(name)
    w = torch.randn(64, 512) * 0.02
    qw = quantize_weight(w, sc)
    g = _groups(w, sc.group_size)
    qmax = 2 ** (sc.weight_bits - 1) - 1 if sc.symmetric else 2**sc.weight_bits - 1
    span = g.abs().amax(2) if sc.symmetric else g.amax(2).clamp(min=0) - g.amin(2).clamp(max=0)
    exact = span * (1.0 / qmax)
    assert torch.equal(qw.scales.bfloat16().float(), qw.scales)
    assert torch.all((qw.scales - exact).abs() <= exact * 2**-8)
    assert (qw.scales != exact).float().mean() > 0.9  # the exact scale is rarely a bf16 value


def test_int8_per_channel_error_and_codes():
    sc = get_scheme("w8a8-int8")
    w = _heavy_tailed(SHAPE)
    qw = quantize_weight(w, sc)
    assert qw.qdata.dtype == torch.int8 and qw.qdata.abs().max() <= 127
    assert torch.all((qw.dequantize() - w).abs() <= qw.scales[:, None] / 2 * (1 + 1e-5))
    # each nonzero row's max-abs element hits the top code
    assert torch.all(qw.qdata[2:].abs().amax(1) == 127)


def test_fp8_per_channel_error():
    w = _heavy_tailed(SHAPE)
    qw = quantize_weight(w, "w8a8-fp8")
    v = w / qw.scales[:, None]
    # e4m3 has 3 mantissa bits: relative half-ulp 2^-4 for normals, absolute 2^-10 below 2^-6
    bound = torch.maximum(v.abs() * 2**-4, torch.full_like(v, 2**-10)) * qw.scales[:, None]
    assert torch.all((qw.dequantize() - w).abs() <= bound * (1 + 1e-5))


def _e2m1_halfgap(a):
    return torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0))


def test_nvfp4_error_bound_and_scales():
    sc = get_scheme("nvfp4")
    w = _heavy_tailed(SHAPE)
    qw = quantize_weight(w, sc)
    eff = (qw.scales.float() * qw.global_scale).repeat_interleave(16, dim=1)[:, :200]
    v = (w / eff).nan_to_num(0.0)
    err = (qw.dequantize() - w).abs()
    assert torch.all(err <= _e2m1_halfgap(v.abs()) * eff * (1 + 1e-5) + 1e-12)
    assert torch.isclose(qw.global_scale, w.abs().max() / (448 * 6))


def test_mxfp4_error_bound_and_scales():
    sc = get_scheme("mxfp4")
    w = _heavy_tailed(SHAPE)
    qw = quantize_weight(w, sc)
    eff = ref.e8m0_to_float(qw.scales)
    amax = _groups(w, 32).abs().amax(2)
    nz = amax > 0
    # OCP MX: scale = 2^(floor(log2 amax) - 2), so amax / scale in [4, 8)
    assert torch.all((amax[nz] / eff[nz] >= 4) & (amax[nz] / eff[nz] < 8))
    eff = eff.repeat_interleave(32, dim=1)[:, :200]
    v = w / eff
    bound = torch.maximum(_e2m1_halfgap(v.abs()), v.abs() - 6) * eff
    assert torch.all((qw.dequantize() - w).abs() <= bound * (1 + 1e-5) + 1e-12)


def test_e2m1_rounding_is_nearest_even():
    grid = torch.tensor(ref.E2M1_GRID)
    v = torch.linspace(-7, 7, 2801)
    codes = ref.round_to_e2m1(v)
    got = ref.e2m1_to_float(codes)
    best = (v.abs()[:, None].clamp(max=6) - grid[None]).abs().min(1).values
    assert torch.allclose((got.abs() - v.abs().clamp(max=6)).abs(), best)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert ref.e2m1_to_float(ref.round_to_e2m1(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert ref.e2m1_to_float(ref.round_to_e2m1(-ties)).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]


@pytest.mark.parametrize("bits", [4, 2])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 2**bits, (5, 384), dtype=torch.uint8)
    packed = ref.pack_codes(codes, bits)
    assert packed.shape == (5, 384 * bits // 8)
    assert torch.equal(ref.unpack_codes(packed, bits), codes)


def test_pack_layout_4bit_documented():
    codes = torch.zeros(1, 256, dtype=torch.uint8)
    codes[0, 128 + 5] = 3  # chunk 1, low half
    codes[0, 128 + 64 + 5] = 9  # chunk 1, high half
    p = ref.pack_4bit(codes)
    assert p[0, 64 + 5] == 3 | (9 << 4) and int(p.sum()) == 3 | (9 << 4)


def test_pack_layout_2bit_documented():
    codes = torch.zeros(1, 128, dtype=torch.uint8)
    codes[0, 32 * 2 + 7] = 3  # quarter 2 of chunk 0
    p = ref.pack_2bit(codes)
    assert p[0, 7] == 3 << 4 and int(p.sum()) == 3 << 4


@pytest.mark.parametrize("name",
                         ["bf16", "w8a8-int8", "w8a8-fp8", "w4a16", "w4a16-asym", "w4a8-int8", "nvfp4", "mxfp4",
                          "w2a16"])
def test_layout_matches_declared_and_dequant_round_trip(name):
    sc = get_scheme(name)
    w = torch.randn(SHAPE)
    qw = quantize_weight(w, sc)
    layout = stored_layout(sc, *SHAPE, dtype=w.dtype)
    assert {k: (tuple(t.shape), t.dtype) for k, t in qw.tensors().items()} == layout
    d = qw.dequantize()
    assert d.shape == SHAPE
    # quantizing the dequantized weight is a fixed point (codes already on the grid)
    if name not in ("w4a16-asym", "w2a16", "nvfp4"):  # their scales depend on min/max rounding
        assert torch.allclose(quantize_weight(d, sc).dequantize(), d, rtol=1e-6, atol=1e-7)
    assert qw.codes().shape == SHAPE


def test_activation_quantizers():
    x = torch.randn(7, 200) * 3
    x[2] = 0
    q, s = ref.quantize_activations(x, "int8")
    assert q.dtype == torch.int8 and s[2] == 1 and torch.all(q[2] == 0)
    assert torch.all((q.float() * s[:, None] - x).abs() <= s[:, None] / 2 * (1 + 1e-5))
    q8, s8 = ref.quantize_activations(x, "fp8")
    assert q8.dtype == torch.float8_e4m3fn
    assert torch.allclose(s8[[0, 1]], x[[0, 1]].abs().amax(1) / 448)


def test_reference_linear_exact_mode_matches_manual():
    sc = get_scheme("w8a8-int8")
    w, x = torch.randn(16, 64), torch.randn(3, 64)
    qw = quantize_weight(w, sc)
    qx, sx = ref.quantize_activations(x, "int8")
    manual = (qx.double() @ qw.qdata.double().T) * sx.double()[:, None] * qw.scales.double()[None]
    assert torch.allclose(reference_linear(x.double(), qw), manual, rtol=1e-12)


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-asym", "nvfp4", "w8a8-fp8"])
def test_a_row_block_dequantizes_to_those_rows(scheme):
    """``QuantizedWeight.rows`` (the dense copy's partial refresh, the w4 slab repack) is a view
    whose values are those rows of the whole weight, a per-tensor scale included."""
    qw = quantize_weight(torch.randn(96, 256, generator=torch.Generator().manual_seed(5)), scheme)
    part = qw.rows(32, 80)
    assert part.shape == (48, 256) and part.qdata.data_ptr() == qw.qdata[32].data_ptr()
    assert torch.equal(part.dequantize(torch.float32), qw.dequantize(torch.float32)[32:80])
