"""``quant.exact``: off by default; on, accepted where both forwards run the batch-invariant
kernels for every op they share (bf16 mode, or aligned mode with w4a16 / w4a16-asym / w2a16, on
a dense model in bfloat16 or float32, either KV cache, an unsharded learner) and refused when
the config loads everywhere else, naming the reasons that apply and what works. Behind the
config, the exact forward refuses what it has no path for (a linear that quantizes its
activations, a LoRA layer, an MoE block, LoRA in the trainer's builder, a CPU without Triton's
interpreter) instead of silently running ordinary kernels, and runs a weight-only linear on its
packed codes."""

import dataclasses

import pytest
import torch

from quarl.config.run import QuantConfig, load_run_config
from quarl.config.typed import ConfigError
from quarl.model.presets import build_random_model, preset_config
from quarl.quant.mode import QuantMode

REFUSED = "quant.exact=true is refused: "
WORKS = ("What works: quant.exact=true with quant.mode=bf16, or quant.mode=aligned and quant.scheme "
         "w4a16 / w4a16-asym / w2a16, on a dense model")


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
], ids=["bf16", "bf16-bfloat16", "bf16-float32-kvfp8", "bf16-100m-checkpointing", "aligned-default-w4a16",
        "aligned-w4a16-kvfp8", "aligned-w4a16-asym", "aligned-w2a16-float32", "aligned-w4a16-exclude"])
def test_what_is_wired_loads(flags):
    assert load_run_config(None, ["--quant.exact=true", *flags.split()]).quant.exact is True


@pytest.mark.parametrize("flags,reason", [
    ("--quant.mode=rollout --quant.scheme=w4a16", "quant.mode=rollout (quant.scheme=w4a16): the learner's "
     "full-precision weights are not the engine's"),
    ("--quant.mode=rollout --quant.scheme=nvfp4", "quant.mode=rollout (quant.scheme=nvfp4): the learner's"),
    ("--quant.mode=aligned --quant.scheme=w8a8-fp8 --rollout.engine.kv_cache_dtype=fp8",
     "quant.mode=aligned with quant.scheme=w8a8-fp8: its activation quantizer is not wired"),
    ("--quant.mode=aligned --quant.scheme=w8a8-int8", "quant.mode=aligned with quant.scheme=w8a8-int8: its activation"),
    ("--quant.mode=aligned --quant.scheme=w4a8-int8", "quant.mode=aligned with quant.scheme=w4a8-int8: its activation"),
    ("--quant.mode=aligned --quant.scheme=nvfp4", "quant.mode=aligned with quant.scheme=nvfp4: the fp4 formats"),
    ("--quant.mode=aligned --quant.scheme=mxfp4", "quant.mode=aligned with quant.scheme=mxfp4: the fp4 formats"),
    ("--quant.mode=aligned --quant.include=[layers.*,lm_head]", "quant.include selects lm_head: exact mode's LM head"),
    ("--quant.mode=aligned --model.lora_rank=8", "model.lora_rank > 0: LoRA adapters"),
    ("--quant.mode=bf16 --model.lora_rank=8", "model.lora_rank > 0: LoRA adapters"),
    ("--quant.mode=bf16 --model.builtin=moe-tiny", "an MoE model: its router and experts"),
    ("--quant.mode=bf16 --model.dtype=float16", "model.dtype=float16: the invariant kernels"),
    ("--quant.mode=bf16 --trainer.shard_learner=true", "trainer.shard_learner=true: a sharded learner"),
], ids=["rollout-w4a16", "rollout-nvfp4", "aligned-fp8-kvfp8", "aligned-int8", "aligned-w4a8", "aligned-nvfp4",
        "aligned-mxfp4", "aligned-lm-head", "aligned-lora", "lora", "moe", "fp16", "sharded"])
def test_the_rest_is_refused_naming_why_and_what_works(flags, reason):
    with pytest.raises(ConfigError) as e:
        load_run_config(None, ["--quant.exact=true", *flags.split()])
    msg = str(e.value)
    assert msg.startswith(REFUSED) and reason in msg and WORKS in msg and msg.endswith("or quant.exact=false")


