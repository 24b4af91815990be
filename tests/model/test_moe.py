"""Qwen3-MoE in quarl's transformer against transformers' Qwen3MoeForCausalLM (float32, tiny random configs)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import quarl
from quarl.model import CheckpointError, ModelConfigError, Transformer, TransformerConfig, batch_attention, save_model
from quarl.model.moe import (
    Experts,
    SparseMoeBlock,
    grouped_linear,
    moe_routing,
    padded_grouped_linear,
    sort_by_expert,
)
from quarl.model.presets import build_random_model, preset_config
from quarl.model.transformer import TORCH_OPS, CheckpointedOps, MLP
from tests.hf_models import make_moe_checkpoint, moe_hf_config

# (name, Qwen3MoeConfig fields): a dense layer among sparse ones with renormalised top-2; top-1
# of 4 with every other layer dense; top-3 of 6 unnormalised with two dense layers
CONFIGS = {
    "top2-of-8": {},
    "top1-of-4": dict(num_experts=4, num_experts_per_tok=1, norm_topk_prob=False, decoder_sparse_step=2,
                      mlp_only_layers=[]),
    "top3-of-6": dict(num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[0, 3],
                      moe_intermediate_size=24),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=[(c, layout) for c in CONFIGS for layout in ("per_expert", "stacked")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def moe_checkpoint(request, tmp_path_factory):
    """(checkpoint dir, HF model) for each config, saved in each expert layout."""
    name, layout = request.param
    path = tmp_path_factory.mktemp(f"{name}-{layout}")
    hf = make_moe_checkpoint(path, moe_hf_config(**CONFIGS[name]), seed=3, per_expert=layout == "per_expert")
    return path, hf


def test_checkpoint_layouts_are_what_the_test_means(moe_checkpoint):
    path, hf = moe_checkpoint
    from quarl.model.loading import checkpoint_keys

    keys = checkpoint_keys(path)
    sparse = next(i for i in range(hf.config.num_hidden_layers) if type(hf.model.layers[i].mlp).__name__ ==
                  "Qwen3MoeSparseMoeBlock")
    stacked = f"model.layers.{sparse}.mlp.experts.gate_up_proj" in keys
    per_expert = f"model.layers.{sparse}.mlp.experts.0.gate_proj.weight" in keys
    assert stacked != per_expert


def test_layers_are_sparse_where_transformers_makes_them(moe_checkpoint):
    path, hf = moe_checkpoint
    model = quarl.load_model(path)
    for ours, theirs in zip(model.layers, hf.model.layers):
        assert isinstance(ours.mlp, SparseMoeBlock) == (type(theirs.mlp).__name__ == "Qwen3MoeSparseMoeBlock")
        assert isinstance(ours.mlp, MLP) == (type(theirs.mlp).__name__ == "Qwen3MoeMLP")


def test_logits_match_hf(moe_checkpoint):
    path, hf = moe_checkpoint
    model = quarl.load_model(path, dtype=torch.float32)
    for length in (1, 9, 70):
        ids = torch.randint(0, hf.config.vocab_size, (3, length))
        with torch.no_grad():
            ours, ref = model(ids), hf(ids).logits
        assert ours.shape == ref.shape
        assert _rel(ours, ref) < 1e-5, length


def test_padded_batch_matches_single_sequences(moe_checkpoint):
    path, hf = moe_checkpoint
    model = quarl.load_model(path)
    seqs = [torch.randint(3, hf.config.vocab_size, (n,)) for n in (5, 12, 3)]
    ids = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for i, s in enumerate(seqs):  # row 0 right-padded, row 2 left-padded
        cols = slice(12 - len(s), 12) if i == 2 else slice(0, len(s))
        ids[i, cols], mask[i, cols] = s, 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask)
        for i, s in enumerate(seqs):
            assert _rel(batched[i][mask[i].bool()], hf(s[None]).logits[0]) < 1e-5, i


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with a KV cache: one prefill, then one token per forward."""
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer in cache:
            k, v = torch.cat([cache[layer][0], k], 1), torch.cat([cache[layer][1], v], 1)
        cache[layer] = (k, v)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=q.shape[1] > 1, enable_gqa=True)
        return out.transpose(1, 2)

    ids, out = torch.tensor([prompt]), []
    positions = torch.arange(len(prompt))[None]
    with torch.no_grad():
        for _ in range(n):
            token = int(model.logits(model.hidden_states(ids, positions, attn)[:, -1]).argmax(-1))
            out.append(token)
            ids, positions = torch.tensor([[token]]), positions[:, -1:] + 1
    return out


