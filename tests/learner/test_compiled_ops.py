"""The learner's compiled forward steps (torch.compile, inductor on CPU here) give the
eager model's hidden states and gradients, with and without q/k norm, over two shapes
(dynamic shapes: no recompilation is needed for a new batch)."""

from __future__ import annotations

import pytest
import torch

from quarl.model import Transformer, TransformerConfig
from quarl.learner.compiled_ops import COMPILED_OPS
from quarl.model.transformer import TORCH_OPS, batch_attention


def _eager_then_compiled(model: Transformer, ids, pos, attn, w) -> list[tuple[torch.Tensor, dict]]:
    """Hidden states and every parameter's gradient of ``(h * w).sum()``: eager, then compiled."""
    out = []
    for ops in (TORCH_OPS, COMPILED_OPS):
        model.zero_grad()
        h = model.hidden_states(ids, pos, attn, ops)
        (h * w).sum().backward()
        out.append((h.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return out


@pytest.mark.parametrize("qk_norm", [True, False])
def test_compiled_ops_match_eager_values_and_grads(qk_norm):
    cfg = TransformerConfig(
        model_type="qwen3" if qk_norm else "qwen2", vocab_size=50, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=qk_norm,
        attention_bias=not qk_norm,
    )
    torch.manual_seed(3)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    for shape in ((3, 9), (2, 14)):
        ids = torch.randint(0, 50, shape)
        mask = torch.ones(shape, dtype=torch.long)
        mask[0, -2:] = 0
        pos, attn = batch_attention(ids, mask)
        w = torch.randn(*shape, 32)
        (h0, g0), (h1, g1) = _eager_then_compiled(model, ids, pos, attn, w)
        torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-5)
        assert g0.keys() == g1.keys() and len(g0) > 10
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=n)


def test_one_row_then_two_rows_does_not_recompile():
    """A first micro-batch of one row must not specialise the compiled steps to one row:
    later micro-batches of 2 and 3 rows reuse the graphs (a recompile costs seconds mid-step
    on a GPU)."""
    from torch._dynamo.utils import counters

    cfg = TransformerConfig(
        model_type="qwen3", vocab_size=40, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=12, qk_norm=True,
    )
    torch.manual_seed(5)
    model = Transformer(cfg).to(torch.bfloat16)  # a dtype the other tests do not compile for

    def run(rows, t):
        ids = torch.randint(0, 40, (rows, t))
        pos, attn = batch_attention(ids)
        model.hidden_states(ids, pos, attn, COMPILED_OPS).float().sum().backward()

    run(1, 11)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    for rows, t in ((2, 7), (3, 13), (1, 5)):
        run(rows, t)
    assert counters["stats"]["unique_graphs"] == graphs


def _qwen2_model(hidden: int, intermediate: int, head_dim: int, seed: int) -> Transformer:
    """Two qwen2 layers (q/k/v biases) with weights ~ N(0, 0.3)."""
    cfg = TransformerConfig(
        model_type="qwen2", vocab_size=50, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, attention_bias=True,
    )
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_ops_with_fp8_kv_fake_quant_match_eager(dtype, monkeypatch):
    """The learner's K/V rounding for an fp8 engine cache (``kv_quant="fp8"``): eagerly in the
    attention callable (an autograd function per tensor), in the compiled regions inside the
    region that makes K and V (no call of that function). Compiled and eager forwards agree
    (bf16: the rounded K/V bit for bit, so the hidden states within bf16 rounding), gradients
    too, and the rounding is really applied (the hidden states differ from the unrounded ones)."""
    from quarl.quant import kv

    model = _qwen2_model(hidden=32, intermediate=48, head_dim=8, seed=3).to(dtype)
    ids = torch.randint(0, 50, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, -2:] = 0
    w = torch.randn(3, 9, 32, dtype=dtype)
    calls = []
    monkeypatch.setattr(kv._FakeQuantizeKV, "apply", lambda *a, _f=kv._FakeQuantizeKV.apply: calls.append(1) or _f(*a))
    out = {}
    fallbacks = COMPILED_OPS.fallbacks
    for kv_quant, ops in ((None, None), ("fp8", None), ("fp8", COMPILED_OPS)):
        pos, attn = batch_attention(ids, mask, kv_quant=kv_quant)
        model.zero_grad()
        n = len(calls)
        h = model.hidden_states(ids, pos, attn) if ops is None else model.hidden_states(ids, pos, attn, ops)
        (h.float() * w.float()).sum().backward()
        assert (len(calls) - n) == (4 if kv_quant and ops is None else 0)  # 2 layers x K, V eagerly
        out[kv_quant, ops is not None] = (h.detach().float(), model.layers[0].self_attn.k_proj.weight.grad.float())
    assert COMPILED_OPS.fallbacks == fallbacks
    (h_plain, _), (h_eager, g_eager), (h_comp, g_comp) = out.values()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h_comp, h_eager, **tol)
    torch.testing.assert_close(g_comp, g_eager, rtol=1e-4 if dtype == torch.float32 else 5e-2,
                               atol=1e-5 if dtype == torch.float32 else 5e-2)
    assert (h_eager - h_plain).abs().max() > 1e-3


