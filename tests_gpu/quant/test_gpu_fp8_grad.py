"""quant.backward=fp8 on the GPU: cuBLASLt's fp8 GEMMs give the rounded gradient's exact
products at the learner's shapes, and a compiled aligned model trains through them."""

from __future__ import annotations

import pytest
import torch

from quarl.learner.logprobs import sequence_logprobs
from quarl.model.compiled_ops import COMPILED_OPS
from quarl.model.presets import build_random_model
from quarl.quant import fp8_grad, quantize_model, quantize_weight, set_fp8_backward
from quarl.quant import reference as ref

DEV = torch.device("cuda")


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("m, n, k", [(6150, 2 * 8960, 1536), (6150, 1536, 8960), (37, 2048, 1536)])
def test_fp8_gradient_gemms_are_the_rounded_gradients_exact_products(m, n, k):
    gy = torch.randn(m, n, device=DEV).bfloat16()
    qw = quantize_weight(torch.randn(n, k, device=DEV).bfloat16(), "w8a8-fp8")
    xq, sx = ref.quantize_activations(torch.randn(m, k, device=DEV), "fp8")
    gx = fp8_grad.grad_input(gy, qw.qdata, qw.scales, torch.bfloat16)
    g8, s8 = ref.quantize_activations(gy.float() * qw.scales[None, :], "fp8")
    assert _rel(gx, (g8.double() * s8.double()[:, None]) @ qw.qdata.double()) < 5e-3  # (bf16 output)
    gw = fp8_grad.grad_weight(gy, xq, sx, torch.bfloat16)
    g8, s8 = ref.quantize_activations((gy.float() * sx[:, None]).t(), "fp8")
    assert _rel(gw, (g8.double() * s8.double()[:, None]) @ xq.double()) < 5e-3
    # (a float32 result: the float32 matmul over the same codes, cuBLASLt writes bf16 only)
    assert _rel(fp8_grad.grad_weight(gy, xq, sx, torch.float32), (g8.double() * s8.double()[:, None]) @ xq.double()) < 1e-5
    w_deq, x_seen = qw.qdata.double() * qw.scales.double()[:, None], xq.double() * sx.double()[:, None]
    assert _rel(gx, gy.double() @ w_deq) < 2**-4 and _rel(gw, gy.double().t() @ x_seen) < 2**-4


def test_a_compiled_aligned_fp8_model_with_an_fp8_backward():
    """Every layer runs as the compiled regions; the log-probs are the bf16 backward's (the
    forward is the same), the gradients within e4m3's rounding of its."""
    torch.manual_seed(1)
    model = build_random_model("100m", dtype=torch.bfloat16).to(DEV)
    quantize_model(model, "w8a8-fp8")
    ids = torch.randint(0, model.config.vocab_size, (3, 260), device=DEV)
    mask = torch.ones_like(ids)
    mask[2, 200:] = 0
    g = torch.randn(3, 259, device=DEV) * mask[:, 1:]
    out = {}
    for on in (False, True):
        set_fp8_backward(model, on)
        model.zero_grad()
        before = COMPILED_OPS.fallbacks
        lp, _ = sequence_logprobs(model, ids, mask, right_padded=True, ops=COMPILED_OPS)
        (lp * g).sum().backward()
        assert COMPILED_OPS.fallbacks == before
        out[on] = lp.detach(), torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    assert torch.equal(out[True][0], out[False][0])
    assert 0 < _rel(out[True][1], out[False][1]) < 0.1
