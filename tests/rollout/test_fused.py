"""The fused decode path (Triton norm/rope/SiLU kernels, fused q/k/v and gate/up GEMMs),
run under the Triton interpreter against the model's own forward."""

from __future__ import annotations

import copy

import pytest
import torch

from quarl.model.presets import build_random_model
from quarl.quant import QuantLinear, load_published, quantize_model, quantize_weight
from quarl.quant import reference as ref_quant
from quarl.quant.kernels.w4_layout import repack_w4
from quarl.model.transformer import batch_attention
from quarl.rollout.fused import FUSED_OPS, fuse_projections


def test_fused_projections_are_views_and_forward_matches():
    torch.manual_seed(0)
    model = build_random_model("tiny", seed=1, std=0.2)
    for layer in model.layers:  # give q/k/v biases, as Qwen2 has
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            lin.bias = torch.nn.Parameter(0.1 * torch.randn(lin.out_features))
    ref = copy.deepcopy(model)
    assert fuse_projections(model) == 2 * len(model.layers)
    a = model.layers[0].self_attn
    w = a._fused_qkv.weight
    assert a.k_proj.weight.data_ptr() == w[a.q_proj.out_features :].data_ptr()
    ids = torch.randint(0, 128, (2, 7))
    positions, attn = batch_attention(ids)
    with torch.no_grad():
        want = ref.hidden_states(ids, positions, attn)
        got = model.hidden_states(ids, positions, attn, FUSED_OPS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # loading weights by name writes into the fused buffers
    new = {n: p.detach() * 0.5 for n, p in ref.named_parameters()}
    load_published(model, new)
    for n, p in ref.named_parameters():
        p.data.mul_(0.5)
    with torch.no_grad():
        torch.testing.assert_close(model.hidden_states(ids, positions, attn, FUSED_OPS),
                                   ref.hidden_states(ids, positions, attn), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w[: a.q_proj.out_features], ref.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-asym", "w8a8-int8", "w8a8-fp8"])
def test_fused_quantized_projections_match_and_load_in_place(scheme):
    torch.manual_seed(0)
    master = build_random_model("tiny", seed=2, std=0.2)
    for layer in master.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            lin.bias = torch.nn.Parameter(0.1 * torch.randn(lin.out_features))
    model = copy.deepcopy(master)
    quantize_model(model, scheme, QuantLinear)
    ref = copy.deepcopy(model)
    assert fuse_projections(model) == 2 * len(model.layers)
    a = model.layers[0].self_attn
    fused = a._fused_qkv.weight
    assert fused.shape == (a.q_proj.out_features + 2 * a.k_proj.out_features, a.q_proj.in_features)
    assert a.k_proj.qdata.data_ptr() == fused.qdata[a.q_proj.out_features :].data_ptr()
    assert a.k_proj.scales.data_ptr() == fused.scales[a.q_proj.out_features :].data_ptr()
    ids = torch.randint(0, 128, (2, 7))
    positions, attn = batch_attention(ids)
    with torch.no_grad():
        torch.testing.assert_close(model.hidden_states(ids, positions, attn, FUSED_OPS),
                                   ref.hidden_states(ids, positions, attn), rtol=1e-5, atol=1e-5)

    # publish new weights by module name (packed, as QATLinear.publish hands them over)
    published = {}
    for name, mod in ref.named_modules():
        if isinstance(mod, QuantLinear):
            w = dict(master.named_modules())[name].weight.detach() * -0.7
            published[name] = quantize_weight(w, mod.scheme)
            mod.load_quantized(published[name])
    load_published(model, published)
    with torch.no_grad():
        got = model.hidden_states(ids, positions, attn, FUSED_OPS)
        want = ref.hidden_states(ids, positions, attn)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, copy.deepcopy(master).hidden_states(ids, positions, attn, FUSED_OPS))


@pytest.mark.parametrize("scheme", ["w8a8-int8", "w8a8-fp8"])
def test_gated_gate_up_gemm_in_the_fused_forward(scheme, monkeypatch):
    """At 16 < M <= 64 a W8A8 gate/up runs the gated GEMM (SiLU-and-mul in its epilogue, the
    down quantizer from its row-max partials): the same hidden states, bit for bit, as the
    plain GEMM + SiLU-and-mul path, and the model's own forward."""
    from quarl.quant import ops, use_backend

    model = build_random_model("tiny", seed=4, std=0.2)
    quantize_model(model, scheme, QuantLinear)
    ref = copy.deepcopy(model)
    fuse_projections(model)
    ids = torch.randint(0, 128, (3, 9))  # M = 27
    positions, attn = batch_attention(ids)
    ran = []
    gated = ops.gated_silu_quantized_input
    monkeypatch.setattr(ops, "gated_silu_quantized_input", lambda *a: ran.append(gated(*a)) or ran[-1])
    with torch.no_grad(), use_backend("triton"):
        got = model.hidden_states(ids, positions, attn, FUSED_OPS)
        assert len(ran) == len(model.layers) and all(r is not None for r in ran)
        monkeypatch.setattr(ops, "gated_silu_quantized_input", lambda *a: None)
        plain = model.hidden_states(ids, positions, attn, FUSED_OPS)
    with torch.no_grad():  # the reference backend (Triton's fp32 sums in another order flip fp8 codes)
        want = ref.hidden_states(ids, positions, attn)
    assert torch.equal(got, plain)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_nvfp4_projections_stay_separate():
    model = build_random_model("tiny", seed=2)
    quantize_model(model, "nvfp4", QuantLinear)  # one fp32 tensor scale per module: rows cannot be concatenated
    assert fuse_projections(model) == 0


@pytest.mark.parametrize("asym", [False, True])
def test_loading_one_part_refreshes_the_fused_fragment_copy(asym):
    """The w4 fragment copy of a fused weight is repacked for the loaded rows only, in the
    same storage; with rows not on 64-row slab edges and after an outside write too."""
    torch.manual_seed(0)
    scheme = "w4a16-asym" if asym else "w4a16"
    k = 256
    mods = [QuantLinear.from_linear(torch.nn.Linear(k, n, bias=False), scheme) for n in (64, 40, 24)]
    from quarl.rollout.fused import _concat_quantized_as_views

    group = _concat_quantized_as_views(mods)
    fuse_q, cache = group.weight, group.repacked
    frag = cache.get(fuse_q)
    ptr = frag.qdata.data_ptr()

    def check():
        want = repack_w4(fuse_q)
        got = cache.get(fuse_q)  # must already be fresh: no rebuild here
        assert got.qdata.data_ptr() == ptr
        for a, b in zip(got, want):
            if a is not None:
                assert torch.equal(a, b)

    for i, mod in enumerate(mods):  # a load into each part, the middle one spans two slabs
        mod.load_quantized(quantize_weight(torch.randn(mod.out_features, k) * (i + 1), scheme))
        assert cache.is_fresh(fuse_q)
        check()
    fuse_q.scales.mul_(2.0)  # an outside write: the next load repacks everything
    assert not cache.is_fresh(fuse_q)
    mods[0].load_quantized(quantize_weight(torch.randn(64, k), scheme))
    check()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kv_equals_rope_then_cache_copies(dtype):
    """The one-launch rope + K/V cache write gives rope(q) and the cache contents of
    rope(q), rope(k) and two index_copy_ calls, bit for bit; other slots stay untouched."""
    from quarl.rollout.fused import rope, rope_store_kv

    torch.manual_seed(4)
    n, hq, hkv, d, blocks, bs = 5, 6, 2, 16, 4, 4
    qkv = torch.randn(n, (hq + 2 * hkv) * d).to(dtype)  # strided views, as the fused projection gives
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
    ang = torch.randn(n, d // 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    slots = torch.randperm(blocks * bs)[:n]
    kc, vc = (torch.randn(blocks, bs, hkv, d).to(dtype) for _ in range(2))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kc_ref.view(-1, hkv, d).index_copy_(0, slots, rope(k, cos, sin))
    vc_ref.view(-1, hkv, d).index_copy_(0, slots, v)
    out = rope_store_kv(q, k, v, cos, sin, kc, vc, slots)
    assert torch.equal(out, rope(q, cos, sin))
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kv_with_qk_norms_is_rope_of_the_normed_rows(dtype, kv):
    """Qwen3's q / k RMSNorms inside the one launch: rope(rmsnorm(q)) and the cache contents of
    rope(rmsnorm(k)) (codes and scales with an fp8 cache). The sum of squares is added in
    another order than rmsnorm's: float32 rows a few ulps apart; bfloat16 ones equal but for a
    rounding tie now and then."""
    from quarl.model.transformer import RMSNorm
    from quarl.quant.kv import quantize_kv
    from quarl.rollout.fused import rmsnorm, rope, rope_store_kv

    torch.manual_seed(6)
    n, hq, hkv, d, blocks, bs = 7, 6, 2, 32, 4, 4
    qkv = (torch.randn(n, (hq + 2 * hkv) * d) * torch.logspace(-2, 2, n)[:, None]).to(dtype)
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
    qn, kn = RMSNorm(d, eps=1e-6), RMSNorm(d, eps=1e-5)
    with torch.no_grad():
        qn.weight.copy_(1 + 0.3 * torch.randn(d))
        kn.weight.copy_(1 + 0.3 * torch.randn(d))
    qn, kn = qn.to(dtype), kn.to(dtype)
    ang = torch.randn(n, d // 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    slots = torch.randperm(blocks * bs)[:n]
    qr = rope(rmsnorm(q, qn.weight, qn.eps), cos, sin)
    kr = rope(rmsnorm(k, kn.weight, kn.eps), cos, sin)
    ulp = dict(rtol=2 ** -7, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-7)
    most = 0.97 if dtype == torch.bfloat16 else 0.0  # (share of bit-equal values)
    if kv == "fp8":
        kc, vc = (torch.zeros(blocks, bs, hkv, d, dtype=torch.float8_e4m3fn) for _ in range(2))
        ks, vs = torch.zeros(blocks, bs, hkv), torch.zeros(blocks, bs, hkv)
        out = rope_store_kv(q, k, v, cos, sin, kc, vc, slots, ks, vs, qk_norm=(qn, kn))
        codes, scales = quantize_kv(kr)
        got = kc.view(-1, hkv, d)[slots].float() * ks.view(-1, hkv)[slots][..., None]
        torch.testing.assert_close(got, codes.float() * scales[..., None], rtol=2 ** -3, atol=0)
        assert (kc.view(torch.uint8).view(-1, hkv, d)[slots] == codes.view(torch.uint8)).float().mean() >= most
        assert torch.equal(vc.view(torch.uint8).view(-1, hkv, d)[slots], quantize_kv(v)[0].view(torch.uint8))
    else:
        kc, vc = (torch.zeros(blocks, bs, hkv, d, dtype=dtype) for _ in range(2))
        out = rope_store_kv(q, k, v, cos, sin, kc, vc, slots, qk_norm=(qn, kn))
        torch.testing.assert_close(kc.view(-1, hkv, d)[slots], kr, **ulp)
        assert (kc.view(-1, hkv, d)[slots] == kr).float().mean() >= most
        assert torch.equal(vc.view(-1, hkv, d)[slots], v)
    torch.testing.assert_close(out, qr, **ulp)
    assert (out == qr).float().mean() >= most
    assert not torch.allclose(out, rope(q, cos, sin))  # (the norms did run)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_silu_with_fused_quantizer_give_the_quantizers_codes(fmt, dtype):
    """rmsnorm / silu_mul with ``quant=`` return exactly what quarl.quant's per-token
    quantizer makes of their plain outputs (codes and scales, bit for bit)."""
    from quarl.quant.kernels import launch
    from quarl.rollout.fused import rmsnorm, silu_mul

    torch.manual_seed(3)
    x = (torch.randn(5, 200) * 3).to(dtype)
    r = torch.randn(5, 200).to(dtype)
    w = (1 + 0.3 * torch.randn(200)).to(dtype)
    x[2] = 0  # a zero row: scale 1, codes 0
    r[2] = 0
    r1, r2 = r.clone(), r.clone()
    plain = rmsnorm(x, w, 1e-6, r1)
    q, s = rmsnorm(x, w, 1e-6, r2, quant=fmt)
    assert torch.equal(r1, r2)  # residual sum still written
    q_ref, s_ref = launch.act_quant(plain, fmt)
    assert torch.equal(s, s_ref) and s[2] == 1.0
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))

    g, u = (torch.randn(3, 150) * 2).to(dtype), torch.randn(3, 150).to(dtype)  # 150: several column blocks
    q, s = silu_mul(g, u, quant=fmt)
    q_ref, s_ref = launch.act_quant(silu_mul(g, u), fmt)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_persistent_silu_mul_quantizer_gives_the_quantizers_codes(fmt, dtype):
    """The many-rows path of ``silu_mul(quant=)`` (one persistent program per few rows, y
    through a reused scratch row): codes and scales equal ``act_quant(silu_mul(g, u))`` bit
    for bit, with programs that take several rows and rows spanning several column blocks."""
    from quarl.quant.kernels import launch
    from quarl.rollout.fused import _silu_mul_quant_rows, silu_mul

    torch.manual_seed(4)
    g, u = (torch.randn(11, 150) * 3).to(dtype), torch.randn(11, 150).to(dtype)
    g[5] = 0  # a zero row: scale 1, codes 0
    q_ref, s_ref = launch.act_quant(silu_mul(g, u), fmt)
    for per_sm in (1, 2):  # 4 and 8 programs for 11 rows (the CPU counts 4 SMs)
        q, s = _silu_mul_quant_rows(g, u, fmt, per_sm=per_sm, block=64, num_warps=4)
        assert torch.equal(s, s_ref) and s[5] == 1.0
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kv_writes_fp8_codes_of_the_quantizer(dtype):
    """With an fp8 cache the one-launch rope + store writes exactly ``quantize_kv`` of rope(k)
    and of v (codes and scales, bit for bit) into the token's slots; rope(q) is unchanged and
    other slots stay untouched."""
    from quarl.quant.kv import quantize_kv
    from quarl.rollout.fused import rope, rope_store_kv

    torch.manual_seed(5)
    n, hq, hkv, d, blocks, bs = 6, 6, 3, 16, 4, 4
    qkv = torch.randn(n, (hq + 2 * hkv) * d).to(dtype)
    qkv[:, hq * d :] *= torch.logspace(-3, 3, n)[:, None].to(dtype)  # rows of very different magnitude
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
    v[2, 1] = 0  # a zero row
    ang = torch.randn(n, d // 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
    slots = torch.randperm(blocks * bs)[:n]
    kc, vc = (torch.randn(blocks, bs, hkv, d).to(torch.float8_e4m3fn) for _ in range(2))
    ks, vs = torch.rand(blocks, bs, hkv), torch.rand(blocks, bs, hkv)
    before = [t.clone() for t in (kc, vc, ks, vs)]
    out = rope_store_kv(q, k, v, cos, sin, kc, vc, slots, ks, vs)
    assert torch.equal(out, rope(q, cos, sin))
    for (codes, scales), (cache, scale_cache), (old_c, old_s) in zip(
        (quantize_kv(rope(k, cos, sin)), quantize_kv(v)), ((kc, ks), (vc, vs)),
        ((before[0], before[2]), (before[1], before[3]))
    ):
        rows, srows = cache.view(torch.uint8).view(-1, hkv, d), scale_cache.view(-1, hkv)
        assert torch.equal(rows[slots], codes.view(torch.uint8))
        assert torch.equal(srows[slots], scales)
        others = torch.ones(blocks * bs, dtype=torch.bool)
        others[slots] = False
        assert torch.equal(rows[others], old_c.view(torch.uint8).view(-1, hkv, d)[others])
        assert torch.equal(srows[others], old_s.view(-1, hkv)[others])


def test_dense_weight_copies_follow_published_weights_in_the_fused_model():
    """``dense_weights``: each weight-only GEMM the engine runs (fused q/k/v and gate/up once,
    o and down) keeps a dense copy; after publishing new weights by module name (fused parts
    refresh their rows) the fused forward on the copies equals a model that dequantizes per
    call, bit for bit, and the copies kept their addresses. W8A8 GEMMs have no copy."""
    from quarl.quant import ops
    from quarl.rollout.dense_weights import use_dense_weights, weight_only_caches

    torch.manual_seed(0)
    master = build_random_model("tiny", seed=2, std=0.2)
    fp8 = copy.deepcopy(master)
    quantize_model(fp8, "w8a8-fp8", QuantLinear)
    fuse_projections(fp8)
    assert weight_only_caches(fp8) == []
    model = copy.deepcopy(master)
    quantize_model(model, "w4a16", QuantLinear)
    ref = copy.deepcopy(model)
    fuse_projections(model)
    caches = weight_only_caches(model)
    assert len(caches) == 4 * len(model.layers)
    for cache, _ in caches:
        cache.dense = True
    ids = torch.randint(0, 128, (2, 60))  # 120 rows: the plan is the plain GEMM on the dense copy off the GPU
    positions, attn = batch_attention(ids)
    with ops.use_backend("triton"), torch.no_grad():
        model.hidden_states(ids, positions, attn, FUSED_OPS)
        ptrs = [c.dequantized(qw, torch.float32, None).data_ptr() for c, qw in caches]
        published = {}
        for name, mod in ref.named_modules():
            if isinstance(mod, QuantLinear):
                published[name] = quantize_weight(dict(master.named_modules())[name].weight.detach() * -0.7, mod.scheme)
                mod.load_quantized(published[name])
        load_published(model, published)
        got = model.hidden_states(ids, positions, attn, FUSED_OPS)
        want = ref.hidden_states(ids, positions, attn, FUSED_OPS)
        assert [c.dequantized(qw, torch.float32, None).data_ptr() for c, qw in caches] == ptrs
    assert torch.equal(got, want)
    assert use_dense_weights("auto", 8 << 30, 80 << 30) and not use_dense_weights("auto", 9 << 30, 80 << 30)
    assert not use_dense_weights("auto", 1, 0) and use_dense_weights("on", 1, 0) and not use_dense_weights("off", 1,
                                                                                                           1 << 40)


def test_the_engine_marks_its_weight_only_gemms_dense_per_setting():
    """``EngineConfig.dense_weights``: "on" marks every weight-only GEMM's cache and reports
    the bytes its copies take; "auto" off a GPU keeps none; a bad value is a clear error."""
    from quarl.rollout import Engine, EngineConfig
    from quarl.rollout.dense_weights import weight_only_caches

    model = build_random_model("tiny", seed=2)
    cfg = dict(max_model_len=32, block_size=4, num_kv_blocks=16, attention_backend="triton")
    on = Engine(copy.deepcopy(model), "w4a16", EngineConfig(**cfg, dense_weights="on"))
    caches = weight_only_caches(on.model)
    want = sum(qw.shape[0] * qw.shape[1] for _, qw in caches) * 4  # float32 model
    assert caches and all(c.dense for c, _ in caches) and on.runner.dense_weight_bytes == want
    auto = Engine(copy.deepcopy(model), "w4a16", EngineConfig(**cfg, dense_weights="auto"))
    assert auto.runner.dense_weight_bytes == 0 and not any(c.dense for c, _ in weight_only_caches(auto.model))
    from quarl.quant.kernels.invariant_model import ExactMode

    exact_model = copy.deepcopy(model)
    exact_model.exact = ExactMode(4)  # exact mode keeps them too (its dense kernel gives the packed bits)
    exact = Engine(exact_model, "w4a16", EngineConfig(**cfg, dense_weights="on"))
    caches = weight_only_caches(exact.model)
    assert caches and all(c.dense for c, _ in caches) and exact.runner.dense_weight_bytes == want
    with pytest.raises(ValueError, match="dense_weights must be auto, on or off"):
        EngineConfig(dense_weights="yes")


@pytest.mark.parametrize("scheme", [None, "w4a16", "w8a8-fp8"])
def test_fused_projections_with_lora_adapters_match_and_load_in_place(scheme):
    """Adapted q/k/v and gate/up still run as one base GEMM each: their adapters add into the
    fused output's columns (and the W8A8 quantizer then reads plain rows), giving the model's
    own forward; adapters published by name reach the fused path."""
    from quarl.model.lora import add_lora, lora_modules

    torch.manual_seed(0)
    model = build_random_model("tiny", seed=4, std=0.2)
    if scheme is not None:
        quantize_model(model, scheme, QuantLinear)
    add_lora(model, rank=3, alpha=6, targets=("q_proj", "v_proj", "up_proj", "down_proj"))
    with torch.no_grad():
        for _, _, ad in lora_modules(model):
            ad.A.normal_(0, 0.2)
            ad.B.normal_(0, 0.2)
    ref = copy.deepcopy(model)
    assert fuse_projections(model) == 2 * len(model.layers)
    fused = model.layers[0].self_attn._fused_qkv
    group = fused.adapters
    assert group.A.shape == (6, 64) and group.B.shape == (128, 6) and fused.act_format is None
    q, v = model.layers[0].self_attn.q_proj.lora, model.layers[0].self_attn.v_proj.lora
    assert q.A.data_ptr() == group.A.data_ptr() and v.B.data_ptr() == group.B[96:, 3:].data_ptr()
    assert not group.B[64:96].any() and not group.B[:64, 3:].any() and not group.B[96:, :3].any()
    # the term the w4a16 kernel adds per 64-row slab: each member's rows take its own columns
    term = group.term(torch.randn(5, 64, dtype=group.A.dtype))
    assert (term.rank, term.starts, term.cols) == (3, (0, 96), (0, 3))
    for width in (3, 64):
        by_member = ref_quant.lora_term_by_member(term.xa, term.b, term.scaling, term.starts, term.cols, width)
        torch.testing.assert_close(by_member, 2.0 * term.xa.double() @ term.b.double().T, rtol=1e-12, atol=1e-12)
    ids = torch.randint(0, 128, (2, 7))
    positions, attn = batch_attention(ids)
    with torch.no_grad():
        want = ref.hidden_states(ids, positions, attn)
        torch.testing.assert_close(model.hidden_states(ids, positions, attn, FUSED_OPS), want, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            for _, _, ad in lora_modules(ref):
                ad.B.mul_(-2.0)
        load_published(model, {f"{n}.lora.B": ad.B.detach() for n, _, ad in lora_modules(ref)})
        got = model.hidden_states(ids, positions, attn, FUSED_OPS)
        want2 = ref.hidden_states(ids, positions, attn)
    torch.testing.assert_close(got, want2, rtol=1e-5, atol=1e-5)
    assert (want2 - want).abs().max() > 1e-2


def test_dense_copies_of_moe_experts_give_the_same_samples():
    """``dense_weights="on"`` keeps one dense copy per MoE projection of all experts too (the
    bytes reported with the rest), and the engine samples the same tokens with the same
    log-probs as one that dequantizes at each step."""
    from quarl.quant.experts import PackedExperts
    from quarl.rollout import Engine, EngineConfig, SamplingParams
    from quarl.rollout.dense_weights import weight_only_caches

    model = build_random_model("moe-tiny", seed=4)
    cfg = dict(max_model_len=32, block_size=4, num_kv_blocks=32)
    on = Engine(copy.deepcopy(model), "w4a16", EngineConfig(**cfg, dense_weights="on"))
    off = Engine(copy.deepcopy(model), "w4a16", EngineConfig(**cfg, dense_weights="off"))
    experts = [m for m in on.model.modules() if isinstance(m, PackedExperts)]
    caches = weight_only_caches(on.model)
    assert len(experts) == 4 and all(any(c is m.repacked for c, _ in caches) for m in experts)
    assert on.runner.dense_weight_bytes == sum(qw.shape[0] * qw.shape[1] for _, qw in caches) * 4
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=5, ignore_eos=True)
    a, b = on.generate([[1, 2, 3], [7, 8]], params), off.generate([[1, 2, 3], [7, 8]], params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]


def test_auto_dense_copies_of_an_moe_model_fall_back_to_its_attention():
    """``dense_weights="auto"`` (:func:`dense_weight_plan`): every weight-only GEMM's copy where
    all fit the GPU's share, else the GEMMs outside the MoE experts (attention) where those fit,
    else none; exact mode never copies the experts (its grouped kernel reads the codes)."""
    from quarl.quant.experts import PackedExperts
    from quarl.rollout.dense_weights import DENSE_AUTO_FRACTION, dense_bytes, dense_weight_plan, weight_only_caches

    model = build_random_model("moe-tiny", seed=4)
    quantize_model(model, "w4a16", QuantLinear)
    every = weight_only_caches(model)
    attention = weight_only_caches(model, experts=False)
    experts = [m.repacked for m in model.modules() if isinstance(m, PackedExperts)]
    assert experts and len(attention) == len(every) - len(experts)
    assert not any(any(c is e for e in experts) for c, _ in attention)
    all_b, attn_b = dense_bytes(every, 2), dense_bytes(attention, 2)
    assert 0 < attn_b < all_b
    gpu = int(all_b / DENSE_AUTO_FRACTION) + 1  # everything fits its share
    assert dense_weight_plan("auto", model, 2, gpu) == every
    gpu = int(attn_b / DENSE_AUTO_FRACTION) + 1  # only the attention's copies fit
    assert dense_weight_plan("auto", model, 2, gpu) == attention
    assert dense_weight_plan("auto", model, 2, gpu - 2) == [] == dense_weight_plan("off", model, 2, 1 << 50)
    assert dense_weight_plan("on", model, 2, 0) == every
    assert dense_weight_plan("on", model, 2, 0, exact=True) == attention
    assert dense_weight_plan("auto", model, 2, 1 << 50, exact=True) == attention
