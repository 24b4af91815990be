"""The learner's GPU paths: the fused LM-head log-probs and the compiled forward steps
against the eager float32 formulation, at a real vocabulary size."""

from __future__ import annotations

import pytest
import torch

from quarl.learner.logprobs import sequence_logprobs, token_logprobs
from quarl.learner.compiled_ops import COMPILED_OPS
from quarl.model.presets import build_random_model

DEV = torch.device("cuda")


def test_fused_lm_head_logprobs_match_float32_formulation():
    gen = torch.Generator(device=DEV).manual_seed(0)
    n, hdim, v = 3000, 1536, 151936
    h = (torch.randn(n, hdim, device=DEV, generator=gen) * 0.05).bfloat16().requires_grad_(True)
    w = (torch.randn(v, hdim, device=DEV, generator=gen) * 0.05).bfloat16().requires_grad_(True)
    tgt = torch.randint(0, v, (n,), device=DEV, generator=gen)
    g = torch.randn(n, device=DEV, generator=gen)
    for temp in (1.0, 0.7):
        lp, ent = token_logprobs(h, w, tgt, temperature=temp, with_entropy=True, fused=True)
        lp0, ent0 = token_logprobs(h, w, tgt, temperature=temp, with_entropy=True, fused=False)
        torch.testing.assert_close(lp, lp0, rtol=0, atol=2e-5)
        torch.testing.assert_close(ent, ent0, rtol=0, atol=2e-4)
        gh, gw = torch.autograd.grad((lp * g).sum(), (h, w))
        gh0, gw0 = torch.autograd.grad((lp0 * g).sum(), (h, w))
        assert (gh.float() - gh0.float()).norm() <= 1e-2 * gh0.float().norm()
        assert (gw.float() - gw0.float()).norm() <= 1e-2 * gw0.float().norm()


def test_compiled_forward_is_as_accurate_as_eager_on_a_bf16_model():
    """Against the same weights in float32, the compiled bf16 forward's log-probs and
    gradients are as close as the eager bf16 forward's (the two round at the same steps)."""
    import copy

    torch.manual_seed(0)
    model = build_random_model("100m", dtype=torch.bfloat16).to(DEV)
    ref_model = copy.deepcopy(model).float()
    ids = torch.randint(0, model.config.vocab_size, (4, 300), device=DEV)
    mask = torch.ones_like(ids)
    mask[1, 250:] = 0
    g = torch.randn(4, 299, device=DEV) * mask[:, 1:]
    out = []
    for m, kw in ((ref_model, {}), (model, {}), (model, {"ops": COMPILED_OPS})):
        m.zero_grad()
        lp, _ = sequence_logprobs(m, ids, mask, **kw)
        (lp * g).sum().backward()
        out.append((lp.detach(), {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}))
    (lp_ref, g_ref), (lp0, g0), (lp1, g1) = out
    real = mask[:, 1:].bool()
    err0, err1 = (lp0 - lp_ref)[real].abs().mean(), (lp1 - lp_ref)[real].abs().mean()
    assert err1 <= 1.5 * err0 + 1e-5, (float(err0), float(err1))
    assert g0.keys() == g1.keys() == g_ref.keys()
    for n in g_ref:
        e0, e1 = (g0[n] - g_ref[n]).norm(), (g1[n] - g_ref[n]).norm()
        assert e1 <= 1.5 * e0 + 1e-3 * g_ref[n].norm(), (n, float(e0), float(e1), float(g_ref[n].norm()))


