"""QuantLinear / QATLinear: aligned forward, straight-through gradients, publish/load."""

import contextlib

import pytest
import torch
from torch import nn

from quarl.model import Transformer, TransformerConfig
from quarl.quant import (
    QATLinear,
    QuantLinear,
    get_scheme,
    load_published,
    publish_model,
    quantize_model,
    quantize_weight,
    use_backend,
)
from quarl.quant import reference as ref
from quarl.quant.ops import fake_quantize_input

ALL = ["bf16", "w8a8-int8", "w8a8-fp8", "w4a16", "w4a16-asym", "w4a8-int8", "nvfp4", "mxfp4", "w2a16"]


def tiny_model(dtype=torch.float32, layers=2) -> Transformer:
    cfg = TransformerConfig(
        model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )
    torch.manual_seed(0)
    model = Transformer(cfg).to(dtype)
    with torch.no_grad():  # non-trivial norms so UAQ/quantization see realistic inputs
        for layer in model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("name", ALL)
def test_qat_forward_equals_quantlinear_forward_exactly(name, backend):
    """The aligned forward is the engine's: bit for bit, except for weight-only schemes on
    the fast path, where the learner runs ``F.linear`` over the dequantized weight at every
    batch size (the engine's GEMM at prefill sizes): exactly that, and the engine's low-bit
    kernel up to its summation order."""
    lin = nn.Linear(200, 48, bias=True)
    qat = QATLinear.from_linear(lin, name)
    inf = QuantLinear.from_linear(lin, name)
    x = torch.randn(3, 7, 200)
    sc = get_scheme(name)
    with use_backend(backend):
        y = qat(x)
        if backend == "triton" and sc.quantizes_weights and sc.act_format == "none":
            w = quantize_weight(lin.weight.detach(), sc).dequantize(torch.float32)
            assert torch.equal(y, nn.functional.linear(x, w, lin.bias.detach()))
            torch.testing.assert_close(y, inf(x), rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(y, inf(x))


@pytest.mark.parametrize("name", ALL)
def test_qat_gradients_equal_autograd_through_dequantized_reference(name, backend):
    sc = get_scheme(name)
    lin = nn.Linear(200, 48, bias=True).double()
    qat = QATLinear.from_linear(lin, sc)
    x = torch.randn(3, 5, 200, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(3, 5, 48, dtype=torch.float64)
    with use_backend(backend):
        qat(x).backward(gy)
        # Straight-through estimator written with autograd: forward sees fq(x) and W_deq,
        # gradients flow to x and W as if quantization were the identity.
        w = lin.weight.detach().clone().requires_grad_(True)
        b = lin.bias.detach().clone().requires_grad_(True)
        x2 = x.detach().clone().requires_grad_(True)
        w_ste = w + (quantize_weight(w.detach(), sc).dequantize(torch.float64) - w).detach()
        x_ste = x2 + (fake_quantize_input(x2.detach(), sc.act_format) - x2).detach()
        torch.nn.functional.linear(x_ste, w_ste, b).backward(gy)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lin.weight.grad, w.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lin.bias.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_qat_grad_w_uses_activations_as_seen_by_forward():
    lin = nn.Linear(64, 16, bias=False)
    qat = QATLinear.from_linear(lin, "w8a8-int8")
    x = torch.randn(4, 64)
    gy = torch.randn(4, 16)
    qat(x).backward(gy)
    assert torch.allclose(lin.weight.grad, gy.T @ ref.fake_quantize_activations(x, "int8"), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(lin.weight.grad, gy.T @ x, rtol=1e-6, atol=1e-6)


def test_publish_caches_until_master_weight_changes():
    lin = nn.Linear(128, 32)
    qat = QATLinear.from_linear(lin, "w4a16")
    x = torch.randn(2, 128)
    qat(x)
    qw = qat.publish()
    assert qat.publish() is qw  # no re-quantization
    qat(x)
    assert qat.publish() is qw
    opt = torch.optim.SGD(qat.parameters(), lr=1.0)
    qat(x).sum().backward()
    opt.step()
    qw2 = qat.publish()
    assert qw2 is not qw
    qat(x)
    assert qat.publish() is qw2  # the forward after the step made the published tensors
    torch.testing.assert_close(qw2.dequantize(), quantize_weight(lin.weight, "w4a16").dequantize())
    lin.weight.data.mul_(2)  # bypasses the version counter: explicit invalidate
    qat.invalidate()
    assert qat.publish() is not qw2


def test_load_quantized_copies_in_place():
    a, b = nn.Linear(200, 48), nn.Linear(200, 48)
    inf = QuantLinear.from_linear(a, "w4a16")
    ptrs = {k: t.data_ptr() for k, t in inf.qweight.tensors().items()}
    inf.load_quantized(quantize_weight(b.weight, "w4a16"))
    assert {k: t.data_ptr() for k, t in inf.qweight.tensors().items()} == ptrs
    torch.testing.assert_close(inf.qweight.dequantize(), quantize_weight(b.weight, "w4a16").dequantize())
    with pytest.raises(ValueError):
        inf.load_quantized(quantize_weight(b.weight, "w8a8-int8"))


def test_quantize_model_default_selection_and_modes():
    model = tiny_model()
    names = quantize_model(model, "w4a16", QATLinear)
    assert len(names) == 2 * 7 and all(n.startswith("layers.") for n in names)
    assert isinstance(model.layers[0].self_attn.q_proj, QATLinear)
    assert isinstance(model.embed_tokens, nn.Embedding)
    assert isinstance(model.lm_head, nn.Linear) or model.lm_head is None
    m2 = tiny_model()
    names2 = quantize_model(m2, "w8a8-int8", QuantLinear, exclude=["*.mlp.down_proj"])
    assert len(names2) == 2 * 6 and isinstance(m2.layers[1].mlp.down_proj, nn.Linear)
    assert isinstance(m2.layers[1].mlp.up_proj, QuantLinear)
    with pytest.raises(ValueError):
        quantize_model(tiny_model(), "w4a16", nn.Linear)


def test_optimizer_built_before_swap_still_trains_qat_model():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    quantize_model(model, "w4a16", QATLinear)
    q = model.layers[0].self_attn.q_proj
    before = q.weight.detach().clone()
    ids = torch.randint(0, 64, (2, 6))
    model(ids).float().logsumexp(-1).mean().backward()
    opt.step()
    assert not torch.equal(before, q.weight)


@pytest.mark.parametrize("name", ["w4a16", "w8a8-fp8", "nvfp4"])
def test_publish_model_to_engine_model_gives_same_logits(name):
    learner = tiny_model()
    engine = tiny_model()
    with torch.no_grad():
        for p in engine.parameters():
            p.add_(torch.randn_like(p))  # the engine starts out of date
    quantize_model(learner, name, QATLinear)
    quantize_model(engine, name, QuantLinear)
    ids = torch.randint(0, 64, (2, 9))
    learner_logits = learner(ids)
    published = publish_model(learner)
    assert isinstance(published["layers.0.mlp.up_proj.weight"], type(learner.layers[0].mlp.up_proj.publish()))
    assert isinstance(published["embed_tokens.weight"], torch.Tensor)
    load_published(engine, published)
    assert torch.equal(engine(ids), learner_logits)


def test_qat_dequantizes_once_per_weight_version(monkeypatch, needs_triton):
    """At training batch sizes the forward (dequant + GEMM) and the backward share one
    dequantized weight per weight version: made once for several micro-batches, remade after
    the optimizer changes the weight, freed by drop_dequantized; the engine's QuantLinear keeps none."""
    from quarl.quant import ops
    from quarl.quant.kernels import weight_only
    from quarl.quant.linear import drop_dequantized

    made = []
    real = weight_only.dequantize
    monkeypatch.setattr(weight_only, "dequantize", lambda qw, dt: made.append(dt) or real(qw, dt))
    monkeypatch.setattr(ops, "dequantize", lambda qw, dt: made.append(dt) or qw.dequantize(dt))
    lin = nn.Linear(256, 64, bias=False)
    qat = QATLinear.from_linear(lin, "w4a16")
    model = nn.Sequential(qat)
    grads = []
    with use_backend("triton"):
        for _ in range(3):  # three micro-batches of 200 rows (the dequant + GEMM plan)
            x = torch.randn(200, 256, requires_grad=True)
            y = model(x)
            y.backward(torch.ones_like(y))
            grads.append(x.grad)
        assert len(made) == 1
        with torch.no_grad():
            lin.weight.add_(0.5)  # an optimizer step: a new weight version
        model(torch.randn(200, 256)).sum().backward()
        assert len(made) == 2
        drop_dequantized(model)
        assert qat.repacked.layouts() == ()
        inf = QuantLinear.from_linear(nn.Linear(256, 64, bias=False), "w4a16")
        inf(torch.randn(200, 256))
        inf(torch.randn(200, 256))
        assert len(made) == 4 and inf.repacked.layouts() == ()
    # the cached weight gives the reference's gradients: grad_x = 1 @ W_deq for every row
    w_deq = quantize_weight(lin.weight.detach() - 0.5, "w4a16").dequantize(torch.float32)
    torch.testing.assert_close(grads[0], torch.ones(200, 64) @ w_deq, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["w4a16", "nvfp4"])
def test_qat_dequant_plan_differentiates_a_leaf_and_moves_its_grad_to_the_master(name, needs_triton):
    """Where the engine's GEMM is a matmul over the dequantized weight (M > 128 here), the
    QAT forward is F.linear on a leaf holding that weight, with autograd's own backward: the
    same outputs as the autograd function, straight-through gradients accumulated on the
    master weight over micro-batches (float64, exact), none for a frozen weight, and copies
    of the module (the critic deep-copies the policy) carry no leaf."""
    import copy

    from quarl.quant.linear import _QATMatmul

    sc = get_scheme(name)
    lin = nn.Linear(256, 48, bias=True).double()
    qat = QATLinear.from_linear(lin, sc)
    xs = [torch.randn(2, 100, 256, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    gys = [torch.randn(2, 100, 48, dtype=torch.float64) for _ in range(2)]
    with use_backend("triton"):
        for x, gy in zip(xs, gys):  # two micro-batches accumulate
            y = qat(x)
            assert "QATMatmul" not in type(y.grad_fn).__name__
            assert torch.equal(y, _QATMatmul.apply(x, qat.bias, qat.quantized_weight(), qat.repacked, qat.weight))
            y.backward(gy)
        assert qat._leaf.leaf.grad is None
        w_deq = quantize_weight(lin.weight.detach(), sc).dequantize(torch.float64)
        x_all = torch.cat([x.detach().reshape(-1, 256) for x in xs])
        gy_all = torch.cat([g.reshape(-1, 48) for g in gys])
        torch.testing.assert_close(lin.weight.grad, gy_all.T @ x_all, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lin.bias.grad, gy_all.sum(0), rtol=1e-12, atol=1e-12)
        for x, gy in zip(xs, gys):
            torch.testing.assert_close(x.grad, gy @ w_deq, rtol=1e-12, atol=1e-12)
        twin, before = copy.deepcopy(qat), lin.weight.grad.clone()
        assert twin._leaf.leaf is None
        twin(xs[0].detach()).sum().backward()
        assert twin.weight.grad is not None and torch.equal(lin.weight.grad, before)
        frozen = QATLinear.from_linear(nn.Linear(256, 48).double().requires_grad_(False), sc)
        x = torch.randn(200, 256, dtype=torch.float64, requires_grad=True)
        frozen(x).sum().backward()
        assert frozen.weight.grad is None and x.grad is not None and not frozen._leaf.leaf.requires_grad


def test_deferred_master_grads_hand_the_summed_gradient_over_once(needs_triton):
    """Inside ``deferred_master_grads`` a group's and a linear's dequantized leaves accumulate
    over micro-batches and the master weights see no gradient until the block ends; then each
    master holds exactly the sum that the per-backward hook gives (float64)."""
    from quarl.quant.linear import deferred_master_grads, qat_group

    torch.manual_seed(11)

    def build():
        torch.manual_seed(12)
        owner = nn.Module()
        owner.a, owner.b = nn.Linear(256, 48).double(), nn.Linear(256, 16).double()
        owner.c = nn.Linear(48, 32).double()
        quantize_model(owner, "w4a16", include=("*",))
        return owner, qat_group(owner, ("a", "b"))

    xs = [torch.randn(2, 100, 256, dtype=torch.float64) for _ in range(3)]
    grads = []
    for deferred in (False, True):
        owner, group = build()
        with use_backend("triton"), (deferred_master_grads(owner) if deferred else contextlib.nullcontext()):
            for x in xs:
                a, b = group(x)
                (a.square().sum() + b.sum() + owner.c(a).sum()).backward()
                if deferred:
                    assert all(p.grad is None for p in owner.parameters() if p.dim() == 2)
        assert group._leaf.leaf.grad is None and owner.c._leaf.leaf.grad is None
        grads.append({n: p.grad.clone() for n, p in owner.named_parameters()})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 6
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-12, atol=1e-12, msg=n)


@pytest.mark.parametrize("name,backend_name,rows", [
    ("w8a8-int8", "reference", 7), ("w4a16", "reference", 7), ("w8a8-fp8", "triton", 7), ("w4a16", "triton", 200),
])
def test_qat_group_is_its_members_run_one_by_one(name, backend_name, rows, needs_triton):
    """q/k/v run as one QAT GEMM give each member's output and each master weight its own
    straight-through gradient (float64; the fp8 kernel sums in float32, and its K split
    depends on the number of column tiles, so there the order differs); the stacked
    weight is remade only when a member's weight changes; nvfp4 (a per-tensor scale) and
    mixed schemes are not grouped."""
    from quarl.quant.linear import QATGroup, qat_group

    model = tiny_model(torch.float64, layers=1)
    quantize_model(model, name)
    attn = model.layers[0].self_attn
    members = [attn.q_proj, attn.k_proj, attn.v_proj]
    g = qat_group(attn, ("q_proj", "k_proj", "v_proj"))
    assert isinstance(g, QATGroup) and qat_group(attn, ("q_proj", "k_proj", "v_proj")) is g
    x = torch.randn(rows, 64, dtype=torch.float64, requires_grad=True)
    gys = [torch.randn(rows, m.out_features, dtype=torch.float64) for m in members]
    with use_backend(backend_name):
        outs = g(x)
        sum((o * gy).sum() for o, gy in zip(outs, gys)).backward()
        fused = [m.weight.grad.clone() for m in members] + [x.grad.clone()]
        for m in members:
            m.weight.grad = None
        x.grad = None
        sep = [m(x) for m in members]
        sum((o * gy).sum() for o, gy in zip(sep, gys)).backward()
        apart = [m.weight.grad for m in members] + [x.grad]
        tol = 1e-6 if name == "w8a8-fp8" else 1e-12
        for a, b in zip(outs, sep):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        for a, b in zip(fused, apart):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        stacked = g.quantized_weight()
        assert g.quantized_weight() is stacked
        with torch.no_grad():
            attn.k_proj.weight.mul_(2.0)
        assert g.quantized_weight() is not stacked
    other = tiny_model(torch.float64, layers=1)
    quantize_model(other, "nvfp4")
    assert qat_group(other.layers[0].self_attn, ("q_proj", "k_proj", "v_proj")) is None
    mixed = tiny_model(torch.float64, layers=1)
    quantize_model(mixed, "w4a16", include=["layers.*.q_proj"])
    quantize_model(mixed, "w8a8-int8", include=["layers.*.k_proj", "layers.*.v_proj"])
    assert qat_group(mixed.layers[0].self_attn, ("q_proj", "k_proj", "v_proj")) is None


@pytest.mark.parametrize("name", ALL)
def test_quantize_weights_stacked_equals_one_call_each(name):
    """Stacking weights of one width into a few quantizer calls (here split into several
    chunks) stores exactly what one call per weight stores, for every scheme; requantize_stale
    redoes only the modules whose master changed."""
    from quarl.quant import quantize_weights
    from quarl.quant.linear import requantize_stale

    g = torch.Generator().manual_seed(7)
    ws = [torch.randn(n, k, generator=g) * s for n, k, s in
          ((48, 256, 1.0), (16, 256, 0.01), (40, 200, 3.0), (8, 256, 1e-3), (24, 200, 0.5))]
    got = quantize_weights(ws, name, chunk_bytes=48 * 256 * 4)
    for w, qw in zip(ws, got):
        one = quantize_weight(w, name)
        assert qw.shape == one.shape and qw.tensors().keys() == one.tensors().keys()
        for f, t in one.tensors().items():
            assert torch.equal(getattr(qw, f), t), f
    mods = [QATLinear.from_linear(nn.Linear(256, 48), name), QATLinear.from_linear(nn.Linear(200, 16), name)]
    kept = mods[0].quantized_weight()
    with torch.no_grad():
        mods[1].weight.mul_(2.0)
    requantize_stale(mods)
    assert mods[0].quantized_weight() is kept
    fresh = mods[1].quantized_weight()
    for f, t in quantize_weight(mods[1].weight.detach(), name).tensors().items():
        assert torch.equal(getattr(fresh, f), t), f


@pytest.mark.parametrize("name", ["w4a16", "w8a8-fp8"])
def test_quant_linear_with_an_adapter_is_the_base_plus_its_addmm_and_trains_it(name):
    """The engine's QuantLinear with a LoRA adapter hands the adapter to the GEMM as a LoRA term
    (the Hopper w4a16 kernel adds it in its epilogue); elsewhere it is one addmm after the base,
    the sum the learner's regions make (``add_adapter``), and with gradients wanted A and B train."""
    from quarl.model.lora import LoRAAdapter, add_adapter

    torch.manual_seed(1)
    base = nn.Linear(256, 192, bias=True)
    mod = QuantLinear.from_linear(base, name)
    mod.lora = LoRAAdapter(256, 192, rank=8, alpha=16)
    with torch.no_grad():
        mod.lora.B.normal_(0, 0.1)
    x = torch.randn(2, 5, 256)
    with torch.no_grad():
        want = add_adapter(ref.reference_linear(x, mod.qweight, mod.bias), x, mod.lora.A, mod.lora.B, 2.0)
        got = mod(x)
    assert got.shape == (2, 5, 192) and torch.equal(got, want)
    assert not torch.equal(got, ref.reference_linear(x, mod.qweight, mod.bias))
    mod(x).square().sum().backward()
    xa = torch.nn.functional.linear(x.reshape(-1, 256), mod.lora.A)
    assert mod.lora.B.grad is not None and mod.lora.A.grad is not None and mod.lora.B.grad.abs().sum() > 0
    torch.testing.assert_close(mod.lora.B.grad, 2.0 * (2 * got.detach().reshape(-1, 192)).T @ xa.detach())


def test_wgmma_kernel_takes_a_lora_term_only_where_it_fits():
    """``cuda_w4.takes_lora``: ranks up to 128, at most 3 members on 64-row boundaries, bf16
    operands in 16-byte rows, no gradient wanted, and shared memory that keeps the block's
    residency (the 7B gate/up block of 3 warpgroups x 5 slots has room for rank 64, not 128);
    never the pre-scaled loop."""
    from quarl.quant.kernels import cuda_w4
    from quarl.quant.kernels.config import WgConfig
    from quarl.quant.ops import LoRATerm

    x = torch.zeros(64, 512, dtype=torch.bfloat16)
    wide = WgConfig(3, 5, 1.0, single=True, tail=True, mbar=True)
    long_k = WgConfig(2, 3, 2.0, single=True, minb=2, tail=True, cluster=True)

    def term(rank, starts=(0,), cols=(0,), dtype=torch.bfloat16, r=None, grad=False):
        r = r or rank * len(starts)
        b = torch.zeros(4608, r, dtype=dtype, requires_grad=grad)
        return LoRATerm(torch.zeros(64, r, dtype=dtype), b, 2.0, rank, starts, cols)

    assert cuda_w4.takes_lora(wide, x, term(64)) and cuda_w4.takes_lora(long_k, x, term(64))
    assert cuda_w4.takes_lora(wide, x, term(64, (0, 3584, 4096), (0, 64, 128)))
    assert not cuda_w4.takes_lora(wide, x, term(128))  # 3 x 34 KB more: past 227 KB
    two_per_sm = WgConfig(1, 4, 2.0, tail=True, cluster=True)  # 83 KB: two blocks an SM
    assert cuda_w4.takes_lora(two_per_sm, x, term(64)) and not cuda_w4.takes_lora(two_per_sm, x, term(128))
    assert cuda_w4.takes_lora(WgConfig(2, 3, 1.0, single=True, tail=True, cluster=True), x, term(128))
    assert not cuda_w4.takes_lora(WgConfig(2, 4, 1.0, tail=True, prescale=True), x, term(64))  # its own loop
    assert not cuda_w4.takes_lora(wide, x, term(192))
    assert not cuda_w4.takes_lora(wide, x, term(64, (0, 3584, 4100), (0, 64, 128)))  # a slab in two members
    assert not cuda_w4.takes_lora(wide, x, term(64, (0, 64, 128, 192), (0, 64, 128, 192)))
    assert not cuda_w4.takes_lora(wide, x, term(64, dtype=torch.float32))
    assert not cuda_w4.takes_lora(wide, x, term(12, r=12))  # rows of 24 bytes
    with torch.enable_grad():
        assert not cuda_w4.takes_lora(wide, x, term(64, grad=True))
    with torch.no_grad():
        assert cuda_w4.takes_lora(wide, x, term(64, grad=True))
