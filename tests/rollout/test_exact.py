"""Exact mode end to end on a tiny random Qwen3-shaped model (hidden 64, 2 layers, q/k norms,
GQA, vocabulary 256) on the CPU, the batch-invariant kernels under Triton's interpreter.

A completion's per-token log-probs are bit-identical (i) decoded alone and decoded among 7
other sequences of other lengths, per-request temperatures and a cache too small for all of
them (preempted sequences are recomputed by a prefill); (ii) recomputed by the learner
(``Learner.logprobs``) with every row in one micro-batch and with a row or two per
micro-batch; by ``sequence_logprobs`` under autograd (the update's forward, which then
back-propagates) at another temperature; and with sequences packed into one row
(``seq_ids``); (iii) the engine's ``check_logprobs`` of a sequence against the learner's is
exactly 0. Cases: bfloat16 with the fp8 KV cache (which the learner mirrors); aligned mode (the
engine's quantized linears and the learner's QAT linears on the same codes, the update's backward
straight-through to the master weights) in w8a8-fp8 with the fp8 cache and w8a8-int8 in float32;
LoRA on a frozen w4a16 base shared by both sides (the adapters trained, the engine's a published
copy); and the MoE preset, whose attention and dense layer are plain linears, in bf16 (bf16 KV
cache) and in aligned w4a16 with the fp8 cache (router, grouped experts and the top-k combine
invariant; QAT / packed w4a16 attention). (w4a16-asym, w2a16, the grouped 8-bit experts:
tests/quant/test_invariant_*.py, test_moe_kernels.py.) In bfloat16 the ordinary learner forward
gives other bits (for MoE, W8A8: up to a routing or code flip): the exact path is the one taken.
One test per case (the interpreter is slow: each case generates once)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from quarl.config.run import QuantConfig
from quarl.learner.batch import build_batch
from quarl.learner.learner import Learner
from quarl.learner.logprobs import sequence_logprobs
from quarl.model.lora import DEFAULT_TARGETS, has_lora, lora_modules
from quarl.model.moe import Experts
from quarl.model.presets import build_random_model, preset_config
from quarl.model.transformer import MLP, TORCH_OPS, CheckpointedOps
from quarl.quant import QATLinear, QuantLinear
from quarl.quant.experts import QATExperts, QuantExperts
from quarl.quant.mode import QuantMode
from quarl.quant.scheme import get_scheme
from quarl.rollout import EngineConfig, SamplingParams
from quarl.trainer.weights import LoRASettings, build_engine_and_publisher

CFG = dataclasses.replace(preset_config("tiny"), vocab_size=256)
PROMPTS = [[5, 17, 33, 2], [9, 10, 11, 12, 13, 40, 41], [60], [7, 8, 9, 10, 11]]
TEMPS = [1.0, 0.7, 1.0, 1.3]
NEW = 6
CASES = [(torch.bfloat16, "fp8", "bf16"), (torch.bfloat16, "fp8", "w8a8-fp8"), (torch.float32, "auto", "w8a8-int8"),
         (torch.bfloat16, "auto", "lora-w4a16"), (torch.bfloat16, "auto", "moe-bf16"),
         (torch.bfloat16, "fp8", "moe-w4a16")]
IDS = ["bf16-kvfp8", "aligned-w8a8-fp8-kvfp8", "aligned-w8a8-int8-fp32", "lora-w4a16", "moe-bf16",
       "moe-aligned-w4a16-kvfp8"]
MOE_CFG = preset_config("moe-tiny")  # 8 experts, top-2, layer 1 dense


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


def _exact_pair(dtype: torch.dtype, kv: str, scheme: str):
    """The learner's model and its exact-mode engine, as the trainer builds them (``scheme``
    other than bf16: aligned mode in that scheme; ``lora-<scheme>``: rank-4 adapters on that
    frozen base, B made non-zero and published; ``moe-<scheme>``: the MoE preset, its
    engine recording the experts it routes to)."""
    moe = scheme.startswith("moe-")
    model = build_random_model(MOE_CFG if moe else CFG, dtype=dtype, std=0.1)
    lora = LoRASettings(4, 8.0, DEFAULT_TARGETS) if scheme.startswith("lora-") else None
    scheme = scheme.removeprefix("lora-").removeprefix("moe-")
    mode = QuantMode.BF16 if scheme == "bf16" else QuantMode.ALIGNED
    quant = QuantConfig(mode=mode, scheme=get_scheme(scheme), exact=True)
    quant.validate()
    # 8 sequences of 7-13 tokens need 24 blocks of 4 (less the prompts their pairs share): 10 make the
    # scheduler preempt
    config = EngineConfig(max_model_len=16, block_size=4, num_kv_blocks=10, kv_cache_dtype=kv)
    engine, publisher = build_engine_and_publisher(model, quant, config, lora, record_routes=moe)
    if lora is not None:
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for _, _, ad in lora_modules(model):
                ad.B.normal_(0, 0.2, generator=gen)
        publisher.publish()
    return model, engine


def _params(temp: float, n: int = 2) -> SamplingParams:
    return SamplingParams(n=n, temperature=temp, max_new_tokens=NEW, ignore_eos=True, seed=11)


def _batch(comps):
    return build_batch([PROMPTS[c.prompt_index] for c in comps], [c.token_ids for c in comps],
                       [c.logprobs for c in comps], [0.0] * len(comps), torch.zeros(len(comps)))


def _assert_same_bits(learner_logp: torch.Tensor, batch, what: str) -> None:
    mask = batch.response_mask.bool()
    assert int(mask.sum()) == NEW * batch.size
    assert torch.equal(_bits(learner_logp[mask]), _bits(batch.sampler_logp[mask])), what


def _check_alone_and_together(engine) -> list:
    """Prompt 0's first sample decoded alone, then among 7 others; returns the others."""
    alone = engine.generate([PROMPTS[0]], _params(TEMPS[0], n=1))[0]
    together = engine.generate(PROMPTS, [_params(t) for t in TEMPS])
    assert engine.stats.preemptions > 0  # some sequences were recomputed by a prefill after preemption
    same = [c for c in together if c.prompt_index == 0 and c.sample_index == 0][0]
    assert same.token_ids == alone.token_ids
    assert torch.equal(_bits(torch.tensor(same.logprobs)), _bits(torch.tensor(alone.logprobs))), "alone vs batch"
    assert all(len(c.logprobs) == NEW for c in together)
    return together


