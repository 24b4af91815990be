"""quant.backward=fp8: the aligned w8a8-fp8 linear's backward GEMMs in fp8 on the forward's codes."""

import pytest
import torch
from torch import nn

from quarl.config import ConfigError
from quarl.quant import QATLinear, fp8_grad, quantize_weight, set_fp8_backward
from quarl.quant import reference as ref
from quarl.quant.linear import qat_group, traced_linear, traced_qat

E4M3_REL = 2.0**-4  # e4m3's relative rounding error, at most (3 mantissa bits)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("m, n, k", [(37, 48, 64), (64, 32, 40), (5, 16, 16)])  # M not /16: padded; K=40: no cuBLASLt
def test_grad_input_and_weight_are_the_exact_gradients_of_an_e4m3_rounded_gradient(m, n, k):
    """Each GEMM is the float64 product of the gradient (times the other operand's scale)
    rounded to e4m3 per row, and the forward's codes as they are: the only rounding; and
    that rounding stays within e4m3's precision of the bf16 backward's values."""
    torch.manual_seed(m * n + k)
    gy = torch.randn(m, n, dtype=torch.bfloat16)
    qw = quantize_weight(torch.randn(n, k).bfloat16(), "w8a8-fp8")
    xq, sx = ref.quantize_activations(torch.randn(m, k) * torch.rand(m, 1) * 4, "fp8")
    w_deq, x_seen = qw.qdata.double() * qw.scales.double()[:, None], xq.double() * sx.double()[:, None]

    gx = fp8_grad.grad_input(gy, qw.qdata, qw.scales, torch.float32)
    g8, s8 = ref.quantize_activations(gy.double() * qw.scales.double()[None, :], "fp8")  # per row m
    torch.testing.assert_close(gx.double(), (g8.double() * s8.double()[:, None]) @ qw.qdata.double(),
                               rtol=1e-5, atol=1e-5)
    assert 0 < _rel(gx, gy.double() @ w_deq) < E4M3_REL

    gw = fp8_grad.grad_weight(gy, xq, sx, torch.float32)
    g8, s8 = ref.quantize_activations((gy.double() * sx.double()[:, None]).T, "fp8")  # per column n of gy
    torch.testing.assert_close(gw.double(), (g8.double() * s8.double()[:, None]) @ xq.double(), rtol=1e-5, atol=1e-5)
    assert 0 < _rel(gw, gy.double().T @ x_seen) < E4M3_REL


def test_a_zero_gradient_gives_zero_gradients():
    qw = quantize_weight(torch.randn(32, 48).bfloat16(), "w8a8-fp8")
    xq, sx = ref.quantize_activations(torch.randn(7, 48), "fp8")
    gy = torch.zeros(7, 32, dtype=torch.bfloat16)
    assert not fp8_grad.grad_input(gy, qw.qdata, qw.scales, torch.float32).any()
    assert not fp8_grad.grad_weight(gy, xq, sx, torch.float32).any()


def _pair(bias: bool = True):
    torch.manual_seed(1)
    lin = nn.Linear(64, 48, bias=bias).bfloat16()
    a, b = QATLinear.from_linear(lin, "w8a8-fp8"), QATLinear.from_linear(nn.Linear(64, 48, bias=bias).bfloat16(),
                                                                          "w8a8-fp8")
    with torch.no_grad():
        b.weight.copy_(a.weight)
        if bias:
            b.bias.copy_(a.bias)
    b.fp8_backward = True
    return a, b


def test_qat_linear_with_fp8_backward_has_the_same_forward_and_close_gradients():
    a, b = _pair()
    x = torch.randn(3, 11, 64, dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    gy = torch.randn(3, 11, 48, dtype=torch.bfloat16)
    ya, yb = a(xa), b(xb)
    assert torch.equal(ya, yb)  # the engine's forward either way
    ya.backward(gy)
    yb.backward(gy)
    assert 0 < _rel(xb.grad, xa.grad) < E4M3_REL and 0 < _rel(b.weight.grad, a.weight.grad) < E4M3_REL
    assert torch.equal(b.bias.grad, a.bias.grad)  # (no GEMM: the same sum)


def test_traced_linear_with_fp8_backward_matches_the_autograd_function():
    """The compiled regions' form (:func:`traced_linear`) gives what the eager autograd
    function gives, forward and gradients, with the flag on."""
    a, b = _pair(bias=False)
    a.fp8_backward = True
    x = torch.randn(2, 9, 64, dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    gy = torch.randn(2, 9, 48, dtype=torch.bfloat16)
    ya = a(xa)
    lin = traced_qat(xb, b.quantized_weight(), None, b.repacked, b._leaf, [b.weight], True)
    assert lin[0] == "quantized_input" and lin[-1] is True
    yb = traced_linear(xb, lin)
    torch.testing.assert_close(yb, ya, rtol=0, atol=0)
    ya.backward(gy)
    yb.backward(gy)
    b._leaf.flush()  # (the dequantized leaf hands its gradient to the master)
    assert torch.equal(xb.grad, xa.grad) and torch.equal(b.weight.grad, a.weight.grad)


def test_set_fp8_backward_reaches_groups_and_refuses_other_schemes():
    owner = nn.Module()
    owner.gate_proj = QATLinear.from_linear(nn.Linear(32, 48, bias=False), "w8a8-fp8")
    owner.up_proj = QATLinear.from_linear(nn.Linear(32, 48, bias=False), "w8a8-fp8")
    set_fp8_backward(owner)
    assert owner.gate_proj.fp8_backward and owner.up_proj.fp8_backward
    group = qat_group(owner, ("gate_proj", "up_proj"))
    x = torch.randn(6, 32, requires_grad=True)
    group.stacked(x).sum().backward()
    assert owner.gate_proj.weight.grad is not None and x.grad is not None
    mixed = nn.Module()  # members that disagree do not run as one GEMM
    mixed.gate_proj, mixed.up_proj = owner.gate_proj, QATLinear.from_linear(nn.Linear(32, 48, bias=False), "w8a8-fp8")
    assert qat_group(mixed, ("gate_proj", "up_proj")) is None
    other = nn.Module()
    other.lin = QATLinear.from_linear(nn.Linear(32, 48), "w4a16")
    with pytest.raises(ValueError, match="fp8 activation codes.*w4a16.*quant.scheme=w8a8-fp8"):
        set_fp8_backward(other)
    set_fp8_backward(other, False)  # off: any scheme


def test_config_refuses_fp8_backward_without_an_fp8_forward():
    from quarl.config import load_run_config

    cfg = load_run_config(None, ["--quant.mode=aligned", "--quant.scheme=w8a8-fp8", "--quant.backward=fp8"])
    assert cfg.quant.backward == "fp8"
    for bad in (["--quant.mode=aligned", "--quant.scheme=w4a16"], ["--quant.mode=rollout", "--quant.scheme=w8a8-fp8"],
                ["--quant.mode=bf16"]):
        with pytest.raises(ConfigError, match="quant.backward=fp8.*quant.mode=aligned with quant.scheme=w8a8-fp8"):
            load_run_config(None, [*bad, "--quant.backward=fp8"])
