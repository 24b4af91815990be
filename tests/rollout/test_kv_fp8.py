"""The engine with an fp8 KV cache (rollout.engine.kv_cache_dtype=fp8) on CPU: it generates
what the model's own forward gives when its attention sees fake-quantized K/V, on the torch
backend and on the Triton kernels (interpreted); the cache's memory accounting; config errors."""

from __future__ import annotations

import copy

import pytest
import torch

from quarl.config import ConfigError
from quarl.config.run import load_run_config
from quarl.learner.logprobs import sequence_logprobs
from quarl.model.presets import build_random_model
from quarl.rollout import Engine, EngineConfig, SamplingParams
from quarl.rollout.kv_cache import KVCache

PROMPTS = [[5, 17, 33], [9] * 12 + [40, 41], [60], list(range(3, 23))]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_random_model("tiny", seed=7, std=0.3)  # peaked logits: greedy is no coin flip


def _engine(model, **kw) -> Engine:
    cfg = dict(max_model_len=48, block_size=4, num_kv_blocks=96, max_num_seqs=8, kv_cache_dtype="fp8")
    return Engine(copy.deepcopy(model), config=EngineConfig(**{**cfg, **kw}))


def _reference_logprobs(model, prompt: list[int], completion: list[int], kv_quant: str | None) -> torch.Tensor:
    """Teacher-forced log-probs of ``completion`` by the model's batch forward (float64 out)."""
    ref = copy.deepcopy(model)
    ref.kv_quant = kv_quant
    with torch.no_grad():
        logp, _ = sequence_logprobs(ref, torch.tensor([prompt + completion]))
    return logp[0, len(prompt) - 1 :].double()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_fp8_engine_equals_fake_quantized_forward(model, backend):
    engine = _engine(model, attention_backend=backend)
    assert engine.runner.kv.quantized and engine.runner.kv.data.dtype == torch.float8_e4m3fn
    new = 10 if backend == "torch" else 6
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True))
    worst_plain, gaps = 0.0, []
    for prompt, c in zip(PROMPTS, outs):
        got = torch.tensor(c.logprobs, dtype=torch.float64)
        ref = _reference_logprobs(model, prompt, c.token_ids, "fp8")
        gaps.append((got - ref).abs())
        # greedy: each token is the argmax of the fake-quantized forward's distribution
        with torch.no_grad():
            fq = copy.deepcopy(model)
            fq.kv_quant = "fp8"
            logits = fq(torch.tensor([prompt + c.token_ids]))[0, len(prompt) - 1 : -1]
        assert logits.argmax(-1).tolist() == c.token_ids
        worst_plain = max(worst_plain, float((got - _reference_logprobs(model, prompt, c.token_ids, None)).abs().max()))
    # The same rounded K/V: equal log-probs, but for a rare K or V element within float32 noise of
    # the midpoint between two fp8 values, which the decode and the batch forward (their own
    # summation orders) can round apart: a gap of ~1e-4 at that token. The fp8 cache itself
    # moves the numbers by far more (worst_plain), so both comparisons can fail.
    gaps = torch.cat(gaps)
    assert (gaps < 2e-5).float().mean() >= 0.9 and gaps.max() < 5e-4, (backend, gaps)
    assert worst_plain > 1e-3


def test_fp8_cache_shared_prompt_copy_on_write_and_preemption(model):
    """n samples sharing a prompt's blocks (copy-on-write of the partial last block: codes
    and scales), and a cache so small that sequences are preempted and recomputed, sample
    the same tokens as unshared sequences in a roomy cache."""
    params = SamplingParams(n=3, temperature=0.9, max_new_tokens=8, seed=5, ignore_eos=True)
    shared = _engine(model).generate(PROMPTS[:2], params)
    unshared = _engine(model, share_prompt=False).generate(PROMPTS[:2], params)
    tight = _engine(model, max_model_len=24, num_kv_blocks=8, max_num_seqs=6)
    squeezed = tight.generate(PROMPTS[:2], params)
    assert tight.stats.preemptions > 0
    assert [c.token_ids for c in shared] == [c.token_ids for c in unshared] == [c.token_ids for c in squeezed]
    for a, b in zip(shared, unshared):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-5, rtol=0)


def test_copy_blocks_copies_codes_and_scales():
    cache = KVCache(2, 5, 4, 2, 8, torch.float32, torch.device("cpu"), "fp8")
    cache.data.view(torch.uint8).copy_(torch.randint(0, 120, cache.data.shape, dtype=torch.uint8))
    cache.scales.copy_(torch.rand(cache.scales.shape))
    data, scales = cache.data.view(torch.uint8).clone(), cache.scales.clone()
    cache.copy_blocks([(1, 3), (4, 0)])
    for new, old in ((cache.data.view(torch.uint8), data), (cache.scales, scales)):
        assert torch.equal(new[:, :, 3], old[:, :, 1]) and torch.equal(new[:, :, 0], old[:, :, 4])
        assert torch.equal(new[:, :, [1, 2, 4, 5]], old[:, :, [1, 2, 4, 5]])


def test_fp8_cache_bytes_count_the_scales():
    # per (layer, token, kv head), K and V: 2 * D bytes in bf16, D codes + a 4-byte scale in fp8
    bf16 = KVCache.bytes_per_block(28, 16, 2, 128, torch.bfloat16)
    fp8 = KVCache.bytes_per_block(28, 16, 2, 128, torch.bfloat16, "fp8")
    assert bf16 == 2 * 28 * 16 * 2 * 128 * 2 and fp8 == 2 * 28 * 16 * 2 * (128 + 4)
    cache = KVCache(2, 3, 4, 2, 8, torch.bfloat16, torch.device("cpu"), "fp8")
    held = cache.data.numel() * cache.data.element_size() + cache.scales.numel() * 4
    assert held == 4 * KVCache.bytes_per_block(2, 4, 2, 8, torch.bfloat16, "fp8")  # 3 blocks + scratch
    engine = Engine(build_random_model("tiny", seed=1), config=EngineConfig(max_model_len=32, num_kv_blocks=10,
                                                                            kv_cache_dtype="fp8"))
    assert engine.kv_cache_bytes == 10 * KVCache.bytes_per_block(2, 16, 2, 16, torch.float32, "fp8")


def test_kv_cache_dtype_errors_name_the_fix():
    with pytest.raises(ValueError, match="'auto'.*'fp8'.*'fp16'"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="write 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVCache(1, 1, 4, 1, 8, torch.float32, torch.device("cpu"), "int8")
    with pytest.raises(ConfigError, match="rollout.engine.kv_cache_dtype.*'auto', 'fp8'"):
        load_run_config(overrides=["--rollout.engine.kv_cache_dtype=fp9"])
    with pytest.raises(ConfigError, match="has moved: use rollout.engine.kv_cache_dtype"):
        load_run_config(overrides=["--rollout.kv_cache_dtype=fp8"])
    cfg = load_run_config(overrides=["--rollout.engine.kv_cache_dtype=fp8"])
    assert cfg.rollout.engine.kv_cache_dtype == "fp8"
    assert load_run_config().rollout.engine.kv_cache_dtype == "auto"
