"""``quant.exact``: off by default; on, accepted where both forwards run the batch-invariant
kernels for every op they share (bf16 mode on a dense model in bfloat16 or float32, either KV
cache, an unsharded learner) and refused when the config loads everywhere else, naming the
reasons that apply and what works. Behind the config, the exact forward refuses what it has no
path for (a quantized linear, an MoE block, LoRA in the trainer's builder, a CPU without
Triton's interpreter) instead of silently running ordinary kernels."""

import dataclasses

import pytest
import torch

from quarl.config.run import QuantConfig, load_run_config
from quarl.config.typed import ConfigError
from quarl.model.presets import build_random_model, preset_config
from quarl.quant.mode import QuantMode

REFUSED = "quant.exact=true is refused: "
WORKS = "What works: quant.exact=true with quant.mode=bf16 on a dense model"


def test_exact_is_off_by_default_and_false_loads():
    assert load_run_config(None, []).quant.exact is False
    assert load_run_config(None, ["--quant.exact=false", "--quant.mode=aligned"]).quant.exact is False


@pytest.mark.parametrize("flags", [
    "--quant.mode=bf16",
    "--quant.mode=bf16 --model.dtype=bfloat16",
    "--quant.mode=bf16 --model.dtype=float32 --rollout.engine.kv_cache_dtype=fp8",
    "--quant.mode=bf16 --model.builtin=100m --trainer.activation_checkpointing=true --trainer.mini_batches=2",
], ids=["bf16", "bf16-bfloat16", "bf16-float32-kvfp8", "bf16-100m-checkpointing"])
def test_what_is_wired_loads(flags):
    assert load_run_config(None, ["--quant.exact=true", *flags.split()]).quant.exact is True


@pytest.mark.parametrize("flags,reason", [
    ("--quant.mode=aligned --quant.scheme=w4a16", "quant.mode=aligned (quant.scheme=w4a16): the low-bit linears"),
    ("--quant.mode=aligned --quant.scheme=w8a8-fp8 --rollout.engine.kv_cache_dtype=fp8",
     "quant.mode=aligned (quant.scheme=w8a8-fp8): the low-bit linears"),
    ("--quant.mode=rollout --quant.scheme=nvfp4", "quant.mode=rollout (quant.scheme=nvfp4): the low-bit linears"),
    ("--quant.mode=bf16 --model.lora_rank=8", "model.lora_rank > 0: LoRA adapters"),
    ("--quant.mode=bf16 --model.builtin=moe-tiny", "an MoE model: its router and experts"),
    ("--quant.mode=bf16 --model.dtype=float16", "model.dtype=float16: the invariant kernels"),
    ("--quant.mode=bf16 --trainer.shard_learner=true", "trainer.shard_learner=true: a sharded learner"),
], ids=["aligned-w4a16", "aligned-fp8-kvfp8", "rollout-nvfp4", "lora", "moe", "fp16", "sharded"])
def test_the_rest_is_refused_naming_why_and_what_works(flags, reason):
    with pytest.raises(ConfigError) as e:
        load_run_config(None, ["--quant.exact=true", *flags.split()])
    msg = str(e.value)
    assert msg.startswith(REFUSED) and reason in msg and WORKS in msg and msg.endswith("or quant.exact=false")


def test_every_reason_that_applies_is_named_once():
    with pytest.raises(ConfigError) as e:
        load_run_config(None, ["--quant.exact=true", "--quant.mode=aligned", "--model.dtype=float16",
                               "--model.lora_rank=4"])
    reasons = str(e.value).removeprefix(REFUSED).split(". What works")[0].split("; ")
    assert [r.split(":")[0].split(" (")[0] for r in reasons] == [
        "quant.mode=aligned", "model.lora_rank > 0", "model.dtype=float16"]


def _tiny(scheme=None):
    model = build_random_model(dataclasses.replace(preset_config("tiny"), vocab_size=64), dtype=torch.float32)
    if scheme is not None:
        from quarl.quant import QuantLinear, quantize_model

        quantize_model(model, scheme, QuantLinear)
    return model


def test_the_exact_forward_refuses_layers_it_has_no_path_for():
    from quarl.quant.kernels.invariant_model import EXACT_OPS, exact_linear

    model = _tiny("w4a16")
    with pytest.raises(NotImplementedError, match="plain nn.Linear layers only, not QuantLinear"):
        exact_linear(model.layers[0].self_attn.q_proj, torch.randn(2, 64))
    moe = build_random_model("moe-tiny", dtype=torch.float32)
    sparse = next(layer.mlp for layer in moe.layers if type(layer.mlp).__name__ == "SparseMoeBlock")
    with pytest.raises(NotImplementedError, match="dense MLPs only, not SparseMoeBlock"):
        EXACT_OPS.mlp(sparse, torch.randn(1, 2, 64))


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
