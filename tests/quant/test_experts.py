"""Quantized MoE experts (quarl.quant.experts): the engine's QuantExperts against a float64
loop over experts, the aligned learner's QATExperts equal to it bit for bit with
straight-through gradients, quantize_model / publish / load_published / quantized loading on
MoE models, and the refusal of per-tensor-scale schemes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import quarl
from quarl.config.run import ConfigError, QuantConfig
from quarl.model.moe import Experts, Router, SparseMoeBlock
from quarl.model.presets import build_random_model, preset_config
from quarl.quant import (
    SCHEMES,
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
from quarl.quant.experts import PROJECTIONS, QATExperts, QuantExperts, check_expert_scheme
from quarl.quant.linear import (
    drop_dequantized,
    invalidate_quantized,
    requantize_stale,
    selected_experts,
    set_per_use_dequant,
    set_straight_through,
)

REFUSED = [n for n, s in SCHEMES.items() if s.per_tensor_scale]  # nvfp4
SUPPORTED = [n for n in SCHEMES if n not in REFUSED]
E, H, INTER = 5, 64, 48  # K = 64 and 48: neither a multiple of the int4 schemes' 128 (padded, as the dense linears are)


def _experts(dtype=torch.float32, std=0.3, seed=0) -> Experts:
    torch.manual_seed(seed)
    ex = Experts(H, INTER, E).to(dtype)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, std)
    return ex


def _routing(n: int, k: int, dtype=torch.float32, seed=1):
    """ids ``[n, k]`` (distinct per token) that never use expert 2, and gate weights."""
    g = torch.Generator().manual_seed(seed)
    used = torch.tensor([e for e in range(E) if e != 2])
    ids = torch.stack([used[torch.randperm(len(used), generator=g)[:k]] for _ in range(n)])
    w = torch.softmax(torch.randn(n, k, generator=g), -1).to(dtype)
    return ids, w


def _deq(w: torch.Tensor, scheme) -> torch.Tensor:
    e, n, k = w.shape
    return quantize_weight(w.detach().reshape(e * n, k), scheme).dequantize(torch.float64).view(e, n, k)


def _seen64(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows as the GEMM sees them, exactly (float64): codes times scales."""
    if fmt == "none":
        return rows.double()
    q, s = ref.quantize_activations(rows, fmt)
    return q.double() * s.double()[:, None]


def _loop_reference(ex: Experts, scheme, x, ids, w) -> torch.Tensor:
    """A Python loop over (token, slot): each projection ``seen(rows) @ deq(W_e)^T`` summed in
    float64 and rounded to x's dtype (the rounding step of every GEMM), SiLU-and-mul in x's dtype."""
    sc = get_scheme(scheme)
    gu, dn = _deq(ex.gate_up_proj, sc), _deq(ex.down_proj, sc)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        acc = []
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g_u = (_seen64(x[t : t + 1], sc.act_format) @ gu[e].T).to(x.dtype)
            h = F.silu(g_u[:, :INTER]) * g_u[:, INTER:]
            y = (_seen64(h, sc.act_format) @ dn[e].T).to(x.dtype)
            acc.append(y[0] * w[t, j])
        out[t] = torch.stack(acc).sum(0)
    return out


def test_every_scheme_is_covered():
    assert set(SUPPORTED) | set(REFUSED) == set(SCHEMES) and REFUSED == ["nvfp4"]


@pytest.mark.parametrize("name", SUPPORTED)
def test_stacked_quantization_is_each_expert_on_its_own(name):
    ex = _experts()
    qx = QuantExperts.from_experts(ex, name)
    for proj in PROJECTIONS:
        whole = getattr(qx, proj).packed
        w = getattr(ex, proj).detach()
        n = w.shape[1]
        for e in range(E):
            alone = quantize_weight(w[e], name)
            part = whole.rows(e * n, (e + 1) * n)
            assert part.tensors().keys() == alone.tensors().keys()
            for f, t in alone.tensors().items():
                assert torch.equal(part.tensors()[f], t), (proj, e, f)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name", SUPPORTED)
