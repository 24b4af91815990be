import pytest
import torch

from quarl.quant import quantize_weight, rel_quant_err, rel_update, update_visible_frac


def test_rel_update_eq13():
    old = torch.tensor([3.0, 4.0])
    new = torch.tensor([3.0, 5.0])
    # ||new - old||^2 / ||old||^2 = 1 / 25
    assert abs(rel_update(new, old) - 1 / 25) < 1e-12
    assert abs(rel_update({"a": new, "b": old}, {"a": old, "b": old}) - 1 / 50) < 1e-12
    # a learner's update (~1e-4 of the weight) against float64, bf16 weights included
    w = {"x": torch.randn(64, 256), "y": torch.randn(32, 512).bfloat16()}
    w2 = {k: v + (1e-4 * torch.randn_like(v.float())).to(v.dtype) for k, v in w.items()}
    num = sum((w2[k].double() - w[k].double()).pow(2).sum() for k in w)
    den = sum(w[k].double().pow(2).sum() for k in w)
    assert rel_update(w2, w) == pytest.approx(float(num / den), rel=1e-5)


def test_rel_quant_err_eq14():
    w = torch.randn(16, 128)
    qw = quantize_weight(w, "w4a16")
    expect = float((qw.dequantize(torch.float64) - w.double()).pow(2).sum() / w.double().pow(2).sum())
    assert rel_quant_err(w, qw) == pytest.approx(expect, rel=1e-6)  # (norms accumulated in float32)
    # (x4: the bf16 scales scale exactly)
    assert rel_quant_err({"a": w, "b": w * 4}, {"a": qw, "b": quantize_weight(w * 4, "w4a16")}) == pytest.approx(
        expect, rel=1e-6)
    assert rel_quant_err(w, quantize_weight(w, "bf16")) == 0.0


def test_update_visible_frac():
    w = torch.randn(16, 128) * 0.02
    qa = quantize_weight(w, "w8a8-int8")
    assert update_visible_frac(qa, qa) == 0.0
    tiny = w + 1e-9  # far below the grid: invisible
    assert update_visible_frac(qa, quantize_weight(tiny, "w8a8-int8")) == 0.0
    big = w.clone()
    big[:8] += 0.01  # changes most codes of half of the rows (per-row scales: the rest stay)
    frac = update_visible_frac(qa, quantize_weight(big, "w8a8-int8"))
    assert 0.3 < frac <= 0.5
    q4a, q4b = quantize_weight(w, "w4a16"), quantize_weight(-w, "w4a16")
    assert update_visible_frac({"x": q4a}, {"x": q4b}) > 0.8
