import torch

from quarl.quant import QATLinear, apply_uaq, quantize_model, remove_uaq
from quarl.quant.metrics import rel_quant_err
from quarl.quant.qweight import quantize_weight
from tests.quant.test_linear import tiny_model

SCALED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")


def _scaled_weights(model):
    return {f"{i}.{n}": layer.get_submodule(n).weight.detach().clone()
            for i, layer in enumerate(model.layers) for n in SCALED}


@torch.no_grad()
def test_uaq_leaves_outputs_unchanged_float64():
    model = tiny_model(torch.float64, layers=3)
    ids = torch.randint(0, 64, (2, 11))
    before = model(ids)
    apply_uaq(model, 1.5)
    after = model(ids)
    assert float((after - before).norm() / before.norm()) < 1e-10
    remove_uaq(model, 1.5)
    assert float((model(ids) - before).norm() / before.norm()) < 1e-10


def test_uaq_scales_the_right_tensors():
    model = tiny_model(torch.float64)
    w0 = _scaled_weights(model)
    n0 = model.layers[0].input_layernorm.weight.detach().clone()
    o0 = model.layers[0].self_attn.o_proj.weight.detach().clone()
    apply_uaq(model, 2.0)
    w1 = _scaled_weights(model)
    assert all(torch.allclose(w1[k], w0[k] / 2) for k in w0)
    assert torch.allclose(model.layers[0].input_layernorm.weight, n0 * 2)
    assert torch.equal(model.layers[0].self_attn.o_proj.weight, o0)


def test_uaq_shrinks_w4a16_quantization_error_of_scaled_weights():
    model = tiny_model(torch.float64)
    w0 = _scaled_weights(model)
    err0 = sum(float((quantize_weight(w, "w4a16").dequantize(torch.float64) - w).pow(2).sum()) for w in w0.values())
    apply_uaq(model, 1.5)
    w1 = _scaled_weights(model)
    err1 = sum(float((quantize_weight(w, "w4a16").dequantize(torch.float64) - w).pow(2).sum()) for w in w1.values())
    # absolute error scales by 1/s (squared: 1/s^2); relative error is unchanged (up to the
    # rounding of the group scales to bf16, which a factor of 1.5 does not commute with)
    assert abs(err1 / err0 * 1.5**2 - 1) < 1e-3
    q1 = {k: quantize_weight(w, "w4a16") for k, w in w1.items()}
    q0 = {k: quantize_weight(w, "w4a16") for k, w in w0.items()}
    assert abs(rel_quant_err(w1, q1) / rel_quant_err(w0, q0) - 1) < 1e-3


def test_uaq_on_qat_model_invalidates_cache():
    model = tiny_model()
    quantize_model(model, "w4a16", QATLinear)
    q = model.layers[0].self_attn.q_proj
    qw = q.publish()
    apply_uaq(model, 1.5)
    assert q.publish() is not qw