def test_quant_experts_match_a_float64_loop_over_experts(name, k):
    ex = _experts()
    qx = QuantExperts.from_experts(ex, name)
    torch.manual_seed(7)
    x = torch.randn(11, H)
    ids, w = _routing(11, k)
    y = qx(x, ids, w)
    expected = _loop_reference(ex, name, x, ids, w)
    torch.testing.assert_close(y, expected, rtol=2e-6, atol=2e-6)
    # the weights are quantized: unless bf16, not the plain experts' output
    plain = ex(x, ids, w)
    if get_scheme(name).quantizes_weights:
        assert (y - plain).abs().max() > 1e-4
    else:
        torch.testing.assert_close(y, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["w4a16", "w8a8-int8", "w8a8-fp8", "mxfp4"])
def test_triton_backend_gives_the_reference_values(name, needs_triton):
    """The Triton quantizer / dequantizer (interpreted on CPU) in the grouped path: the same bits."""
    ex = _experts()
    qx = QuantExperts.from_experts(ex, name)
    x = torch.randn(9, H)
    ids, w = _routing(9, 2)
    with use_backend("reference"):
        a = qx(x, ids, w)
    with use_backend("triton"):
        b = qx(x, ids, w)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", SUPPORTED)
def test_qat_experts_forward_is_the_engines_bit_for_bit(name):
    ex = _experts(dtype=torch.bfloat16, std=0.05)
    qat = QATExperts.from_experts(ex, name)
    engine = QuantExperts(H, INTER, E, name, dtype=torch.bfloat16)  # zeros until loaded
    buffers = {n: b.data_ptr() for n, b in engine.named_buffers()}
    engine.load_quantized(qat.publish())
    assert {n: b.data_ptr() for n, b in engine.named_buffers()} == buffers  # in place
    for rows in (1, 6, 23):
        x = torch.randn(rows, H).bfloat16()
        ids, w = _routing(rows, 2, torch.bfloat16, seed=rows)
        assert torch.equal(qat(x, ids, w), engine(x, ids, w)), rows


@pytest.mark.parametrize("name", SUPPORTED)
def test_rows_do_not_depend_on_the_batch(name):
    """A token's output is the same alone and among others (the engine decodes one token while
    the learner runs the whole batch)."""
    qx = QuantExperts.from_experts(_experts(), name)
    x = torch.randn(17, H)
    ids, w = _routing(17, 2)
    full = qx(x, ids, w)
    for t in (0, 5, 16):
        assert torch.equal(qx(x[t : t + 1], ids[t : t + 1], w[t : t + 1]), full[t : t + 1])


@pytest.mark.parametrize("name", SUPPORTED)
def test_qat_experts_straight_through_gradients(name):
    sc = get_scheme(name)
    ex = _experts(dtype=torch.float64)
    qat = QATExperts.from_experts(ex, name)
    assert qat.gate_up_proj is ex.gate_up_proj and qat.down_proj is ex.down_proj
    x = torch.randn(9, H, dtype=torch.float64, requires_grad=True)
    ids, w = _routing(9, 2, torch.float64)
    w.requires_grad_(True)
    gy = torch.randn(9, H, dtype=torch.float64)
    qat(x, ids, w).backward(gy)

    # the estimator written with autograd: forward on fq(x) and W_deq, gradients as if both were the identity
    masters = {p: getattr(ex, p).detach().clone().requires_grad_(True) for p in PROJECTIONS}
    ste = {p: m + (_deq(m, sc) - m).detach() for p, m in masters.items()}
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)

    def fq(t):
        return t + (_seen64(t.detach(), sc.act_format) - t).detach()

    out = []
    for t in range(9):
        acc = 0
        for j in range(2):
            e = int(ids[t, j])
            g_u = fq(x2[t : t + 1]) @ ste["gate_up_proj"][e].T
            h = F.silu(g_u[:, :INTER]) * g_u[:, INTER:]
            acc = acc + (fq(h) @ ste["down_proj"][e].T)[0] * w2[t, j]
        out.append(acc)
    torch.stack(out).backward(gy)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-10, atol=1e-12)
    for p in PROJECTIONS:
        torch.testing.assert_close(getattr(ex, p).grad, masters[p].grad, rtol=1e-10, atol=1e-12)
        assert torch.count_nonzero(getattr(ex, p).grad[2]) == 0  # the expert no token chose
    if sc.quantizes_activations:  # grad_W saw the quantized activations, not x
        plain = ex.gate_up_proj.detach().clone().requires_grad_(True)
        assert not torch.allclose(ex.gate_up_proj.grad, torch.autograd.grad(
            Experts.forward(_as_experts(plain, ex.down_proj.detach()), x.detach(), ids, w.detach()).mul(gy).sum(),
            plain)[0], rtol=1e-6, atol=1e-9)