def test_greedy_decoding_matches_hf(moe_checkpoint):
    path, hf = moe_checkpoint
    model = quarl.load_model(path)
    for prompt in ([5, 17, 33], [9] * 10 + [40, 41], [60]):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert _greedy(model, prompt, 10) == ref


def test_block_gradients_match_hf():
    """The block's backward (grouped GEMMs, sort, gather) against transformers' per-expert loop."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_cfg = moe_hf_config(num_experts=6, num_experts_per_tok=3, norm_topk_prob=True)
    theirs = Qwen3MoeSparseMoeBlock(hf_cfg).float()
    ours = SparseMoeBlock(TransformerConfig.from_hf_dict(hf_cfg.to_dict()), layer_idx=0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.2)
        ours.gate.weight.copy_(theirs.gate.weight)
        ours.experts.gate_up_proj.copy_(theirs.experts.gate_up_proj)
        ours.experts.down_proj.copy_(theirs.experts.down_proj)
    x = torch.randn(2, 9, 64)
    grad = torch.randn(2, 9, 64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    (ya * grad).sum().backward()
    (yb * grad).sum().backward()
    assert _rel(ya, yb) < 1e-6
    assert _rel(xa.grad, xb.grad) < 1e-5
    assert _rel(ours.gate.weight.grad, theirs.gate.weight.grad) < 1e-5
    assert _rel(ours.experts.gate_up_proj.grad, theirs.experts.gate_up_proj.grad) < 1e-5
    assert _rel(ours.experts.down_proj.grad, theirs.experts.down_proj.grad) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_dim", [16, 13])  # 13: rows of 26 / 52 bytes, which only the padded path takes
def test_grouped_linear_paths_match_per_group_linears(dtype, k_dim):
    counts = [3, 0, 5, 1, 0, 7]  # empty groups among full ones
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), k_dim).to(dtype)
    w = torch.randn(len(counts), 11, k_dim).to(dtype)
    starts = [0, *offsets.tolist()[:-1]]
    ref = torch.cat([F.linear(x[s:e].float(), w[g].float()) for g, (s, e) in enumerate(zip(starts, offsets.tolist()))])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _rel(grouped_linear(x, w, offsets).float(), ref) < tol
    assert _rel(padded_grouped_linear(x, w, offsets).float(), ref) < tol


def test_sort_by_expert_is_stable_with_offsets():
    ids = torch.tensor([[2, 0], [0, 3], [2, 1], [3, 0]])
    order, offsets = sort_by_expert(ids, num_experts=5)
    flat = ids.reshape(-1)
    assert flat[order].tolist() == [0, 0, 0, 1, 2, 2, 3, 3]
    assert order.tolist() == [1, 2, 7, 5, 0, 4, 3, 6]  # within an expert: token order
    assert offsets.tolist() == [3, 4, 6, 8, 8] and offsets.dtype == torch.int32


def test_experts_match_a_loop_over_tokens():
    """The grouped expert computation equals each token's experts summed one by one, with odd widths
    (the padded path) and a token count of zero."""
    experts = Experts(hidden_size=10, intermediate_size=7, num_experts=5)
    x = torch.randn(6, 10)
    ids = torch.stack([torch.randperm(5)[:3] for _ in range(6)])
    weights = torch.rand(6, 3)
    out = experts(x, ids, weights)
    for t in range(6):
        ref = torch.zeros(10)
        for j in range(3):
            g, u = (experts.gate_up_proj[ids[t, j]] @ x[t]).split(7)
            ref += weights[t, j] * (experts.down_proj[ids[t, j]] @ (F.silu(g) * u))
        assert torch.allclose(out[t], ref, atol=1e-6)
    assert experts(x[:0], ids[:0], weights[:0]).shape == (0, 10)


def test_replaying_recorded_routes_reproduces_the_forward():
    model = build_random_model("moe-tiny", seed=1, std=0.2)
    ids = torch.randint(0, 128, (2, 11))
    sparse = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    with torch.no_grad(), moe_routing(model) as recorded:
        logits = model(ids)
    assert sorted(recorded.expert_ids) == sparse
    for layer in sparse:
        assert recorded.expert_ids[layer].shape == (22, 2) and recorded.expert_ids[layer].dtype == torch.int16
        assert recorded.router_ids[layer] is recorded.expert_ids[layer]
    with torch.no_grad(), moe_routing(model, replay=recorded.expert_ids) as replayed:
        assert torch.equal(model(ids), logits)
    assert all(torch.equal(replayed.router_ids[i], recorded.expert_ids[i]) for i in sparse)
    # other experts for the first sparse layer: other logits; the router's own choice is still recorded
    forced = dict(recorded.expert_ids)
    forced[sparse[0]] = (forced[sparse[0]].long() + 1) % 8
    with torch.no_grad(), moe_routing(model, replay=forced) as other:
        assert _rel(model(ids), logits) > 1e-3
    assert torch.equal(other.expert_ids[sparse[0]], forced[sparse[0]].to(torch.int16))
    assert torch.equal(other.router_ids[sparse[0]], recorded.expert_ids[sparse[0]])
    assert all(layer.mlp.routing is None for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock))


def test_replayed_routes_train_the_router_and_reject_wrong_shapes():
    """Under replay the gate weights come from the router's own probabilities of the given
    experts: the router gets a gradient. Replayed ids of another token count are refused."""
    model = build_random_model("moe-tiny", seed=2, std=0.2)
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad(), moe_routing(model) as recorded:
        model(ids)
    forced = {i: (t.long() + 3) % 8 for i, t in recorded.expert_ids.items()}
    with moe_routing(model, replay=forced):
        model(ids).logsumexp(-1).sum().backward()
    assert all(layer.mlp.gate.weight.grad.abs().sum() > 0 for layer in model.layers
               if isinstance(layer.mlp, SparseMoeBlock))
    with pytest.raises(ValueError, match="replayed expert ids have shape"), moe_routing(model, replay=forced):
        model(ids[:, :4])


def test_activation_checkpointing_gives_the_same_gradients_with_replay():
    model = build_random_model("moe-tiny", seed=4, std=0.2)
    ids = torch.randint(0, 128, (2, 8))
    positions, attn = batch_attention(ids)
    with torch.no_grad(), moe_routing(model) as recorded:
        model(ids)
    forced = {i: (t.long() + 5) % 8 for i, t in recorded.expert_ids.items()}
    grads = []
    for ops in (TORCH_OPS, CheckpointedOps(TORCH_OPS)):
        model.zero_grad()
        with moe_routing(model, replay=forced):  # the backward recomputes inside the block
            model.logits(model.hidden_states(ids, positions, attn, ops=ops)).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.allclose(grads[1][name], g, rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("per_expert", [True, False])
def test_quantized_loading_equals_load_then_quantize(tmp_path, per_expert):
    """``load_quantized_model`` reads either expert layout; the linears it packs (attention, the
    dense layer's MLP) and experts are those ``quantize_model`` swaps; the router keeps its dtype, the
    experts are packed per expert."""
    from quarl.model.quantized_loading import load_quantized_model
    from quarl.quant.experts import QuantExperts
    from quarl.quant.linear import QuantLinear, quantize_model

    make_moe_checkpoint(tmp_path, seed=6, per_expert=per_expert)
    packed = load_quantized_model(tmp_path, "w8a8-int8", dtype=torch.float32)
    ref = quarl.load_model(tmp_path)
    quantize_model(ref, "w8a8-int8", QuantLinear)
    assert packed.state_dict().keys() == ref.state_dict().keys()
    for name, t in ref.state_dict().items():
        assert torch.equal(packed.state_dict()[name], t), name
    assert isinstance(packed.layers[1].mlp.down_proj, QuantLinear)
    assert isinstance(packed.layers[0].mlp.experts, QuantExperts)
    assert packed.layers[0].mlp.gate.weight.dtype == torch.float32
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        assert torch.equal(packed(ids), ref(ids))


def test_save_model_loads_in_transformers_with_the_same_logits(tmp_path):
    import transformers as tf

    model = build_random_model("moe-tiny", seed=5, std=0.2)
    save_model(model, tmp_path / "m")
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        assert _rel(hf(ids).logits, model(ids)) < 1e-5
        assert torch.equal(quarl.load_model(tmp_path / "m")(ids), model(ids))


def test_config_reads_both_expert_count_spellings_and_writes_transformers_config():
    import transformers as tf

    raw = moe_hf_config().to_dict()
    cfg = TransformerConfig.from_hf_dict(raw)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.mlp_only_layers == (1,) and cfg.norm_topk_prob and cfg.qk_norm
    assert [cfg.is_moe_layer(i) for i in range(4)] == [True, False, True, True]
    released = {k: v for k, v in raw.items() if k != "num_local_experts"}
    assert TransformerConfig.from_hf_dict({**released, "num_experts": 8}) == cfg
    back = tf.Qwen3MoeConfig(**cfg.to_hf_dict())
    assert (back.num_experts, back.num_experts_per_tok, back.mlp_only_layers) == (8, 2, [1])
    assert TransformerConfig.from_hf_dict(back.to_dict()) == cfg


@pytest.mark.parametrize("change, message", [
    (dict(num_experts_per_tok=9), "exceeds num_experts"),
    (dict(moe_intermediate_size=None), "positive integer moe_intermediate_size"),
    (dict(mlp_only_layers=[4]), r"mlp_only_layers \[4\]"),
    (dict(shared_expert_intermediate_size=64), "shared experts"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step"),
])
def test_config_errors(change, message):
    raw = {**moe_hf_config().to_dict(), **change}
    with pytest.raises(ModelConfigError, match=message):
        TransformerConfig.from_hf_dict(raw)


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_moe_checkpoint(tmp_path, seed=1)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        quarl.load_model(tmp_path)


def test_presets():
    tiny = build_random_model("moe-tiny", dtype=torch.bfloat16)
    assert tiny(torch.randint(0, 128, (2, 5))).dtype == torch.bfloat16
    assert sum(p.numel() for p in tiny.parameters()) - 2 * 16 * 3 == preset_config("moe-tiny").num_parameters()
    big = preset_config("qwen3-30b-a3b")
    assert 30.4e9 < big.num_parameters() < 30.6e9  # Qwen3-30B-A3B: 30.5B parameters, 3.3B active
    assert 3.2e9 < big.matmul_params + big.vocab_size * big.hidden_size < 3.4e9
    with torch.device("meta"):
        model = Transformer(big)
    experts = model.layers[47].mlp.experts
    assert experts.gate_up_proj.shape == (128, 1536, 2048) and experts.down_proj.shape == (128, 2048, 768)
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers)
    hf = json.loads(json.dumps(big.to_hf_dict()))
    assert TransformerConfig.from_hf_dict(hf) == big
    assert 95e6 < preset_config("moe-100m").num_parameters() < 105e6


def test_route_takes_the_routers_own_top_k_where_replayed_ids_are_unknown():
    """Replayed rows holding -1 (positions the engine never ran: padding, a response's last
    token) route themselves; the other rows take the given experts with the router's own
    probabilities of them, renormalised, and those probabilities carry the router's gradient."""
    from quarl.model.moe import route

    torch.manual_seed(0)
    logits = torch.randn(5, 8, requires_grad=True)
    given = torch.tensor([[3, 1], [-1, -1], [0, 7], [-1, -1], [6, 2]], dtype=torch.int16)
    weights, ids, own = route(logits, 2, True, torch.float32, given)
    probs = torch.softmax(logits.detach(), -1)
    top = probs.topk(2, -1).indices
    assert torch.equal(own, top)
    known = torch.tensor([True, False, True, False, True])
    assert torch.equal(ids[known], given[known].long()) and torch.equal(ids[~known], top[~known])
    p = probs.gather(1, ids)
    torch.testing.assert_close(weights.detach(), p / p.sum(-1, keepdim=True))
    weights[:, 0].sum().backward()  # each row's first weight: a softmax over the row's pair
    assert (logits.grad[known].abs().sum(-1) > 0).all()
    # all unknown: exactly the router's own routing
    free = route(logits.detach(), 2, True, torch.float32)
    unknown = route(logits.detach(), 2, True, torch.float32, torch.full((5, 2), -1, dtype=torch.int16))
    assert all(torch.equal(a, b) for a, b in zip(free, unknown))


def test_a_partly_unknown_replay_trains_the_router_and_matches_routing_itself():
    """Through the model: the recorded routes with some tokens' rows set to -1 replay the
    recorded forward (those tokens route themselves, as they did); any replay still gives the
    routers their gradient."""
    model = build_random_model("moe-tiny", seed=6, std=0.2)
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad(), moe_routing(model) as recorded:
        logits = model(ids)
    partial = {i: t.clone() for i, t in recorded.expert_ids.items()}
    for t in partial.values():
        t[::3] = -1
    with torch.no_grad(), moe_routing(model, replay=partial) as replayed:
        assert torch.equal(model(ids), logits)
    assert all(torch.equal(replayed.expert_ids[i], recorded.expert_ids[i]) for i in partial)
    forced = {i: torch.where(t >= 0, (t.long() + 3) % 8, -1) for i, t in partial.items()}
    with moe_routing(model, replay=forced):
        model(ids).logsumexp(-1).sum().backward()
    assert all(layer.mlp.gate.weight.grad.abs().sum() > 0 for layer in model.layers
               if isinstance(layer.mlp, SparseMoeBlock))


def test_moe_routing_restores_a_routing_installed_before_it():
    """An engine keeps a recording routing installed on its model; a ``with moe_routing`` on the
    same model (a test's teacher-forced forward) puts it back at exit."""
    from quarl.model.moe import MoeRouting, install_routing

    model = build_random_model("moe-tiny", seed=7)
    kept = MoeRouting()
    install_routing(model, kept)
    with moe_routing(model):
        pass
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert blocks and all(b.routing is kept for b in blocks)
    install_routing(model, None)
    assert all(b.routing is None for b in blocks)