@pytest.mark.parametrize("scheme", [None, "w4a16", "w8a8-fp8", "w8a8-int8"])
def test_compiled_regions_run_every_layer_of_an_aligned_model_as_accurately_as_the_steps(scheme, monkeypatch):
    """At learner batch sizes every layer of a bf16 or aligned model runs as the compiled
    regions (no layer falls back to the step-by-step path), and their log-probs and
    gradients are as close to the eager forward's as the step-by-step compiled path's are
    (bf16 summation order; W8A8 codes that flip with it)."""
    from quarl.learner import compiled_ops
    from quarl.model.transformer import TORCH_OPS
    from quarl.quant import quantize_model

    torch.manual_seed(1)
    model = build_random_model("100m", dtype=torch.bfloat16).to(DEV)
    if scheme is not None:
        quantize_model(model, scheme)
    ids = torch.randint(0, model.config.vocab_size, (3, 260), device=DEV)
    mask = torch.ones_like(ids)
    mask[2, 200:] = 0
    g = torch.randn(3, 259, device=DEV) * mask[:, 1:]
    real = mask[:, 1:].bool()

    def run(ops, regions):
        before = COMPILED_OPS.fallbacks
        model.zero_grad()
        with monkeypatch.context() as m:
            if not regions:
                m.setattr(compiled_ops, "_traced_group", lambda *a: None)
            lp, _ = sequence_logprobs(model, ids, mask, right_padded=True, ops=ops)
            (lp * g).sum().backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        return lp.detach()[real], grads, COMPILED_OPS.fallbacks - before

    lp0, g0, _ = run(TORCH_OPS, False)
    lp1, g1, steps = run(COMPILED_OPS, False)
    lp2, g2, fallbacks = run(COMPILED_OPS, True)
    layers = model.config.num_hidden_layers
    assert (steps, fallbacks) == (layers, 0)
    lp_err1, lp_err2 = (lp1 - lp0).abs().mean(), (lp2 - lp0).abs().mean()
    g_err1, g_err2 = (g1 - g0).norm() / g0.norm(), (g2 - g0).norm() / g0.norm()
    assert lp_err2 <= 2 * lp_err1 + 1e-3, (float(lp_err1), float(lp_err2))
    assert g_err2 <= 2 * g_err1 + 1e-3, (float(g_err1), float(g_err2))


def _norm_then_quantize(x, w, fmt: str):
    """An RMSNorm and the reference per-token quantizer, as the compiled region fuses them."""
    from quarl.model.transformer import rms_norm
    from quarl.quant import reference as ref

    h = rms_norm(x, w, 1e-6)
    q, s = ref.quantize_activations(h.reshape(-1, h.shape[-1]), fmt)
    return h, q, s, ref.dequantize_activations(q, s, h.dtype)


def test_the_compiled_regions_kv_rounding_gives_the_fp8_cache_values_bit_for_bit():
    """:func:`~quarl.quant.kv.kv_seen` compiled (as the regions run it) equals the eager round
    trip through the cache format bit for bit on bf16 K/V rows of widely spread magnitudes."""
    from quarl.quant.kv import fake_quantize_kv, kv_seen
    from quarl.runtime import compiled

    g = torch.Generator(device="cuda").manual_seed(0)
    mag = torch.logspace(-5, 3, 57, device="cuda")[None, :, None, None]
    x = (torch.randn(3, 57, 4, 128, device="cuda", generator=g) * mag).bfloat16()
    x[0, 3] = 0
    y = compiled(kv_seen)(x)
    assert torch.equal(y, fake_quantize_kv(x, fused=False)) and not torch.equal(y, x)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_the_compiled_regions_quantizer_gives_the_engine_kernels_codes_bit_for_bit(fmt):
    """The learner quantizes W8A8 activations inside its compiled regions (inductor's kernel
    from the reference's torch ops, IEEE division kept); the engine runs its Triton
    quantizer. Codes, scales and the dequantized values must be equal bit for bit, on rows of
    every magnitude, a zero row included."""
    from quarl.quant import ops
    from quarl.runtime import compiled

    x = torch.randn(3, 700, 1536, device=DEV, dtype=torch.bfloat16)
    x = x * torch.logspace(-4, 4, 700, device=DEV, dtype=torch.float32)[None, :, None].to(torch.bfloat16)
    x[1, 5] = 0
    w = (1 + 0.1 * torch.randn(1536, device=DEV)).to(torch.bfloat16)
    h, q, s, seen = compiled(_norm_then_quantize)(x, w, fmt)
    q0, s0, seen0 = ops.quantize_input(h.reshape(-1, 1536), fmt, torch.bfloat16)
    assert torch.equal(s, s0)
    assert torch.equal(q.view(torch.uint8) if fmt == "fp8" else q, q0.view(torch.uint8) if fmt == "fp8" else q0)
    assert torch.equal(seen, seen0)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_the_down_projections_codes_traced_into_a_region_equal_the_compilers_bit_for_bit(fmt):
    """:func:`~quarl.learner.swiglu.swiglu_codes` compiled (the persistent kernel's launch traced
    into the region, as the learner runs it) gives the scales of the eager torch-op reference
    bit for bit on stacked bf16 rows of widely spread magnitudes, and its codes (fp8) or all
    but a few, off by one (int8); the compiler's own quantizer over its SwiGLU agrees on all
    but a few codes."""
    from quarl.learner.compiled_ops import _gpu_sms
    from quarl.learner.swiglu import codes_reference, swiglu_codes
    from quarl.runtime import compiled

    g = torch.Generator(device=DEV).manual_seed(0)
    mag = torch.logspace(-4, 3, 700, device=DEV)[:, None]
    gu = (torch.randn(3, 700, 2 * 2240, device=DEV, generator=g) * mag).bfloat16()
    gu[1, 5] = 0
    rows = gu.reshape(-1, gu.shape[-1])
    sms = _gpu_sms(gu.device)
    q, s = compiled(lambda x: swiglu_codes(x.reshape(-1, x.shape[-1]), fmt, sms))(gu)
    q0, s0 = compiled(lambda x: codes_reference(x.reshape(-1, x.shape[-1]), fmt))(gu)
    q1, s1 = codes_reference(rows, fmt)
    assert torch.equal(s, s1) and s[705] == 1.0
    if fmt == "fp8":
        assert torch.equal(q.view(torch.uint8), q1.view(torch.uint8))
    else:  # the kernel's exp and eager's differ in the last fp32 bit: a SwiGLU value may round to the next bf16
        diff = (q.int() - q1.int()).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-4
    assert float((q.view(torch.uint8) == q0.view(torch.uint8)).float().mean()) > 0.999
    assert float((s == s0).float().mean()) > 0.99