def _as_experts(gate_up, down) -> Experts:
    ex = Experts.__new__(Experts)
    torch.nn.Module.__init__(ex)
    ex.num_experts, ex.intermediate_size = E, INTER
    ex.gate_up_proj, ex.down_proj = gate_up, down
    return ex


def test_quant_experts_pass_gradients_to_their_input_and_gate_weights_only():
    """A LoRA learner's frozen base runs QuantExperts with autograd."""
    ex = _experts()
    qx = QuantExperts.from_experts(ex, "w4a8-int8")
    x = torch.randn(7, H, requires_grad=True)
    ids, w = _routing(7, 2)
    w.requires_grad_(True)
    qx(x, ids, w).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0 and w.grad.abs().sum() > 0
    assert all(not b.requires_grad for b in qx.buffers()) and not list(qx.parameters())


def test_qat_experts_cache_per_weight_version_and_invalidate():
    ex = _experts()
    qat = QATExperts.from_experts(ex, "w4a16")
    first = qat.publish()
    assert qat.publish()["gate_up_proj"] is first["gate_up_proj"]
    with torch.no_grad():
        ex.gate_up_proj.add_(0.5)  # bumps the version counter
    assert qat.publish()["gate_up_proj"] is not first["gate_up_proj"]
    assert qat.publish()["down_proj"] is first["down_proj"]
    kept = qat.publish()["down_proj"]
    ex.down_proj.data.mul_(2.0)  # through .data: the counter does not show it
    assert qat.publish()["down_proj"] is kept
    qat.invalidate()
    assert torch.equal(qat.publish()["down_proj"].qdata, quantize_weight(ex.down_proj.detach().reshape(E * H, INTER),
                                                                         "w4a16").qdata)


def test_model_wide_helpers_take_qat_experts():
    model = build_random_model("moe-tiny", dtype=torch.float32, std=0.3)
    quantize_model(model, "w8a8-int8", QATLinear)
    qat = model.layers[0].mlp.experts
    ids = torch.randint(0, 128, (2, 9))
    base = model(ids)
    assert qat.repacked["gate_up_proj"]._entries  # the dequantized copy kept through the update
    drop_dequantized(model)
    assert not qat.repacked["gate_up_proj"]._entries
    set_per_use_dequant(model, True)
    assert torch.equal(model(ids), base) and not qat.keep_dequantized
    assert not qat.repacked["gate_up_proj"]._entries
    set_per_use_dequant(model, False)
    set_straight_through(model)
    assert torch.equal(model(ids), base) and not qat.keep_dequantized
    model.layers[0].mlp.experts.gate_up_proj.data.mul_(0.5)
    invalidate_quantized(model)
    assert not torch.equal(model(ids), base)
    with torch.no_grad():
        qat.down_proj.add_(0.1)
    requantize_stale(list(model.modules()))
    assert not qat.stale()


@pytest.mark.parametrize("name", REFUSED)
def test_per_tensor_scale_schemes_are_refused_for_experts_with_the_fix(name):
    model = build_random_model("moe-tiny", dtype=torch.float32)
    for layer in (QATLinear, QuantLinear):
        with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts: nvfp4 has a per-tensor scale.*"
                                             r"quant\.exclude: \['layers\.\*\.mlp\.experts'\]"):
            quantize_model(model, name, layer)
        assert type(model.layers[0].mlp.experts) is Experts  # nothing swapped
        assert type(model.layers[0].self_attn.q_proj) is torch.nn.Linear
    for cls in (QATExperts, QuantExperts):
        with pytest.raises(ValueError, match="per-tensor scale"):
            cls(H, INTER, E, name)
    with pytest.raises(ValueError, match="layers.3.mlp.experts"):
        check_expert_scheme(get_scheme(name), "layers.3.mlp.experts")
    # the fix the message names works: dense linears in nvfp4, experts left in the model's dtype
    names = quantize_model(model, name, QuantLinear, exclude=["layers.*.mlp.experts"])
    assert not any(n.endswith("experts") for n in names) and type(model.layers[0].mlp.experts) is Experts
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 128, (1, 6)))).all()


