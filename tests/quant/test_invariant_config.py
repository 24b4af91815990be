"""``quant.exact``: off by default; on, accepted where both forwards run the batch-invariant
kernels for every op they share (bf16 mode, or aligned mode with w4a16 / w4a16-asym / w2a16 /
w8a8-int8 / w8a8-fp8, full or LoRA, on a dense model in bfloat16 or float32, either KV cache, an
unsharded learner) and refused when the config loads everywhere else, naming the reasons that
apply and what works. Behind the config, the exact forward refuses what it has no path for (a
W4A8 linear, an MoE block, a CPU without Triton's interpreter) instead of silently running
ordinary kernels, and runs a quantized linear on its codes and a LoRA layer over the invariant
GEMMs."""

import dataclasses

import pytest
import torch

from quarl.config.run import load_run_config
from quarl.config.typed import ConfigError
from quarl.model.presets import build_random_model, preset_config

REFUSED = "quant.exact=true is refused: "
WORKS = ("What works: quant.exact=true with quant.mode=bf16, or quant.mode=aligned and quant.scheme "
         "w4a16 / w4a16-asym / w2a16 / w8a8-int8 / w8a8-fp8, full or LoRA, on a dense model")


def test_exact_is_off_by_default_and_false_loads():
    assert load_run_config(None, []).quant.exact is False
    assert load_run_config(None, ["--quant.exact=false", "--quant.mode=aligned"]).quant.exact is False


@pytest.mark.parametrize("flags", [
    "--quant.mode=bf16",
    "--quant.mode=bf16 --model.dtype=bfloat16",
    "--quant.mode=bf16 --model.dtype=float32 --rollout.engine.kv_cache_dtype=fp8",
    "--quant.mode=bf16 --model.builtin=100m --trainer.activation_checkpointing=true --trainer.mini_batches=2",
    "--quant.mode=aligned",
    "--quant.mode=aligned --quant.scheme=w4a16 --model.dtype=bfloat16 --rollout.engine.kv_cache_dtype=fp8",
    "--quant.mode=aligned --quant.scheme=w4a16-asym",
    "--quant.mode=aligned --quant.scheme=w2a16 --model.dtype=float32",
    "--quant.mode=aligned --quant.scheme=w4a16 --quant.exclude=[layers.0.*]",
    "--quant.mode=aligned --quant.scheme=w8a8-fp8 --rollout.engine.kv_cache_dtype=fp8",
    "--quant.mode=aligned --quant.scheme=w8a8-int8",
    "--quant.mode=aligned --quant.scheme=w4a16 --model.lora_rank=8",
    "--quant.mode=bf16 --model.lora_rank=8",
    "--quant.mode=bf16 --model.builtin=moe-tiny --model.dtype=bfloat16",
    "--quant.mode=aligned --quant.scheme=w4a16 --model.builtin=moe-tiny --model.dtype=bfloat16 "
    "--rollout.routing_replay=r3 --rollout.engine.kv_cache_dtype=fp8",
    "--quant.mode=aligned --quant.scheme=w8a8-fp8 --model.builtin=moe-tiny --model.dtype=bfloat16 --model.lora_rank=4",
], ids=["bf16", "bf16-bfloat16", "bf16-float32-kvfp8", "bf16-100m-checkpointing", "aligned-default-w4a16",
        "aligned-w4a16-kvfp8", "aligned-w4a16-asym", "aligned-w2a16-float32", "aligned-w4a16-exclude",
        "aligned-fp8-kvfp8", "aligned-int8", "aligned-w4a16-lora", "bf16-lora", "moe-bf16", "moe-w4a16-r3-kvfp8",
        "moe-fp8-lora"])
def test_what_is_wired_loads(flags):
    assert load_run_config(None, ["--quant.exact=true", *flags.split()]).quant.exact is True


