"""Aligned mode with an fp8 KV cache: the learner's attention sees the K/V the engine's
cache holds, so its log-probs of engine samples equal the engine's (float tolerance);
without the learner's fake quantization they measurably differ. bf16 / rollout modes
leave the learner alone."""

from __future__ import annotations

import copy

import pytest
import torch

from quarl.config.run import QuantConfig
from quarl.learner import Learner
from quarl.learner.batch import build_batch
from quarl.learner.logprobs import sequence_logprobs
from quarl.model.presets import build_random_model
from quarl.quant import QuantMode, get_scheme
from quarl.rollout import EngineConfig, SamplingParams
from quarl.trainer.weights import build_engine_and_publisher, learner_kv_quant

PROMPTS = [[5, 17, 33], [9] * 12 + [40, 41], list(range(3, 23))]


def _aligned(kv_cache_dtype: str, mode: QuantMode = QuantMode.ALIGNED):
    torch.manual_seed(0)
    base = build_random_model("tiny", seed=11, std=0.3)
    quant = QuantConfig(mode=mode, scheme=get_scheme("bf16" if mode is QuantMode.BF16 else "w4a16"))
    config = EngineConfig(max_model_len=48, block_size=4, num_kv_blocks=96, kv_cache_dtype=kv_cache_dtype)
    engine, publisher = build_engine_and_publisher(base, quant, config)
    publisher.publish()
    return engine, publisher.learner_model


def _samples_and_learner_logp(engine, learner_model):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=3, ignore_eos=True)
    outs = engine.generate(PROMPTS, params)
    prompts = [PROMPTS[c.prompt_index] for c in outs]
    batch = build_batch(prompts, [c.token_ids for c in outs], [c.logprobs for c in outs], [0.0] * len(outs),
                        torch.zeros(len(outs)))
    learner = Learner(learner_model)
    old_logp = learner.logprobs(batch, token_budget=64)  # micro-batches, right padding
    return batch, old_logp


def _max_gap(batch, logp) -> float:
    mask = batch.response_mask.bool()
    return float((logp[mask] - batch.sampler_logp[mask]).abs().max())


def test_aligned_learner_matches_fp8_engine_and_not_without_fake_quant():
    engine, learner_model = _aligned("fp8")
    assert engine.runner.kv.quantized and learner_model.kv_quant == "fp8"
    batch, logp = _samples_and_learner_logp(engine, learner_model)
    assert _max_gap(batch, logp) < 5e-5
    learner_model.kv_quant = None  # the learner as bf16/rollout modes leave it: the cache's rounding shows
    assert _max_gap(batch, Learner(learner_model).logprobs(batch, token_budget=64)) > 1e-3


@pytest.mark.parametrize("mode", [QuantMode.BF16, QuantMode.ROLLOUT])
def test_unaligned_modes_leave_the_learner_attention_alone(mode):
    engine, learner_model = _aligned("fp8", mode)
    assert engine.runner.kv.quantized and learner_model.kv_quant is None
    assert learner_kv_quant(QuantMode.ALIGNED, "auto") is None
    assert learner_kv_quant(QuantMode.ALIGNED, "fp8") == "fp8"


def test_fake_quantized_attention_passes_gradients_straight_through():
    """The update's backward goes through the K/V rounding as the identity: k/v projections get
    the gradient of the rounded forward (e4m3 casts alone have none)."""
    torch.manual_seed(1)
    model = build_random_model("tiny", seed=2, std=0.3)
    ids = torch.randint(0, 128, (2, 9))
    grads = {}
    for kv_quant in (None, "fp8"):
        m = copy.deepcopy(model)
        m.kv_quant = kv_quant
        logp, _ = sequence_logprobs(m, ids)
        logp.sum().backward()
        grads[kv_quant] = m.layers[0].self_attn.k_proj.weight.grad
    assert grads["fp8"] is not None and grads["fp8"].abs().sum() > 0
    # close to the unrounded model's gradient (the forward differs by the rounding only), not equal
    rel = float((grads["fp8"] - grads[None]).norm() / grads[None].norm())
    assert 0 < rel < 0.2
