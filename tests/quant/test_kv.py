"""The fp8 KV-cache format (quarl.quant.kv) against hand-computed values and float64 math."""

from __future__ import annotations

import pytest
import torch

from quarl.quant.kv import KV_AMAX_FLOOR, dequantize_kv, fake_quantize_kv, quantize_kv


def _e4m3_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite non-negative e4m3fn value (float64) and its byte, ascending."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7f is NaN
    return codes.view(torch.float8_e4m3fn).double(), codes


def _reference_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 statement of the format: r = fp32(max(amax, floor) / 448), s = the power of
    two at or above r, t = x / s (exact), the nearest e4m3 value to |t| (ties to the even
    code), sign restored. (An fp32 quotient rounded through float64 equals the fp32
    division: 53 >= 2 * 24 + 2.)"""
    xd = x.double()
    r = (xd.abs().amax(-1).clamp_min(KV_AMAX_FLOOR) / 448).float().double()
    m, e = torch.frexp(r)  # r = m 2^e, m in [0.5, 1)
    s = torch.where(m == 0.5, r, torch.ldexp(torch.ones_like(r), e))
    t = xd / s[..., None]
    assert (t.abs() <= 448).all()
    values, codes = _e4m3_grid()
    a = t.abs().clamp_max(448.0).flatten()
    dist = (a[:, None] - values[None, :]).abs()
    best = dist.min(1, keepdim=True).values
    tied = dist == best
    # among the (at most two) nearest values, the even code (mantissa lsb 0)
    pick = torch.where(tied & (codes[None, :] % 2 == 0), 1, 0) + tied.int()
    idx = pick.argmax(1)
    byte = codes[idx] | (torch.signbit(t.flatten()).to(torch.uint8) << 7)
    return byte.view(t.shape), s.float()


def test_known_values_round_trip():
    # amax 448: scale 1, and 1, -2, 0.5, 448 are e4m3 values
    x = torch.tensor([[448.0, 1.0, -2.0, 0.5]])
    codes, s = quantize_kv(x)
    assert s.tolist() == [1.0]
    assert codes.float().tolist() == [[448.0, 1.0, -2.0, 0.5]]
    assert dequantize_kv(codes, s, torch.float32).tolist() == [[448.0, 1.0, -2.0, 0.5]]
    # amax 7: s = fp32(7 / 448) = 1/64 exactly; x / s = 64 x
    codes, s = quantize_kv(torch.tensor([[7.0, -0.25, 3.0]]))
    assert s.tolist() == [1 / 64]
    assert codes.float().tolist() == [[448.0, -16.0, 192.0]]


def test_rounding_ties_go_to_the_even_code():
    # s = 1 (amax 448). e4m3 spacing is 2 in [16, 32) and 32 in [256, 448]:
    # ties 17 -> 16 (mantissa 000b), 19 -> 20 (010b), 272 -> 256, 304 -> 320; no ties: 18.5 and 18.9 -> 18
    x = torch.tensor([[448.0, 17.0, 19.0, 272.0, 304.0, -17.0, 18.5, 18.9]])
    codes, _ = quantize_kv(x)
    assert codes.float().tolist() == [[448.0, 16.0, 20.0, 256.0, 320.0, -16.0, 18.0, 18.0]]


def test_power_of_two_scales_put_the_row_maximum_in_224_to_448():
    # amax 56 = 448 / 8: s = 1/8 exactly, the maximum codes to 448
    codes, s = quantize_kv(torch.tensor([[56.0, -56.0, 1.0]]))
    assert s.tolist() == [0.125] and codes.float().tolist() == [[448.0, -448.0, 8.0]]
    # just above: the quotient 0.12500001 rounds the scale up to 1/4, the maximum codes to 224
    codes, s = quantize_kv(torch.tensor([[56.00001, 3.0]]))
    assert s.tolist() == [0.25] and codes.float().tolist() == [[224.0, 12.0]]
    # 4.68228816986084 / 448 = 0.01045..: s = 2^-6, 4.682 / s = 299.67 -> 288 (spacing 32 there)
    a = torch.tensor(4.68228816986084)
    codes, s = quantize_kv(torch.stack([a, -a])[None])
    assert s.tolist() == [2.0**-6] and codes.float().tolist() == [[288.0, -288.0]]


def test_zero_rows_get_zero_codes_and_a_normal_scale():
    x = torch.zeros(2, 3, 8, dtype=torch.bfloat16)
    x[1, 2] = torch.randn(8).to(torch.bfloat16)
    codes, s = quantize_kv(x)
    assert s[0, 0] == 2.0**-108 and s[0, 0] >= KV_AMAX_FLOOR / 448  # 2^-100 / 448 = 2^-108.8, rounded up
    assert (codes[0].view(torch.uint8) == 0).all()
    assert dequantize_kv(codes, s, torch.bfloat16)[0].eq(0).all()
    assert (dequantize_kv(codes, s, torch.bfloat16)[1, 2] != 0).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_rows_match_float64_statement(dtype):
    torch.manual_seed(1)
    x = (torch.randn(6, 4, 64) * torch.logspace(-3, 3, 6)[:, None, None]).to(dtype)
    x[0, 0, :] = 0  # a zero row
    x[1, 1, 5] = 2.0 ** -130 if dtype != torch.float16 else 0.0  # subnormal input
    codes, s = quantize_kv(x)
    ref_codes, ref_s = _reference_codes(x)
    assert codes.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(s, ref_s)
    assert torch.equal(codes.view(torch.uint8), ref_codes)
    # value = code * s, exact in the model dtype (float64 product, no rounding on the way)
    want = codes.double() * s.double()[..., None]
    got = dequantize_kv(codes, s, dtype)
    assert got.dtype == dtype
    if dtype != torch.float16:  # (fp16's narrow exponent range can flush the smallest values)
        assert torch.equal(got.double(), want)
    # 3 mantissa bits: error at most 2^-4 of the row maximum (+ the model dtype's rounding)
    amax = x.float().abs().amax(-1, keepdim=True)
    err = (got.float() - x.float()).abs()
    assert (err <= amax * (2.0**-4 + 2.0**-7)).all()


def test_fake_quantize_is_dequantize_of_quantize_with_identity_gradient():
    torch.manual_seed(2)
    x = torch.randn(3, 5, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    y = fake_quantize_kv(x)
    assert torch.equal(y.detach(), dequantize_kv(*quantize_kv(x.detach()), torch.bfloat16))
    assert not torch.equal(y.detach(), x.detach())
    w = torch.randn_like(y)
    (y * w).sum().backward()
    assert torch.equal(x.grad, w)


def test_compiled_round_trip_equals_eager_bit_for_bit():
    """The learner's fused fake quantizer (torch.compile; inductor on CPU here) gives the very
    values of the eager one, for one-row and two-row batches alike (no recompile needed)."""
    torch.manual_seed(4)
    for shape in ((1, 37, 2, 64), (2, 19, 2, 64)):
        x = (torch.randn(shape) * torch.logspace(-6, 4, shape[1])[None, :, None, None]).to(torch.bfloat16)
        x[0, 0, 0] = 0
        eager = fake_quantize_kv(x, fused=False)
        assert torch.equal(fake_quantize_kv(x, fused=True), eager)
        xg = x.clone().requires_grad_()
        fake_quantize_kv(xg, fused=True).float().sum().backward()
        assert torch.equal(xg.grad, torch.ones_like(x))


def test_compiled_round_trip_compiles_once_for_the_learners_views():
    """The learner hands the fused fake quantizer K and V as slices of one projection (other
    strides than a contiguous tensor), with and without grad, at many lengths: after the first
    compile none of them may compile it again (each recompile cost seconds of a GPU step)."""
    torch.manual_seed(5)
    fake_quantize_kv(torch.randn(1, 8, 2, 64).to(torch.bfloat16), fused=True)  # compiled (or cached) once
    with torch._dynamo.config.patch(error_on_recompile=True):
        for b, t in ((1, 13), (2, 40), (3, 7)):
            qkv = torch.randn(b, t, 12, 64).to(torch.bfloat16)
            k, v = qkv[:, :, 8:10], qkv[:, :, 10:]  # strides of the fused projection, not contiguous
            for x in (k, v, k.contiguous(), k.clone().requires_grad_()):
                got = fake_quantize_kv(x, fused=True)
                assert torch.equal(got.detach(), fake_quantize_kv(x.detach(), fused=False))
            with torch.no_grad():
                fake_quantize_kv(v, fused=True)