@pytest.mark.parametrize("layer", [QATLinear, QuantLinear])
def test_quantize_model_swaps_moe_tiny_experts_and_leaves_the_router(layer):
    model = build_random_model("moe-tiny", dtype=torch.bfloat16)
    sparse = [i for i, lyr in enumerate(model.layers) if isinstance(lyr.mlp, SparseMoeBlock)]
    assert sparse == [0, 2]
    params = {n: p for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    names = quantize_model(model, "w4a16", layer)
    assert [n for n in names if n.endswith("experts")] == ["layers.0.mlp.experts", "layers.2.mlp.experts"]
    want = QATExperts if layer is QATLinear else QuantExperts
    for i in sparse:
        mlp = model.layers[i].mlp
        assert type(mlp.experts) is want and type(mlp.gate) is Router
        assert mlp.gate.weight.dtype == torch.bfloat16 and mlp.gate.weight is params[f"layers.{i}.mlp.gate.weight"]
    if layer is QATLinear:  # same Parameters under the same names: checkpoints and the optimizer carry over
        assert {n: p for n, p in model.named_parameters()} == params
        ids = torch.randint(0, 128, (2, 7))
        before = model.layers[0].mlp.experts.gate_up_proj.detach().clone()
        model(ids).float().logsumexp(-1).mean().backward()
        opt.step()
        assert not torch.equal(model.layers[0].mlp.experts.gate_up_proj, before)
    else:
        keys = set(model.state_dict())
        assert {"layers.0.mlp.experts.gate_up_proj.qdata", "layers.0.mlp.experts.gate_up_proj.scales",
                "layers.0.mlp.experts.down_proj.qdata", "layers.0.mlp.experts.down_proj.scales"} <= keys
        assert not any(k.endswith("experts.gate_up_proj") for k in keys)


def test_include_and_exclude_patterns_name_experts():
    def swapped(**kw):
        model = build_random_model("moe-tiny", dtype=torch.float32)
        names = quantize_model(model, "w4a16", QuantLinear, **kw)
        return names, [i for i, lyr in enumerate(model.layers) if isinstance(getattr(lyr.mlp, "experts", None),
                                                                              QuantExperts)]

    assert swapped()[1] == [0, 2]
    assert swapped(include=["layers.2.mlp.experts"]) == (["layers.2.mlp.experts"], [2])
    names, layers = swapped(exclude=["*.mlp.experts"])
    assert layers == [] and names and not any("experts" in n for n in names)
    names, layers = swapped(include=["layers.0.*"])
    assert layers == [0] and all(n.startswith("layers.0.") for n in names)
    model = build_random_model("moe-tiny")
    assert selected_experts(model) == ["layers.0.mlp.experts", "layers.2.mlp.experts"]
    assert selected_experts(model, exclude=["layers.0.mlp.experts"]) == ["layers.2.mlp.experts"]


def test_config_accepts_patterns_that_name_experts():
    QuantConfig(include=["layers.*.mlp.experts"]).validate()
    QuantConfig(exclude=["layers.*.mlp.experts"]).validate()
    QuantConfig(include=["layers.3.mlp.experts", "layers.*.self_attn.*"]).validate()
    with pytest.raises(ConfigError, match="matches no linear"):
        QuantConfig(exclude=["layers.*.mlp.expert"]).validate()


@pytest.mark.parametrize("name", ["w4a16", "w8a8-fp8"])
def test_publish_and_load_published_round_trip_on_a_moe_model(name):
    learner = build_random_model("moe-tiny", dtype=torch.float32, std=0.2)
    engine = copy.deepcopy(learner)
    quantize_model(learner, name, QATLinear)
    quantize_model(engine, name, QuantLinear)
    opt = torch.optim.SGD(learner.parameters(), lr=0.5)
    ids = torch.randint(0, 128, (2, 9))
    learner(ids).logsumexp(-1).mean().backward()
    opt.step()
    buffers = {n: b.data_ptr() for n, b in engine.named_buffers() if "experts" in n}
    published = publish_model(learner)
    assert isinstance(published["layers.0.mlp.experts.gate_up_proj"], quarl.quant.QuantizedWeight)
    assert published["layers.0.mlp.experts.gate_up_proj"].shape == (8 * 64, 64)
    assert isinstance(published["layers.0.mlp.gate.weight"], torch.Tensor)  # the router: plain
    with torch.no_grad():
        assert not torch.equal(learner(ids), engine(ids))
        load_published(engine, {("model." + k if "experts" in k else k): v for k, v in published.items()})
        assert torch.equal(learner(ids), engine(ids))
    assert {n: b.data_ptr() for n, b in engine.named_buffers() if "experts" in n} == buffers

    # a full-precision tensor for the experts (the rollout mode's publish) is quantized per expert first
    plain = build_random_model("moe-tiny", dtype=torch.float32, std=0.2, seed=4)
    load_published(engine, {n: p.detach() for n, p in plain.named_parameters()})
    quantize_model(plain, name, QuantLinear)
    with torch.no_grad():
        assert torch.equal(engine(ids), plain(ids))

    # checked before anything is written
    before = engine.layers[0].mlp.experts.down_proj.qdata.clone()
    bad = {"layers.0.mlp.experts.down_proj": plain.layers[2].mlp.experts.down_proj.packed.rows(0, 64)}
    with pytest.raises(ValueError):
        load_published(engine, {"layers.2.mlp.experts.down_proj": publish_model(learner)[
            "layers.2.mlp.experts.down_proj"], **bad})
    assert torch.equal(engine.layers[0].mlp.experts.down_proj.qdata, before)
    with pytest.raises(ValueError, match="layers.0.mlp.experts.gate_up_proj: published shape"):
        load_published(engine, {"layers.0.mlp.experts.gate_up_proj": torch.zeros(3, 4)})


@pytest.fixture(scope="module", params=["per_expert", "stacked"])
def moe_checkpoint(request, tmp_path_factory):
    from tests.hf_models import make_moe_checkpoint, moe_hf_config

    path = tmp_path_factory.mktemp(request.param)
    make_moe_checkpoint(path, moe_hf_config(), seed=3, per_expert=request.param == "per_expert")
    return path


@pytest.mark.parametrize("name", ["w4a16", "w8a8-int8"])
def test_loading_quantized_packs_experts_as_quantize_model_does(moe_checkpoint, name, tmp_path):
    from quarl.model.quantized_loading import load_quantized_model

    got = load_quantized_model(moe_checkpoint, name, dtype=torch.float32)
    want = quarl.load_model(moe_checkpoint, dtype=torch.float32)
    quantize_model(want, name, QuantLinear)
    assert isinstance(got.layers[0].mlp.experts, QuantExperts)
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    for _ in range(2):  # written to the cache, then read back
        cached = load_quantized_model(moe_checkpoint, name, dtype=torch.float32, cache_dir=tmp_path)
        c = cached.state_dict()
        assert c.keys() == a.keys() and all(torch.equal(c[k], a[k]) for k in a)
    assert cached.quantized_from_cache and isinstance(cached.layers[0].mlp.experts, QuantExperts)
    with pytest.raises(ValueError, match="layers.0.mlp.experts: nvfp4"):
        load_quantized_model(moe_checkpoint, "nvfp4", dtype=torch.float32)
    kept = load_quantized_model(moe_checkpoint, "nvfp4", dtype=torch.float32, exclude=["layers.*.mlp.experts"])
    assert type(kept.layers[0].mlp.experts) is Experts


def test_random_quantized_model_packs_experts():
    from quarl.model.quantized_loading import random_quantized_model

    model = random_quantized_model(preset_config("moe-tiny"), "w4a8-int8", dtype=torch.float32)
    assert isinstance(model.layers[2].mlp.experts, QuantExperts)
    assert model.layers[2].mlp.experts.gate_up_proj.qdata.abs().sum() > 0
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 128, (1, 5)))).all()


def test_uaq_on_an_moe_model_keeps_its_function_and_routes():
    """UAQ scales an MoE layer's router and stacked gate/up with the norm that feeds them: the
    same logits and expert choices (float64), and removing it restores the weights."""
    import copy

    from quarl.model.moe import moe_routing
    from quarl.model.presets import build_random_model, preset_config
    from quarl.quant import apply_uaq, remove_uaq

    model = build_random_model(preset_config("moe-tiny"), seed=8, std=0.1).double().eval()
    scaled = apply_uaq(copy.deepcopy(model), 1.5)
    assert torch.equal(scaled.layers[0].mlp.gate.weight, model.layers[0].mlp.gate.weight * (1 / 1.5))
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad(), moe_routing(model) as a:
        want = model(ids)
    with torch.no_grad(), moe_routing(scaled) as b:
        got = scaled(ids)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert all(torch.equal(a.expert_ids[layer], b.expert_ids[layer]) for layer in a.expert_ids)
    back = remove_uaq(scaled, 1.5)
    for (n, p), q in zip(back.named_parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=0, msg=n)