@pytest.mark.parametrize("flags,reason", [
    ("--quant.mode=rollout --quant.scheme=w4a16", "quant.mode=rollout (quant.scheme=w4a16): the learner's "
     "full-precision weights are not the engine's"),
    ("--quant.mode=rollout --quant.scheme=nvfp4", "quant.mode=rollout (quant.scheme=nvfp4): the learner's"),
    ("--quant.mode=aligned --quant.scheme=w4a8-int8", "quant.mode=aligned with quant.scheme=w4a8-int8: no batch-"
     "invariant W4A8 GEMM"),
    ("--quant.mode=aligned --quant.scheme=nvfp4", "quant.mode=aligned with quant.scheme=nvfp4: the fp4 formats"),
    ("--quant.mode=aligned --quant.scheme=mxfp4", "quant.mode=aligned with quant.scheme=mxfp4: the fp4 formats"),
    ("--quant.mode=aligned --quant.include=[layers.*,lm_head]", "quant.include selects lm_head: exact mode's LM head"),
    ("--quant.mode=bf16 --model.builtin=moe-tiny", "an MoE model in model.dtype=auto: the invariant grouped"),
    ("--quant.mode=aligned --quant.scheme=w2a16 --model.builtin=moe-tiny --model.dtype=bfloat16",
     "an MoE model with quant.scheme=w2a16: the grouped expert kernel"),
    ("--quant.mode=bf16 --model.builtin=moe-tiny --model.dtype=bfloat16 --model.lora_rank=4 "
     "--model.lora_targets=[q_proj,experts]", "model.lora_targets names experts"),
    ("--quant.mode=bf16 --model.dtype=float16", "model.dtype=float16: the invariant kernels"),
    ("--quant.mode=bf16 --trainer.shard_learner=true", "trainer.shard_learner=true: a sharded learner"),
], ids=["rollout-w4a16", "rollout-nvfp4", "aligned-w4a8", "aligned-nvfp4", "aligned-mxfp4", "aligned-lm-head",
        "moe-auto-dtype", "moe-w2a16", "moe-expert-lora", "fp16", "sharded"])
def test_the_rest_is_refused_naming_why_and_what_works(flags, reason):
    with pytest.raises(ConfigError) as e:
        load_run_config(None, ["--quant.exact=true", *flags.split()])
    msg = str(e.value)
    assert msg.startswith(REFUSED) and reason in msg and WORKS in msg and msg.endswith("or quant.exact=false")


def test_every_reason_that_applies_is_named_once():
    with pytest.raises(ConfigError) as e:
        load_run_config(None, ["--quant.exact=true", "--quant.mode=aligned", "--quant.scheme=nvfp4",
                               "--model.dtype=float16", "--trainer.shard_learner=true"])
    reasons = str(e.value).removeprefix(REFUSED).split(". What works")[0].split("; ")
    assert [r.split(":")[0].split(" (")[0] for r in reasons] == [
        "quant.mode=aligned with quant.scheme=nvfp4", "model.dtype=float16", "trainer.shard_learner=true"]


def _tiny(scheme=None):
    model = build_random_model(dataclasses.replace(preset_config("tiny"), vocab_size=64), dtype=torch.float32)
    if scheme is not None:
        from quarl.quant import QuantLinear, quantize_model

        quantize_model(model, scheme, QuantLinear)
    return model