def test_every_reason_that_applies_is_named_once():
    with pytest.raises(ConfigError) as e:
        load_run_config(None, ["--quant.exact=true", "--quant.mode=aligned", "--quant.scheme=nvfp4",
                               "--model.dtype=float16", "--model.lora_rank=4"])
    reasons = str(e.value).removeprefix(REFUSED).split(". What works")[0].split("; ")
    assert [r.split(":")[0].split(" (")[0] for r in reasons] == [
        "quant.mode=aligned with quant.scheme=nvfp4", "model.lora_rank > 0", "model.dtype=float16"]


def _tiny(scheme=None):
    model = build_random_model(dataclasses.replace(preset_config("tiny"), vocab_size=64), dtype=torch.float32)
    if scheme is not None:
        from quarl.quant import QuantLinear, quantize_model

        quantize_model(model, scheme, QuantLinear)
    return model


def test_the_exact_forward_refuses_layers_it_has_no_path_for():
    from quarl.model.lora import add_lora
    from quarl.quant.kernels.invariant_model import EXACT_OPS, exact_linear

    for scheme in ("w8a8-int8", "w4a8-int8"):
        model = _tiny(scheme)
        with pytest.raises(NotImplementedError, match=f"weight-only packed schemes only, not {scheme} on QuantLinear"):
            exact_linear(model.layers[0].self_attn.q_proj, torch.randn(2, 64))
    lora = _tiny("w4a16")
    add_lora(lora, 4, 8.0, ("q_proj",))
    with pytest.raises(NotImplementedError, match="no path for a LoRA layer"):
        exact_linear(lora.layers[0].self_attn.q_proj, torch.randn(2, 64))
    moe = build_random_model("moe-tiny", dtype=torch.float32)
    sparse = next(layer.mlp for layer in moe.layers if type(layer.mlp).__name__ == "SparseMoeBlock")
    with pytest.raises(NotImplementedError, match="dense MLPs only, not SparseMoeBlock"):
        EXACT_OPS.mlp(sparse, torch.randn(1, 2, 64))


@pytest.mark.usefixtures("needs_triton")
@pytest.mark.parametrize("scheme", ["w4a16", "w4a16-asym", "w2a16"])
def test_a_weight_only_linear_runs_the_invariant_gemm_on_its_codes(scheme):
    """The engine's QuantLinear and the learner's QATLinear over one weight: the invariant packed
    GEMM of the same codes, the same bits (alone and in a batch); the QAT gradient is straight-
    through (``g @ W_deq`` to x, ``g^T x`` to the master weight)."""
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
    xg = x.clone().requires_grad_(True)
    yg = exact_linear(qat, xg)
    assert torch.equal(yg.detach(), y)
    g = torch.randn_like(yg)
    yg.backward(g)
    w_deq = qat.quantized_weight().dequantize(torch.float32)
    torch.testing.assert_close(xg.grad, g @ w_deq)
    torch.testing.assert_close(base.weight.grad, g.t() @ x)
    torch.testing.assert_close(base.bias.grad, g.sum(0))


def test_the_builder_refuses_lora_and_the_engine_a_cpu_without_the_interpreter(monkeypatch):
    from quarl.quant.kernels.invariant_model import ExactMode
    from quarl.rollout import Engine, EngineConfig
    from quarl.trainer.weights import LoRASettings, build_engine_and_publisher

    quant = QuantConfig(mode=QuantMode.BF16, exact=True)
    quant.validate()
    with pytest.raises(ValueError, match="exact mode has no LoRA path"):
        build_engine_and_publisher(_tiny(), quant, EngineConfig(max_model_len=16, num_kv_blocks=8),
                                   LoRASettings(4, 8.0, ("q_proj",)))
    model = _tiny()
    model.exact = ExactMode(page=16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="need a CUDA device; on cpu only through Triton's interpreter"):
        Engine(model, config=EngineConfig(max_model_len=16, num_kv_blocks=8))