def test_kv_seen_is_the_fp8_round_trip_with_an_identity_gradient():
    """:func:`~quarl.quant.kv.kv_seen` (the compiled regions' K/V rounding) gives the round
    trip's values bit for bit (bf16 and float32 rows, wide and tiny magnitudes) and passes the
    gradient through unchanged, as the eager straight-through function does."""
    from quarl.quant.kv import fake_quantize_kv, kv_seen

    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(5, 7, 2, 16) * torch.logspace(-6, 4, 7)[None, :, None, None]).to(dtype).requires_grad_()
        y = kv_seen(x)
        assert y.dtype == dtype and torch.equal(y, fake_quantize_kv(x.detach(), fused=False))
        assert not torch.equal(y, x.detach())
        g = torch.randn_like(x)
        y.backward(g)
        assert torch.equal(x.grad, g)


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8-int8", "nvfp4"])
def test_compiled_ops_run_aligned_projections_grouped_with_the_eager_values(scheme):
    """An aligned (QAT) model under the compiled steps runs q/k/v and gate/up as one QAT GEMM
    each (not nvfp4: a per-tensor scale): hidden states and every master weight's gradient
    match the eager forward that runs them one by one."""
    from quarl.quant import quantize_model
    from quarl.quant.linear import qat_group

    model = _qwen2_model(hidden=64, intermediate=96, head_dim=16, seed=4)
    quantize_model(model, scheme)
    ids = torch.randint(0, 50, (3, 9))
    pos, attn = batch_attention(ids)
    w = torch.randn(3, 9, 64)
    (h0, g0), (h1, g1) = _eager_then_compiled(model, ids, pos, attn, w)
    grouped = qat_group(model.layers[0].mlp, ("gate_proj", "up_proj")) is not None
    assert grouped == (scheme != "nvfp4")
    torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and "layers.0.self_attn.k_proj.weight" in g0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("scheme,straight_through", [(None, False), ("w4a16", False), ("w8a8-int8", False),
                                                     ("w8a8-fp8", False), ("w4a16", True), ("w8a8-fp8", True)])
