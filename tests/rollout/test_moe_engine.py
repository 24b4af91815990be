"""MoE models (moe-tiny) with quantized experts in the engine and the learner: the engine's
fused path (Triton kernels, interpreted on CPU) and the learner's compiled ops run the sparse
block's own forward, and in aligned mode the learner's log-probs of the engine's samples are
the engine's."""

from __future__ import annotations

import copy

import pytest
import torch

from quarl.config.run import QuantConfig
from quarl.learner import Learner
from quarl.learner.batch import build_batch
from quarl.learner.compiled_ops import COMPILED_OPS
from quarl.model.moe import SparseMoeBlock
from quarl.model.presets import build_random_model
from quarl.model.transformer import TORCH_OPS, batch_attention
from quarl.quant import QATLinear, QuantLinear, QuantMode, get_scheme, quantize_model
from quarl.quant.experts import QATExperts, QuantExperts
from quarl.rollout import EngineConfig, SamplingParams
from quarl.rollout.fused import FUSED_OPS, fuse_projections
from quarl.trainer.weights import build_engine_and_publisher

PROMPTS = [[5, 17, 33], [9] * 12 + [40, 41], list(range(3, 23))]


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8-int8"])
def test_fused_ops_run_the_sparse_block_on_rows(scheme):
    """fuse_projections leaves the sparse layers' MLP alone (q/k/v fused everywhere, gate/up in
    the dense layer), and the fused forward equals the model's own."""
    model = build_random_model("moe-tiny", seed=1, std=0.2)
    quantize_model(model, scheme, QuantLinear)
    ref = copy.deepcopy(model)
    assert fuse_projections(model) == len(model.layers) + 1
    assert not hasattr(model.layers[0].mlp, "_fused_gate_up") and hasattr(model.layers[1].mlp, "_fused_gate_up")
    ids = torch.randint(0, 128, (2, 7))
    positions, attn = batch_attention(ids)
    with torch.no_grad():
        want = ref.hidden_states(ids, positions, attn)
        got = model.hidden_states(ids, positions, attn, FUSED_OPS)
    torch.testing.assert_close(got.view(want.shape), want, rtol=1e-5, atol=1e-5)


def _aligned(scheme: str, attention_backend: str = "auto"):
    torch.manual_seed(0)
    base = build_random_model("moe-tiny", seed=11, std=0.3)
    quant = QuantConfig(mode=QuantMode.ALIGNED, scheme=get_scheme(scheme))
    config = EngineConfig(max_model_len=48, block_size=4, num_kv_blocks=96, attention_backend=attention_backend)
    engine, publisher = build_engine_and_publisher(base, quant, config)
    with torch.no_grad():  # the learner moves away from the engine's copy: the publish must carry it over
        for p in publisher.learner_model.parameters():
            p.mul_(1.05)
    publisher.publish()
    return engine, publisher.learner_model


def _gap(engine, learner_model) -> float:
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=3, ignore_eos=True)
    outs = engine.generate(PROMPTS, params)
    prompts = [PROMPTS[c.prompt_index] for c in outs]
    batch = build_batch(prompts, [c.token_ids for c in outs], [c.logprobs for c in outs], [0.0] * len(outs),
                        torch.zeros(len(outs)))
    logp = Learner(learner_model).logprobs(batch, token_budget=64)  # micro-batches, right padding
    mask = batch.response_mask.bool()
    return float((logp[mask] - batch.sampler_logp[mask]).abs().max())


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8-int8", "w8a8-fp8"])
def test_aligned_learner_log_probs_of_engine_samples_are_the_engines(scheme):
    engine, learner_model = _aligned(scheme)
    assert isinstance(engine.model.layers[0].mlp.experts, QuantExperts)
    assert isinstance(learner_model.layers[0].mlp.experts, QATExperts)
    assert _gap(engine, learner_model) < 1e-5


def test_aligned_parity_on_the_engines_fused_path():
    """The engine's fused path (Triton norm / rope / SiLU kernels, interpreted) with w8a8 experts."""
    engine, learner_model = _aligned("w8a8-int8", attention_backend="triton")
    assert engine.runner.fused
    assert _gap(engine, learner_model) < 1e-5


def test_unquantized_experts_part_from_the_engine():
    """Control: the same run with the learner's experts left in full precision does not agree."""
    engine, learner_model = _aligned("w8a8-int8")
    for layer in learner_model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.experts = layer.mlp.experts.to_experts()
    assert _gap(engine, learner_model) > 1e-3


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8-int8"])
def test_compiled_ops_run_moe_layers_with_the_eager_values_and_grads(scheme):
    model = build_random_model("moe-tiny", seed=2, std=0.3)
    quantize_model(model, scheme, QATLinear)
    ids = torch.randint(0, 128, (2, 9))
    pos, attn = batch_attention(ids)
    w = torch.randn(2, 9, 64)
    out = []
    before = COMPILED_OPS.moe_layers
    for ops in (TORCH_OPS, COMPILED_OPS):
        model.zero_grad()
        h = model.hidden_states(ids, pos, attn, ops)
        (h * w).sum().backward()
        out.append((h.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert COMPILED_OPS.moe_layers - before == 2
    (h0, g0), (h1, g1) = out
    torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and "layers.0.mlp.experts.gate_up_proj" in g0
    for n in g0:  # (float32 sums in another order: relative to each gradient's scale)
        assert (g1[n] - g0[n]).abs().max() <= 2e-5 * g0[n].abs().max(), n


@pytest.mark.parametrize("mode, scheme", [("aligned", "w4a16"), ("rollout", "w8a8-fp8"), ("bf16", "bf16")])
def test_the_engine_copy_never_holds_a_second_full_precision_model(mode, scheme):
    """The engine's copy shares the tensors it is about to pack (linears and experts) with the
    learner instead of copying them; once built, no engine tensor aliases a learner tensor (the
    engine packed and dropped them), the learner's values are untouched, and a bf16 engine
    keeps a copy of its own."""
    from quarl.trainer.weights import _engine_copy

    base = build_random_model("moe-tiny", seed=5, std=0.3)
    quant = QuantConfig(mode=QuantMode(mode), scheme=get_scheme(scheme))
    before = {k: v.clone() for k, v in base.state_dict().items()}
    copied = _engine_copy(base, quant)
    shares = copied.layers[0].mlp.experts.gate_up_proj is base.layers[0].mlp.experts.gate_up_proj
    assert shares == (scheme != "bf16")
    assert (copied.layers[0].self_attn.q_proj.weight is base.layers[0].self_attn.q_proj.weight) == (scheme != "bf16")
    assert copied.embed_tokens.weight is not base.embed_tokens.weight and copied.norm.weight is not base.norm.weight
    config = EngineConfig(max_model_len=48, block_size=4, num_kv_blocks=96)
    engine, publisher = build_engine_and_publisher(base, quant, config)
    learner_ptrs = {t.data_ptr() for t in publisher.learner_model.state_dict().values() if t.numel()}
    engine_ptrs = {t.data_ptr() for t in engine.model.state_dict().values() if t.numel()}
    assert not learner_ptrs & engine_ptrs
    after = publisher.learner_model.state_dict()
    for k, v in before.items():
        if k in after:
            assert torch.equal(after[k], v), k
