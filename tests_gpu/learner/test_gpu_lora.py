"""LoRA on a frozen low-bit base on the GPU: the engine (CUDA graphs, fast kernels, unfused
adapted projections) samples what the learner's frozen-base forward scores."""

from __future__ import annotations

import pytest
import torch

from quarl.config import load_run_config
from quarl.learner.logprobs import sequence_logprobs
from quarl.model.lora import lora_modules
from quarl.rollout import EngineConfig, SamplingParams
from quarl.trainer.weights import LoRASettings, build_engine_and_publisher
from quarl.bench.rollout import random_model, shape_config


def _small_model(seed: int):
    cfg = shape_config("qwen2.5-1.5b", 512)
    cfg = type(cfg)(**{**cfg.as_dict(), "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000})
    model = random_model(cfg, torch.device("cuda"), seed=seed)
    with torch.no_grad():  # larger weights: peaked distributions
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(5)
    return model


@pytest.mark.parametrize("scheme,dense,kv", [("w4a16", False, "auto"), ("w4a16", True, "auto"), ("w4a16", True, "fp8"),
                                             ("w8a8-fp8", False, "auto"), ("bf16", False, "auto")])
def test_lora_engine_logprobs_match_the_learner(scheme, dense, kv):
    """``dense``: the learner keeps its w4a16 base dequantized through the update, so its layers
    run as the compiled regions (a bf16 base always does); ``kv``: the engine's KV cache format
    (fp8: the learner's regions round K/V as the cache does)."""
    from quarl.learner.compiled_ops import COMPILED_OPS
    from quarl.learner.memory import keep_frozen_bases_dense

    mode = "bf16" if scheme == "bf16" else "aligned"
    cfg = load_run_config(None, [f"--quant.mode={mode}", f"--quant.scheme={scheme}"])
    model = _small_model(seed=4)
    engine, pub = build_engine_and_publisher(model, cfg.quant, EngineConfig(max_model_len=256, max_num_seqs=64,
                                                                            kv_cache_dtype=kv),
                                             LoRASettings(16, 32.0, ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "gate_proj", "up_proj", "down_proj")))
    keep_frozen_bases_dense(model, dense)
    fallbacks = COMPILED_OPS.fallbacks
    # one copy of the base: the learner reads the engine's fused buffers (made before the KV cache was sized)
    a_l, a_e = model.layers[0].self_attn, engine.model.layers[0].self_attn
    # the group's adapters run as one shrink and one expand GEMM over buffers the adapters view
    assert a_e.q_proj.lora.A.data_ptr() == a_e._fused_qkv.adapters.A.data_ptr()
    for name in ("q_proj", "k_proj", "v_proj"):
        lm, em = getattr(a_l, name), getattr(a_e, name)
        ptr = (lambda m: m.qdata.data_ptr()) if hasattr(lm, "qdata") else (lambda m: m.weight.data_ptr())
        assert ptr(lm) == ptr(em)
    g = torch.Generator(device="cuda").manual_seed(1)
    prompts = [[int(t) for t in torch.randint(5, 900, (12,), generator=g, device="cuda")] for _ in range(8)]

    def gaps():
        comps = engine.generate(prompts, [SamplingParams(n=4, max_new_tokens=64, seed=i) for i in range(8)])
        out = []
        for c in comps:
            p = prompts[c.prompt_index]
            ids = torch.tensor([p + list(c.token_ids)], device="cuda")
            with torch.no_grad():
                logp = sequence_logprobs(model, ids, torch.ones_like(ids), ops=COMPILED_OPS)[0][0, len(p) - 1:]
            out.append((logp.float().cpu() - torch.tensor(c.logprobs)).abs())
        return torch.cat(out), comps

    base_gap, _ = gaps()  # B = 0: the base alone, the engine's usual bf16 summation-order noise
    with torch.no_grad():
        for _, _, ad in lora_modules(model):
            ad.A.copy_(0.02 * torch.randn(ad.A.shape, generator=g, device="cuda"))
            ad.B.copy_(0.02 * torch.randn(ad.B.shape, generator=g, device="cuda"))
    pub.publish()
    gap, comps = gaps()
    # the adapters add no mismatch of their own beyond the base's
    assert gap.mean() < 1.5 * base_gap.mean() + 2e-3, (float(gap.mean()), float(base_gap.mean()))
    # the learner's gradient reaches every adapter through the frozen base
    ids = torch.tensor([prompts[0] + list(comps[0].token_ids)], device="cuda")
    sequence_logprobs(model, ids, torch.ones_like(ids), ops=COMPILED_OPS)[0].sum().backward()
    assert all(ad.A.grad is not None and ad.A.grad.abs().sum() > 0 for _, _, ad in lora_modules(model))
    regions = scheme == "bf16" or dense
    assert (COMPILED_OPS.fallbacks == fallbacks) == regions, (COMPILED_OPS.fallbacks - fallbacks, regions)
    keep_frozen_bases_dense(model, False)