def test_layers_run_as_compiled_regions_with_the_eager_values(scheme, straight_through, monkeypatch):
    """Every layer of a plain model, and of an aligned one whose engine GEMM is a matmul over
    the dequantized weight (w4a16 at the learner's batch sizes, forced here: on the CPU the
    engine runs the reference kernel) or quantizes activations (W8A8, through the
    ``quarl::quantized_input_gemm`` op), runs as two compiled regions: no layer falls
    back to the step-by-step path, and the hidden states and every weight's gradient equal
    the eager forward's (which runs the same path outside a compiled region). Also with the
    weights dequantized per use and a straight-through gradient carried by autograd (a sharded
    learner's, ``set_straight_through``) against the eager per-use autograd function."""
    from quarl.quant import linear, quantize_model

    model = _qwen2_model(hidden=64, intermediate=96, head_dim=16, seed=6)
    if scheme is not None:
        quantize_model(model, scheme)
    if straight_through:
        linear.set_straight_through(model)
    if scheme == "w4a16":
        monkeypatch.setattr(linear, "learner_runs_dequantized", lambda x, qw: True)
    fallbacks = COMPILED_OPS.fallbacks
    ids = torch.randint(0, 50, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, -3:] = 0
    pos, attn = batch_attention(ids, mask)
    w = torch.randn(2, 11, 64)
    (h0, g0), (h1, g1) = _eager_then_compiled(model, ids, pos, attn, w)
    assert COMPILED_OPS.fallbacks == fallbacks
    torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and "layers.1.mlp.up_proj.weight" in g0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("scheme", ["w8a8-int8", "w8a8-fp8"])
def test_quantized_input_linear_is_a_well_formed_op_with_a_straight_through_gradient(scheme):
    """``quarl::quantized_input_gemm`` passes torch.library's checks (schema, fake tensor,
    AOT dispatch) and gives the engine's output on the codes it is handed; the aligned linear
    around it (:func:`traced_linear`) has the straight-through gradients, computed here in
    float64."""
    from quarl.quant import ops
    from quarl.quant import reference as ref
    from quarl.quant.traced import _quantized_input_gemm, traced_linear
    from quarl.quant.qweight import quantize_weight

    torch.manual_seed(7)
    x = torch.randn(2, 5, 32)
    master = torch.randn(24, 32) * 0.2
    qw = quantize_weight(master, scheme)
    w_deq = qw.dequantize(torch.float32).requires_grad_(True)
    bias = torch.randn(24, requires_grad=True)
    xq, sx = ref.quantize_activations(x.reshape(-1, 32), qw.scheme.act_format)
    args = (xq, sx, bias.detach(), qw.qdata, qw.scales, qw.zeros, scheme, 24, torch.float32)
    # (the schema check's mode runs CPU e4m3 arithmetic that has no kernel: fp8 skips that one check)
    checks = ("test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(_quantized_input_gemm, args,
                          test_utils=checks if scheme == "w8a8-fp8" else checks + ("test_schema",))
    torch.testing.assert_close(_quantized_input_gemm(*args).view(2, 5, 24), ops.quant_linear(x, qw, bias.detach()))
    xr = x.clone().requires_grad_(True)
    y = traced_linear(xr, ("quantized_input", w_deq, bias, qw.qdata, qw.scales, qw.zeros, scheme))
    torch.testing.assert_close(y, ops.quant_linear(x, qw, bias.detach()))
    g = torch.randn_like(y)
    (y * g).sum().backward()
    seen = ref.dequantize_activations(xq, sx, x.dtype)
    g64, seen64 = g.double().reshape(-1, 24), seen.double()
    tol = {"rtol": 1e-5, "atol": 1e-5}  # float32 sums against float64 ones
    torch.testing.assert_close(xr.grad.double(), (g64 @ w_deq.detach().double()).view(2, 5, 32), **tol)
    torch.testing.assert_close(w_deq.grad.double(), g64.t() @ seen64, **tol)
    torch.testing.assert_close(bias.grad.double(), g64.sum(0), **tol)