def test_the_exact_forward_refuses_layers_it_has_no_path_for():
    from quarl.model.lora import add_lora
    from quarl.quant.kernels.invariant_model import EXACT_OPS, exact_linear

    model = _tiny("w4a8-int8")
    with pytest.raises(NotImplementedError, match="no W4A8 GEMM \\(w4a8-int8 on QuantLinear\\)"):
        exact_linear(model.layers[0].self_attn.q_proj, torch.randn(2, 64))
    moe = build_random_model("moe-tiny", dtype=torch.bfloat16)
    add_lora(moe, 4, 8.0, ("q_proj", "experts"))
    sparse = next(layer.mlp for layer in moe.layers if type(layer.mlp).__name__ == "SparseMoeBlock")
    with pytest.raises(NotImplementedError, match="no path for LoRA adapters on experts"):
        EXACT_OPS.mlp(sparse, torch.randn(1, 2, 64, dtype=torch.bfloat16))


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-asym", "w2a16", "w8a8-int8", "w8a8-fp8"])
def test_a_quantized_linear_runs_the_invariant_gemm_on_its_codes(scheme):
    """The engine's QuantLinear and the learner's QATLinear over one weight: the invariant GEMM
    of the same codes (W8A8: of each row's per-token codes too), the same bits (alone and in a
    batch); the QAT gradient is straight-through (``g @ W_deq`` to x, ``g^T x`` to the master
    weight)."""
    from quarl.quant import QATLinear, QuantLinear
    from quarl.quant.kernels.invariant import invariant_linear
    from quarl.quant.kernels.invariant_model import exact_linear

    torch.manual_seed(0)
    base = torch.nn.Linear(160, 24, bias=True)
    qat, served = QATLinear.from_linear(base, scheme), QuantLinear.from_linear(base, scheme)
    x = torch.randn(5, 160)
    with torch.no_grad():
        y = exact_linear(served, x)
        assert torch.equal(y, exact_linear(qat, x))
        assert torch.equal(y, invariant_linear(x, qat.quantized_weight(), base.bias))
        assert torch.equal(y[2:3], exact_linear(served, x[2:3]))
        torch.testing.assert_close(y, qat(x), atol=1e-4, rtol=1e-4)  # the ordinary aligned forward, summed otherwise
    xg = x.clone().requires_grad_(True)
    yg = exact_linear(qat, xg)
    assert torch.equal(yg.detach(), y)
    g = torch.randn_like(yg)
    yg.backward(g)
    w_deq = qat.quantized_weight().dequantize(torch.float32)
    torch.testing.assert_close(xg.grad, g @ w_deq)
    torch.testing.assert_close(base.weight.grad, g.t() @ x)
    torch.testing.assert_close(base.bias.grad, g.sum(0))


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("scheme", [None, "w4a16", "w8a8-fp8"])
def test_a_lora_layer_runs_the_invariant_gemms_and_trains_its_adapter(scheme):
    """A LoRA layer (a frozen base, plain or quantized, and its adapter): the engine's copy and
    the learner's give the same bits alone and in a batch, the ordinary forward's values up to
    rounding; gradients to x, A and B are those of ``x W^T + s (x A^T) B^T`` (float64)."""
    import copy

    from quarl.model.lora import add_lora
    from quarl.quant.kernels.invariant_model import exact_linear

    torch.manual_seed(1)
    learner = _tiny(scheme)
    add_lora(learner, 4, 8.0, ("q_proj",))
    for p in learner.parameters():
        p.requires_grad_(False)
    mod = learner.layers[0].self_attn.q_proj
    ad = mod.lora
    ad.A.requires_grad_(True)
    ad.B.requires_grad_(True)
    with torch.no_grad():
        ad.B.normal_(0, 0.5)
    served = copy.deepcopy(mod)
    x = torch.randn(6, 64)
    with torch.no_grad():
        y = exact_linear(served, x)
        assert torch.equal(y[3:4], exact_linear(served, x[3:4]))
        torch.testing.assert_close(y, mod(x), atol=1e-4, rtol=1e-4)
    xg = x.clone().requires_grad_(True)
    yg = exact_linear(mod, xg)
    assert torch.equal(yg.detach(), y)
    g = torch.randn_like(yg)
    yg.backward(g)
    w = (mod.weight if scheme is None else mod.qweight.dequantize(torch.float32)).double()
    a, b, x64, g64 = ad.A.detach().double(), ad.B.detach().double(), x.double(), g.double()
    s = ad.scaling
    torch.testing.assert_close(ad.B.grad.double(), s * g64.t() @ (x64 @ a.t()), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ad.A.grad.double(), s * (g64 @ b).t() @ x64, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(xg.grad.double(), g64 @ w + s * (g64 @ b) @ a, atol=1e-4, rtol=1e-4)


def test_the_engine_refuses_a_cpu_without_the_interpreter(monkeypatch):
    from quarl.quant.kernels.invariant_model import ExactMode
    from quarl.rollout import Engine, EngineConfig

    model = _tiny()
    model.exact = ExactMode(page=16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="need a CUDA device; on cpu only through Triton's interpreter"):
        Engine(model, config=EngineConfig(max_model_len=16, num_kv_blocks=8))
