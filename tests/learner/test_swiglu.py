"""The stacked SwiGLU's backward: the formula against float64 autograd, the Triton kernel
(under the interpreter on CPU) against the torch-op reference, and eager autograd's rounding
on bf16."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from quarl.learner.swiglu import backward_reference, backward_triton, swiglu_stacked  # noqa: E402


def _eager_grad(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    x = gate_up.detach().clone().requires_grad_(True)
    gate, up = x.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(grad)
    return x.grad


def test_gradient_is_the_float64_derivative():
    torch.manual_seed(0)
    x = torch.randn(5, 2 * 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu_stacked, (x,))
    g = torch.randn(5, 7, dtype=torch.float64)
    y = swiglu_stacked(x)
    gate, up = x.detach().chunk(2, dim=-1)
    torch.testing.assert_close(y, F.silu(gate) * up, rtol=0, atol=0)
    (got,) = torch.autograd.grad(y, x, g)
    sig = torch.sigmoid(gate)
    want = torch.cat([g * up * sig * (1 + gate * (1 - sig)), g * gate * sig], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_reference_rounds_as_eager_autograd_on_bf16():
    torch.manual_seed(1)
    gu = torch.randn(33, 2 * 96, dtype=torch.bfloat16) * 3
    g = torch.randn(33, 96, dtype=torch.bfloat16)
    got, want = backward_reference(gu, g), _eager_grad(gu, g)
    ulp = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)
    assert float(ulp.max()) <= 2**-7  # at most one bf16 ulp (sigmoid's own last bit)
    assert float((got == want).float().mean()) > 0.99


# the interpreter's bf16 rounding truncates: bf16 is checked in tests_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_kernel_equals_the_reference(dtype):
    torch.manual_seed(2)
    ulp = torch.finfo(dtype).eps
    for m, inter in [(3, 40), (17, 1100), (1, 8)]:  # columns past one block and a ragged tail
        gu = torch.randn(m, 2 * inter, dtype=dtype) * 3
        g_wide = torch.randn(m, inter + 5, dtype=dtype)
        g = g_wide[:, :inter]  # rows with a stride of their own
        got, want = backward_triton(gu, g), backward_reference(gu, g)
        assert got.shape == (m, 2 * inter) and got.dtype == dtype
        # a few ulps of the element (exp's last bits), or of the row's scale where 1 + g (1 - s) cancels
        bound = 4 * ulp * (want.double().abs() + want.double().abs().amax())
        assert bool(((got.double() - want.double()).abs() <= bound).all()), (m, inter)
        if dtype != torch.float32:  # float32 outputs carry the math's own last bits
            assert float((got == want).double().mean()) > 0.99
    assert backward_triton(torch.empty(0, 8, dtype=dtype), torch.empty(0, 4, dtype=dtype)).shape == (0, 8)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_codes_of_stacked_rows_are_the_reference_quantizers(fmt):
    """:func:`swiglu_codes` (the learner's W8A8 down-projection input): the persistent kernel
    on the stacked ``[gate; up]`` rows (its ``up`` half a strided view, programs that take
    several rows) gives the codes and scales of the torch-op reference bit for bit; without an
    SM count it is that reference."""
    from quarl.learner.swiglu import codes_reference, swiglu_codes
    from quarl.quant import reference as ref

    torch.manual_seed(3)
    gu = torch.randn(13, 2 * 150) * 3
    gu[4] = 0  # a zero row: scale 1, codes 0
    q_ref, s_ref = codes_reference(gu, fmt)
    gate, up = gu[:, :150], gu[:, 150:]
    y = gate.double() * torch.sigmoid(gate.double()) * up.double()
    qmax = 448.0 if fmt == "fp8" else 127.0
    torch.testing.assert_close(s_ref.double()[s_ref != 1], y.abs().amax(-1)[s_ref != 1] / qmax, rtol=1e-6, atol=0)
    torch.testing.assert_close(ref.dequantize_activations(q_ref, s_ref, torch.float64), y,
                               rtol=0.07 if fmt == "fp8" else 0, atol=0.6 * float(s_ref.max()))
    for sms in (1, 2):  # 4 and 8 programs for 13 rows
        q, s = swiglu_codes(gu, fmt, sms)
        assert q.shape == (13, 150) and q.dtype == q_ref.dtype and s[4] == 1.0
        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    q, s = swiglu_codes(gu, fmt, None)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