@pytest.mark.parametrize("scheme,qk_norm", [(None, True), ("w8a8-fp8", False)])
def test_compiled_regions_index_rows_with_constants(scheme, qk_norm):
    """The code inductor generates for a layer's forward and backward addresses every element
    with constant strides: no per-element division by the dynamic batch / time sizes and no
    ``Max(1, T)`` strides (a tensor made as ``[B, T, N]`` with both unbacked gets them, and the
    GPU kernels that mixed the two layouts ran the fused SwiGLU backward at a quarter of its
    bandwidth). The aligned W8A8 layer (stacked gate/up, the quantizer in the region) included."""
    import re

    from torch._inductor.utils import run_and_get_code

    from quarl.learner.compiled_ops import CompiledOps
    from quarl.quant import QATLinear, quantize_model

    cfg = TransformerConfig(
        model_type="qwen3" if qk_norm else "qwen2", vocab_size=50, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=qk_norm,
        attention_bias=not qk_norm,
    )
    torch.manual_seed(0)
    model = Transformer(cfg).to(torch.bfloat16)
    if scheme:
        quantize_model(model, scheme, QATLinear)
    ids = torch.randint(0, 50, (3, 9))
    pos, attn = batch_attention(ids, torch.ones(3, 9, dtype=torch.long))
    fallbacks = CompiledOps.fallbacks

    def step():
        model.hidden_states(ids, pos, attn, COMPILED_OPS).float().sum().backward()

    torch._dynamo.reset()
    _, codes = run_and_get_code(step)
    code = "\n".join(codes)
    assert CompiledOps.fallbacks == fallbacks and len(codes) >= 4  # every layer ran as regions, fwd + bwd
    assert ("quantized_input_gemm" in code) == bool(scheme)
    assert re.findall(r"div_floor_integer\(static_cast<int64_t>\(x\d+\)|% static_cast<int64_t>\(ks\d", code) == []
    assert "std::max(static_cast<int64_t>(1L), static_cast<int64_t>(ks" not in code


@pytest.mark.parametrize("scheme", [None, "w4a16", "w8a8-int8"])
def test_lora_layers_run_as_compiled_regions_with_the_eager_values(scheme, monkeypatch):
    """A LoRA learner's layers (adapters on every decoder linear but k_proj) run as the two
    compiled regions when every base has a traced form: a bf16 base, or a w4a16 base kept
    dequantized through the update (forced onto the dequantized path here: on the CPU the
    engine runs the reference kernel). Hidden states and the adapters' gradients equal the
    eager forward's; the frozen base gets no gradient. A w4a16 base dequantized per use, and a
    W8A8 base, run step by step (their regions would keep every layer's dense weight alive
    for the backward, or have no traced form), with the same values."""
    from quarl.model.lora import add_lora, lora_modules
    from quarl.quant import QuantLinear, linear, quantize_model
    from quarl.learner.memory import keep_frozen_bases_dense

    model = _qwen2_model(hidden=64, intermediate=96, head_dim=16, seed=7)
    if scheme is not None:
        quantize_model(model, scheme, QuantLinear)
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.learner_path = True
    if scheme == "w4a16":
        monkeypatch.setattr(linear, "learner_runs_dequantized", lambda x, qw: True)
    add_lora(model, rank=4, alpha=8, targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for _, _, ad in lora_modules(model):
            ad.A.copy_(0.2 * torch.randn(ad.A.shape, generator=g))
            ad.B.copy_(0.2 * torch.randn(ad.B.shape, generator=g))
    ids = torch.randint(0, 50, (2, 11))
    pos, attn = batch_attention(ids)
    w = torch.randn(2, 11, 64)
    for kept in ((False, True) if scheme == "w4a16" else (False,)):
        keep_frozen_bases_dense(model, kept)
        fallbacks = COMPILED_OPS.fallbacks
        (h0, g0), (h1, g1) = _eager_then_compiled(model, ids, pos, attn, w)
        regions = scheme is None or (scheme == "w4a16" and kept)
        assert COMPILED_OPS.fallbacks - fallbacks == (0 if regions else 2), (scheme, kept)
        torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-5)
        assert set(g0) == set(g1) == {n for n, p in model.named_parameters() if p.requires_grad}
        assert "layers.1.mlp.down_proj.lora.B" in g0 and not any(".k_proj." in n for n in g0)
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=n)
    keep_frozen_bases_dense(model, False)