def test_the_fp8_regions_kernel_codes_and_scaled_gemm_give_the_compilers_log_probs(monkeypatch):
    """An aligned w8a8-fp8 model's regions with the down projection's codes from the traced
    kernel and the GEMM called as ``torch._scaled_mm`` by the region (not the
    ``quarl::quantized_input_gemm`` op) give the log-probs of the regions that quantize with
    the compiler's kernels bit for bit, and their gradients."""
    from torch._inductor.utils import run_and_get_code

    from quarl.learner import compiled_ops
    from quarl.quant import quantize_model

    torch.manual_seed(1)
    model = build_random_model("100m", dtype=torch.bfloat16).to(DEV)
    quantize_model(model, "w8a8-fp8")
    ids = torch.randint(0, model.config.vocab_size, (3, 700), device=DEV)
    mask = torch.ones_like(ids)
    mask[2, 500:] = 0
    g = torch.randn(3, 699, device=DEV) * mask[:, 1:]

    def run():
        model.zero_grad()
        lp, _ = sequence_logprobs(model, ids, mask, right_padded=True, ops=COMPILED_OPS)
        (lp * g).sum().backward()
        return lp.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    torch._dynamo.reset()
    (lp1, g1), codes = run_and_get_code(run)
    assert any("_silu_mul_quant_rows_kernel" in c for c in codes)
    assert not any("quantized_input_gemm" in c for c in codes)
    monkeypatch.setattr(compiled_ops, "_gpu_sms", lambda device: None)
    torch._dynamo.reset()
    (lp0, g0), codes = run_and_get_code(run)
    assert not any("_silu_mul_quant_rows_kernel" in c for c in codes)
    assert torch.equal(lp1, lp0) and len(g1) == len(g0) > 10
    # (the attention backward sums in a varying order: plain runs differ by up to ~5e-3)
    flat1, flat0 = torch.cat([t.float().flatten() for t in g1]), torch.cat([t.float().flatten() for t in g0])
    assert float((flat1 - flat0).norm() / flat0.norm()) < 1e-2


@pytest.mark.parametrize("scheme", [None, "w4a16", "w8a8-fp8"])
def test_checkpointed_compiled_regions_give_the_same_values_and_less_memory(scheme):
    """Activation checkpointing around the compiled layer regions: the same log-probs bit for
    bit, gradients as close to a plain run's as plain runs are to each other, and a lower peak."""
    from quarl.model.transformer import CheckpointedOps
    from quarl.quant import quantize_model

    torch.manual_seed(1)
    model = build_random_model("100m", dtype=torch.bfloat16).to(DEV)
    if scheme is not None:
        quantize_model(model, scheme)
    ids = torch.randint(0, model.config.vocab_size, (4, 1024), device=DEV)
    mask = torch.ones_like(ids)
    g = torch.randn(4, 1023, device=DEV)

    def run(ops):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        before = COMPILED_OPS.fallbacks
        lp, _ = sequence_logprobs(model, ids, mask, right_padded=True, ops=ops)
        (lp * g).sum().backward()
        peak = torch.cuda.max_memory_allocated() - base
        assert COMPILED_OPS.fallbacks == before
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        return lp.detach(), grads, peak

    run(COMPILED_OPS)  # compile
    lp0, g0, peak0 = run(COMPILED_OPS)
    plain = [g0] + [run(COMPILED_OPS)[1] for _ in range(2)]
    lp2, g2, peak2 = run(CheckpointedOps(COMPILED_OPS))
    # the backward's atomics make runs differ by up to ~6e-3 (relative), but not every run: three
    # plain runs can agree to 1e-7 while the next one differs by 4e-3 (s23, s32), so the floor is
    # the largest difference among the plain runs, and never below what the atomics can give;
    # a checkpointed backward that rebuilt a wrong tensor would be off by far more
    floor = max([1e-2 / 2] + [float((a - b).norm() / g0.norm()) for i, a in enumerate(plain) for b in plain[i + 1 :]])
    rel = float((g2 - g0).norm() / g0.norm())
    print(f"scheme {scheme}: peak {peak0 / 2**20:.0f} MiB plain, {peak2 / 2**20:.0f} MiB checkpointed; "
          f"grads differ by {rel:.3g} (plain runs: {floor:.3g})")
    assert torch.equal(lp0, lp2)
    assert rel <= 2 * floor, (rel, floor)
    assert peak2 < 0.7 * peak0


