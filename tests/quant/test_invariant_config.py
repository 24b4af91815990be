"""``quant.exact``: off by default; while neither forward runs the batch-invariant kernels,
every configuration that turns it on is refused when the config loads, with the reasons that
apply to it and what works instead."""

import pytest

from quarl.config.run import load_run_config
from quarl.config.typed import ConfigError

NOT_WIRED = "neither the engine's forward nor the learner's runs the batch-invariant kernels yet"
WORKS = "What works: quant.exact=false"


def test_exact_is_off_by_default_and_false_loads():
    assert load_run_config(None, []).quant.exact is False
    assert load_run_config(None, ["--quant.exact=false", "--quant.mode=aligned"]).quant.exact is False


@pytest.mark.parametrize("flags", [
    "--quant.mode=bf16",
    "--quant.mode=bf16 --model.dtype=bfloat16",
    "--quant.mode=aligned --quant.scheme=w4a16",
    "--quant.mode=aligned --quant.scheme=w8a8-fp8 --rollout.engine.kv_cache_dtype=fp8",
], ids=["bf16", "bf16-bfloat16", "aligned-w4a16", "aligned-fp8-kvfp8"])
def test_every_exact_configuration_is_refused_naming_why_and_what_works(flags):
    with pytest.raises(ConfigError) as e:
        load_run_config(None, ["--quant.exact=true", *flags.split()])
    msg = str(e.value)
    assert msg.startswith("quant.exact=true is refused: ") and NOT_WIRED in msg and WORKS in msg


@pytest.mark.parametrize("flags,reason", [
    ("--quant.mode=aligned --quant.scheme=w8a8-int8", "quant.mode=aligned (quant.scheme=w8a8-int8) would also"),
    ("--quant.mode=rollout --quant.scheme=nvfp4", "quant.mode=rollout (quant.scheme=nvfp4) would also"),
    ("--quant.mode=bf16 --model.lora_rank=8", "model.lora_rank > 0: LoRA adapters"),
    ("--quant.mode=bf16 --model.builtin=moe-tiny", "an MoE model: its router and experts"),
    ("--quant.mode=bf16 --model.dtype=float16", "model.dtype=float16: the invariant attention"),
], ids=["int8", "rollout-nvfp4", "lora", "moe", "fp16"])
def test_the_reasons_that_apply_are_named(flags, reason):
    with pytest.raises(ConfigError, match="quant.exact=true is refused") as e:
        load_run_config(None, ["--quant.exact=true", *flags.split()])
    assert reason in str(e.value)


def test_a_bf16_dense_run_gets_only_the_wiring_reason():
    with pytest.raises(ConfigError) as e:
        load_run_config(None, ["--quant.exact=true", "--quant.mode=bf16"])
    msg = str(e.value)
    for other in ("LoRA", "MoE", "float16", "low-bit", "would also"):
        assert other not in msg