def test_lora_base_dequantized_per_use_runs_the_regions_where_nothing_outlives_the_layer(monkeypatch):
    """A w4a16 LoRA base dequantized per use (not kept dense) enters the compiled regions under
    activation checkpointing (the layer's saved tensors, that weight among them, are recomputed)
    and without gradients, and stays step by step otherwise: values and adapter gradients equal
    the eager forward's either way."""
    from quarl.model.lora import add_lora, lora_modules
    from quarl.model.transformer import CheckpointedOps
    from quarl.quant import QuantLinear, linear, quantize_model

    model = _qwen2_model(hidden=64, intermediate=96, head_dim=16, seed=9)
    quantize_model(model, "w4a16", QuantLinear)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.learner_path = True
    monkeypatch.setattr(linear, "learner_runs_dequantized", lambda x, qw: True)
    add_lora(model, rank=4, alpha=8)
    g = torch.Generator().manual_seed(10)
    with torch.no_grad():
        for _, _, ad in lora_modules(model):
            ad.B.copy_(0.2 * torch.randn(ad.B.shape, generator=g))
    ids = torch.randint(0, 50, (2, 11))
    pos, attn = batch_attention(ids)
    w = torch.randn(2, 11, 64)
    out = {}
    for name, ops in (("eager", TORCH_OPS), ("regions", COMPILED_OPS), ("checkpointed", CheckpointedOps(COMPILED_OPS))):
        model.zero_grad()
        fallbacks = COMPILED_OPS.fallbacks
        h = model.hidden_states(ids, pos, attn, ops)
        (h * w).sum().backward()
        out[name] = (h.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                     COMPILED_OPS.fallbacks - fallbacks)
        with torch.no_grad():
            fallbacks = COMPILED_OPS.fallbacks
            torch.testing.assert_close(model.hidden_states(ids, pos, attn, ops), h.detach(), rtol=1e-5, atol=1e-5)
            assert name == "eager" or COMPILED_OPS.fallbacks == fallbacks  # no gradient: regions
    assert out["regions"][2] == 2 and out["checkpointed"][2] == 0
    h0, g0, _ = out["eager"]
    for name in ("regions", "checkpointed"):
        h1, g1, _ = out[name]
        torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-5)
        assert g1.keys() == g0.keys() and len(g0) == 2 * 7 * 2
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=n)


def test_fp8_regions_call_the_scaled_gemm_themselves_and_one_token_runs_step_by_step(monkeypatch):
    """On a GPU an aligned w8a8-fp8 region calls cuBLASLt's row-scaled ``torch._scaled_mm``
    itself instead of the ``quarl::quantized_input_gemm`` op (emulated here: the CPU's
    ``_scaled_mm`` admitted): the region traces with its unbacked row count, gives the eager
    forward's values and gradients, and a one-token batch (a row count the GEMM's shape check
    cannot take) runs the layer step by step."""
    from torch._inductor.utils import run_and_get_code

    from quarl.quant import QATLinear, quantize_model
    from quarl.quant.kernels import w8a8

    monkeypatch.setattr(w8a8, "cublas_fits", lambda xq, n, k: n % 16 == 0 and k % 16 == 0)
    model = _qwen2_model(hidden=64, intermediate=96, head_dim=16, seed=8)
    quantize_model(model, "w8a8-fp8", QATLinear)
    ids = torch.randint(0, 50, (3, 9))
    pos, attn = batch_attention(ids, torch.ones(3, 9, dtype=torch.long))
    w = torch.randn(3, 9, 64)
    torch._dynamo.reset()
    fallbacks = COMPILED_OPS.fallbacks
    ((h0, g0), (h1, g1)), codes = run_and_get_code(lambda: _eager_then_compiled(model, ids, pos, attn, w))
    code = "\n".join(codes)
    assert "_scaled_mm" in code and "quantized_input_gemm" not in code
    assert COMPILED_OPS.fallbacks == fallbacks
    torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and "layers.1.mlp.down_proj.weight" in g0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=n)
    one = torch.randint(0, 50, (1, 1))
    pos1, attn1 = batch_attention(one, torch.ones(1, 1, dtype=torch.long))
    model.hidden_states(one, pos1, attn1, COMPILED_OPS).sum().backward()
    assert COMPILED_OPS.fallbacks == fallbacks + model.config.num_hidden_layers