def test_a_one_row_micro_batch_after_wider_ones_does_not_recompile_the_regions():
    """The learner's micro-batches vary in rows and length, a one-row one now and then: the
    compiled regions must serve every shape with the graphs the first micro-batch made. On
    the GPU the attention output entering the region after attention is a view (SDPA's
    kernels write [B, T, H, D] and return it transposed); a base whose batch size is
    specialised to >= 2 recompiles at the first one-row micro-batch (0.2-1.4 s once a run
    before :func:`quarl.runtime.compiled` marked the base's batch too)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = build_random_model("100m", dtype=torch.bfloat16).to(DEV)

    def step(rows: int, t: int, grad: bool = True) -> None:
        ids = torch.randint(3, model.config.vocab_size, (rows, t), device=DEV)
        mask = torch.ones_like(ids)
        mask[0, t - 3:] = 0
        with torch.set_grad_enabled(grad):
            lp, _ = sequence_logprobs(model, ids, mask, ops=COMPILED_OPS, right_padded=True)
            if grad:
                lp.float().sum().backward()

    step(3, 120, grad=False)  # as a run starts: log-probs without gradients, then the update's
    step(4, 90)
    graphs = counters["stats"]["unique_graphs"]
    for rows, t, grad in ((2, 97, True), (1, 140, True), (4, 64, True), (1, 33, False)):
        step(rows, t, grad)
    assert counters["stats"]["unique_graphs"] == graphs


def test_lean_learner_steps_on_the_gpu():
    """bf16 weights stepped directly with stochastic rounding, bf16 moments, checkpointed
    compiled regions: an update runs, moves the weights and keeps the moments in bf16."""
    from quarl.learner import Learner, UpdateSettings
    from quarl.learner.batch import build_batch
    from quarl.quant import quantize_model

    model = build_random_model("100m", dtype=torch.bfloat16).to(DEV)
    quantize_model(model, "w4a16")
    learner = Learner(model, lr=1e-6, fp32_master=False, state_dtype=torch.bfloat16, compile_ops=True,
                      activation_checkpointing=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 120, (20,), generator=gen).tolist() for _ in range(8)]
    responses = [torch.randint(3, 120, (200,), generator=gen).tolist() for _ in range(8)]
    batch = build_batch(prompts, responses, [[-1.0] * 200] * 8, [1.0, 0.0] * 4,
                        torch.tensor([1.0, -1.0] * 4)).to(DEV)
    w = model.layers[0].mlp.up_proj.weight
    before = w.detach().clone()
    out = learner.update(batch, UpdateSettings(loss_type="ppo", token_budget=2048))
    assert out["train/skipped_updates"] == 0.0
    assert (w != before).any()
    state = learner.optimizer.state[w]
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.bfloat16


def test_stacked_swiglu_backward_kernel_rounds_as_eager_autograd_on_bf16():
    """The Triton backward of the stacked SwiGLU against eager autograd of ``silu(gate) * up``
    on bf16 (the rounding the CPU interpreter cannot show), at the 1.5B shape's width and a
    ragged one."""
    from quarl.learner.swiglu import backward_reference, backward_triton

    gen = torch.Generator(device=DEV).manual_seed(0)
    for m, inter in [(6144, 8960), (37, 1100)]:
        gu = torch.randn(m, 2 * inter, device=DEV, generator=gen, dtype=torch.bfloat16) * 3
        g = torch.randn(m, inter, device=DEV, generator=gen, dtype=torch.bfloat16)
        x = gu.clone().requires_grad_(True)
        gate, up = x.chunk(2, dim=-1)
        (torch.nn.functional.silu(gate) * up).backward(g)
        got = backward_triton(gu, g)
        for want in (x.grad, backward_reference(gu, g)):
            rel = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)
            assert float(rel.max()) <= 2**-7 and float((got == want).float().mean()) > 0.99
