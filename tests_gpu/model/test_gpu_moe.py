"""GPU checks of Qwen3-MoE in the engine (run on the GPU machine; not part of CI): CUDA-graph
decode with the router and grouped experts captured, in bf16 and each low-bit scheme, against
teacher-forced scoring of the engine's own samples by its model's plain forward."""

from __future__ import annotations

import pytest
import torch

from quarl.bench.rollout import random_model
from quarl.learner.logprobs import sequence_logprobs
from quarl.model.config import TransformerConfig
from quarl.rollout import Engine, EngineConfig, SamplingParams

DEV = torch.device("cuda")


def _moe_config() -> TransformerConfig:
    # 4 layers, layer 1 dense; 16 experts of width 128 (one int4 group), 4 per token
    return TransformerConfig(model_type="qwen3_moe", vocab_size=1000, hidden_size=256, intermediate_size=512,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                             qk_norm=True, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                             norm_topk_prob=True, mlp_only_layers=(1,), max_position_embeddings=512)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 40, 17, 90, 3, 64)]


@pytest.mark.parametrize("scheme", [None, "w4a16", "w8a8-fp8", "w8a8-int8"])
def test_moe_engine_graphs_score_their_own_samples(scheme):
    """The engine's CUDA-graph decode (router, top-k, sort and grouped GEMMs captured: no host
    sync) gives each sampled token the log-prob its own model's plain forward gives it."""
    model = random_model(_moe_config(), DEV, seed=1)
    engine = Engine(model, scheme=scheme, config=EngineConfig(max_model_len=256, max_num_seqs=16, num_kv_blocks=200))
    assert engine.runner.graphs
    prompts = _prompts()
    outs = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=3, ignore_eos=True))
    assert all(len(c.token_ids) == 40 for c in outs)
    worst = 0.0
    for i, c in enumerate(outs):
        p = prompts[i // 2]
        ids = torch.tensor([p + c.token_ids], device=DEV)
        with torch.no_grad():
            ref, _ = sequence_logprobs(engine.model, ids)
        ref = ref[0, len(p) - 1 :].float().cpu()
        worst = max(worst, float((torch.tensor(c.logprobs) - ref).abs().max()))
    assert worst < 0.1, worst


def test_moe_graph_decode_equals_eager_in_float32():
    model = random_model(_moe_config(), DEV, seed=2).float()
    kw = dict(max_model_len=256, max_num_seqs=16, num_kv_blocks=200)
    graph = Engine(model, config=EngineConfig(cuda_graphs=True, **kw))
    eager = Engine(model, config=EngineConfig(cuda_graphs=False, **kw))
    eager.runner.decode_tiling = graph.runner.decode_tiling
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=40, seed=11, ignore_eos=True)
    a, b = graph.generate(_prompts(), params), eager.generate(_prompts(), params)
    assert [x.token_ids for x in a] == [y.token_ids for y in b]


@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_fused_routing_is_the_torch_routing(tokens):
    """The engine's one-launch routing (route(fused=True)) against route's torch ops on bf16
    logits of Qwen3-30B-A3B's router (128 experts, 8 per token; equal logits are common): the
    same experts in the same order, weights within one bf16 rounding step."""
    from quarl.model.moe import route

    g = torch.Generator(device=DEV).manual_seed(tokens)
    logits = (torch.randn(tokens, 128, device=DEV, generator=g) * 2).to(torch.bfloat16)
    w, ids, own = route(logits, 8, True, torch.bfloat16, fused=True)
    want_w, want_ids, _ = route(logits, 8, True, torch.bfloat16)
    assert torch.equal(ids, want_ids) and torch.equal(own, ids)
    torch.testing.assert_close(w, want_w, rtol=2 ** -8, atol=0)
