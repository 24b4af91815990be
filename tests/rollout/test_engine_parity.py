"""The engine (torch attention, float32) against HF transformers on tiny random models."""

from __future__ import annotations

import pytest
import torch

import quarl
from quarl.rollout import Engine, EngineConfig, SamplingParams

PROMPTS = [[5, 17, 33], [9] * 12 + [40, 41], [60], [7, 8, 9, 10, 11, 12, 13], list(range(3, 23)), [44, 45]]
NEW_TOKENS = 12


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _hf_logprobs(hf, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits[0].double(), -1)
    rows = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logp[rows, torch.tensor(completion)]


@pytest.fixture(scope="module")
def tiny_engines(hf_checkpoint):
    family, path, hf = hf_checkpoint
    model = quarl.load_model(path, dtype=torch.float32)
    roomy = Engine(model, config=EngineConfig(max_model_len=64, block_size=4, num_kv_blocks=256))
    # 10 blocks of 4 tokens: one sequence of 40 tokens fits, six do not -> preemption.
    tight = Engine(
        quarl.load_model(path, dtype=torch.float32),
        config=EngineConfig(max_model_len=40, block_size=4, num_kv_blocks=12, max_num_seqs=4),
    )
    return family, hf, roomy, tight


def test_greedy_matches_hf_with_logprobs(tiny_engines):
    family, hf, engine, _ = tiny_engines
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    outs = engine.generate(PROMPTS, params)
    assert [(c.prompt_index, c.sample_index) for c in outs] == [(i, 0) for i in range(len(PROMPTS))]
    for prompt, c in zip(PROMPTS, outs):
        assert c.token_ids == _hf_greedy(hf, prompt, NEW_TOKENS), family
        assert c.finish_reason == "length"
        ref = _hf_logprobs(hf, prompt, c.token_ids)
        assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), ref, atol=1e-5, rtol=0), family


def test_greedy_with_preemption_matches_hf(tiny_engines):
    family, hf, _, engine = tiny_engines
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    outs = engine.generate(PROMPTS, params)
    assert engine.stats.preemptions > 0
    for prompt, c in zip(PROMPTS, outs):
        assert c.token_ids == _hf_greedy(hf, prompt, NEW_TOKENS), family
        ref = _hf_logprobs(hf, prompt, c.token_ids)
        assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), ref, atol=1e-5, rtol=0), family
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_seeded_sampling_is_reproducible_and_shared_prompt_matches(tiny_engines):
    family, hf, engine, tight = tiny_engines
    shared = SamplingParams(n=3, temperature=0.9, max_new_tokens=10, seed=1234, ignore_eos=True)
    a = engine.generate(PROMPTS[:3], shared)
    b = engine.generate(PROMPTS[:3], shared)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert len({tuple(c.token_ids) for c in a if c.prompt_index == 1}) > 1  # samples differ
    unshared = Engine(engine.model,
                      config=EngineConfig(max_model_len=64, block_size=4, num_kv_blocks=64, share_prompt=False))
    c = unshared.generate(PROMPTS[:3], shared)
    assert [x.token_ids for x in c] == [x.token_ids for x in a], family
    d = tight.generate(PROMPTS[:3], shared)  # sharing + copy-on-write + preemption
    assert [x.token_ids for x in d] == [x.token_ids for x in a], family
    # Log-probs are those of softmax(logits / T), on both paths. The paths are not compared
    # bit for bit: their prefill GEMMs see 18 vs 54 rows, and a BLAS may round a row
    # differently by row count (MKL_CBWR=COMPATIBLE does, by ~1e-6 here). Each path is held
    # to the engine's accuracy against the float64 reference instead, as in the tests above.
    for completions in (a, c):
        for prompt, comp in zip([PROMPTS[x.prompt_index] for x in completions], completions):
            ids = torch.tensor([prompt + comp.token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(hf(ids).logits[0].double() / 0.9, -1)
            rows = torch.arange(len(prompt) - 1, len(ids[0]) - 1)
            ref = logp[rows, torch.tensor(comp.token_ids)]
            assert torch.allclose(torch.tensor(comp.logprobs, dtype=torch.float64), ref, atol=1e-5, rtol=0), family


def test_stop_tokens_and_check_logprobs(tiny_engines):
    family, hf, engine, _ = tiny_engines
    greedy = engine.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))[0]
    stop_at = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_at)
    out = engine.generate(
        [PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, stop_token_ids=[stop_at])
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[: first + 1]
    seq = PROMPTS[4] + greedy.token_ids
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([seq])).logits[0].double(), -1)
    ref = logp[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
    assert engine.check_logprobs(seq, ref, tol=1e-5) < 1e-5
    with pytest.raises(quarl.rollout.LogprobMismatchError):
        engine.check_logprobs(seq, ref + 0.1, tol=1e-3)


def test_triton_backend_matches_hf(hf_checkpoint):
    """The whole engine on the Triton kernels (interpreted on CPU), prompt sharing included."""
    family, path, hf = hf_checkpoint
    engine = Engine(
        quarl.load_model(path, dtype=torch.float32),
        config=EngineConfig(max_model_len=40, block_size=4, num_kv_blocks=12, max_num_seqs=4,
                            attention_backend="triton"),
    )
    prompts = PROMPTS[:4]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    for prompt, c in zip(prompts, outs):
        assert c.token_ids == _hf_greedy(hf, prompt, 8), family
        ref = _hf_logprobs(hf, prompt, c.token_ids)
        assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), ref, atol=1e-5, rtol=0), family
    seeded = SamplingParams(n=2, temperature=0.8, max_new_tokens=6, seed=7, ignore_eos=True)
    torch_engine = Engine(engine.model, config=EngineConfig(max_model_len=40, block_size=4, num_kv_blocks=64))
    assert [c.token_ids for c in engine.generate(prompts, seeded)] == [
        c.token_ids for c in torch_engine.generate(prompts, seeded)
    ]