def _check_learner_budgets(model, together) -> None:
    batch = _batch([c for c in together if TEMPS[c.prompt_index] == 1.0])
    learner = Learner(model)
    for budget in (1 << 20, 24):  # every row in one micro-batch; a row or two per micro-batch
        _assert_same_bits(learner.logprobs(batch, budget, temperature=1.0), batch, f"token budget {budget}")


def _check_update_forward(model, together) -> None:
    """The update's forward (autograd on) at the engine's other temperature, then its backward."""
    batch = _batch([c for c in together if TEMPS[c.prompt_index] == 0.7])
    model.zero_grad()
    logp, ent = sequence_logprobs(model, batch.input_ids, batch.attention_mask, temperature=0.7, with_entropy=True,
                                  right_padded=True)
    assert logp.requires_grad and bool(torch.isfinite(ent).all())
    _assert_same_bits(logp.detach(), batch, "update forward")
    (logp * batch.response_mask).sum().backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in trained)
    q = model.layers[0].self_attn.q_proj
    assert (q.lora.A if has_lora(model) else q.weight).grad.abs().sum() > 0


def _check_packed_row(model, together) -> None:
    """Three sequences packed into one row (``seq_ids``), under activation checkpointing's ops."""
    ids, seq, want = [], [], []
    for i, c in enumerate([c for c in together if TEMPS[c.prompt_index] == 1.0][:3]):
        full = PROMPTS[c.prompt_index] + c.token_ids
        want += [float("nan")] * len(PROMPTS[c.prompt_index]) + c.logprobs  # (predicted by the token before)
        ids += full
        seq += [i] * len(full)
    with torch.no_grad():
        logp = sequence_logprobs(model, torch.tensor([ids]), seq_ids=torch.tensor([seq]),
                                 ops=CheckpointedOps(TORCH_OPS))[0][0]
    want = torch.tensor(want[1:])
    real = ~torch.isnan(want)
    assert torch.equal(_bits(logp[real]), _bits(want[real])), "packed row"


def _check_engine_sync(model, engine, c) -> None:
    ids = PROMPTS[c.prompt_index] + c.token_ids
    batch = build_batch([ids[:1]], [ids[1:]], [[0.0] * (len(ids) - 1)], [0.0], torch.zeros(1))
    assert engine.check_logprobs(ids, Learner(model).logprobs(batch, 1 << 20)[0]) == 0.0


def _check_not_ordinary(model, together, tol: float) -> None:
    """The ordinary learner forward (exact off) rounds otherwise: the exact path is the one taken;
    its values within ``tol`` (a rounding apart, W8A8: a code step of an activation)."""
    batch = _batch([c for c in together if TEMPS[c.prompt_index] == 1.0])
    exact, model.exact = model.exact, None
    try:
        with torch.no_grad():
            ordinary = sequence_logprobs(model, batch.input_ids, batch.attention_mask, right_padded=True)[0]
    finally:
        model.exact = exact
    mask = batch.response_mask.bool()
    assert not torch.equal(_bits(ordinary[mask]), _bits(batch.sampler_logp[mask]))
    assert (ordinary[mask] - batch.sampler_logp[mask]).abs().max() < tol


def _check_layers(model, engine, scheme: str) -> None:
    """Aligned mode: the learner's linears are QAT linears and the engine's packed ones, on the same
    codes; LoRA: one shared frozen base, the engine's adapters equal to the learner's."""
    dense = next(i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MLP))
    learner, served = model.layers[dense].mlp.down_proj, engine.model.layers[dense].mlp.down_proj
    if scheme.startswith("moe-"):
        scheme = scheme.removeprefix("moe-")
        experts, served_experts = model.layers[0].mlp.experts, engine.model.layers[0].mlp.experts
        if scheme == "bf16":
            assert type(experts) is Experts and type(served_experts) is Experts
        else:
            assert type(experts) is QATExperts and type(served_experts) is QuantExperts
            assert torch.equal(experts.quantized_weight("down_proj").qdata,
                               served_experts.quantized_weights()["down_proj"].qdata)
    if scheme.startswith("lora-"):
        assert type(learner) is QuantLinear and learner.qweight.qdata.data_ptr() == served.qweight.qdata.data_ptr()
        assert torch.equal(learner.lora.B, served.lora.B) and learner.lora.B.abs().sum() > 0
        return
    if scheme == "bf16":
        assert type(learner) is torch.nn.Linear and type(served) is torch.nn.Linear
        return
    assert type(learner) is QATLinear and type(served) is QuantLinear and served.scheme.name == scheme
    assert torch.equal(learner.quantized_weight().qdata, served.qweight.qdata)


@pytest.mark.parametrize("dtype,kv,scheme", CASES, ids=IDS)
def test_a_token_has_the_same_log_prob_bits_wherever_it_is_computed(dtype, kv, scheme):
    model, engine = _exact_pair(dtype, kv, scheme)
    _check_layers(model, engine, scheme)
    together = _check_alone_and_together(engine)
    _check_learner_budgets(model, together)
    _check_update_forward(model, together)
    _check_packed_row(model, together)
    _check_engine_sync(model, engine, together[-1])
    if dtype == torch.bfloat16:  # (float32: the ordinary forward may well round the same way)
        _check_not_ordinary(model, together, 0.5 if "w8a8" in scheme or "moe" in scheme else 0.1)