def test_decode_lengths_reach_the_kernels_as_int32(hf_checkpoint):
    """The attention kernels read context and split lengths as int32: the decode step hands
    them over in that dtype (an int64 tensor made every layer's kernel convert both), with
    the values the host wrote, next to the int64 inputs of the same single copy."""
    family, path, hf = hf_checkpoint
    engine = Engine(quarl.load_model(path, dtype=torch.float32), config=EngineConfig(max_model_len=40, block_size=4))
    runner = engine.runner
    runner._h_ids[:3] = [11, 12, 13]
    runner._h_ctx[:3] = [5, 17, 2**31 - 1]
    runner._h_split[0] = 192
    runner._h_seed[:3] = [2**40 + 1, -3, 7]
    runner._dev_ints.copy_(runner._host_ints)
    ctx = runner._decode_context(3, 1)
    assert ctx.context_lens.dtype == ctx.split_len.dtype == torch.int32
    assert ctx.context_lens.tolist() == [5, 17, 2**31 - 1] and ctx.split_len.tolist() == [192]
    assert runner._d_ids[:3].tolist() == [11, 12, 13] and runner._d_seed[:3].tolist() == [2**40 + 1, -3, 7]


def test_an_engine_made_without_its_kv_cache_sizes_it_when_first_made(hf_checkpoint):
    """``kv_cache=False`` (a sharded learner frees memory after the engine is built): no cache
    and no scheduler until ``reallocate_kv_cache()``, which sizes the cache then; generating
    before it is a clear error, after it the engine gives HF's greedy tokens; a release and
    re-creation keeps the size."""
    family, path, hf = hf_checkpoint
    engine = Engine(quarl.load_model(path, dtype=torch.float32), kv_cache=False,
                    config=EngineConfig(max_model_len=64, block_size=4, num_kv_blocks=40))
    assert engine.runner.kv is None and engine.runner.num_blocks is None and engine.scheduler is None
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    with pytest.raises(RuntimeError, match="call engine.reallocate_kv_cache"):
        engine.generate(PROMPTS[:2], params)
    engine.release_kv_cache()  # (nothing to release: no error)
    engine.reallocate_kv_cache()
    assert engine.runner.num_blocks == 40 and engine.kv_cache_bytes > 0
    for _ in range(2):
        outs = engine.generate(PROMPTS[:2], params)
        assert [c.token_ids for c in outs] == [_hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS[:2]], family
        engine.release_kv_cache()
        engine.reallocate_kv_cache()
        assert engine.runner.num_blocks == 40
