"""The learner's compiled forward steps (torch.compile, inductor on CPU here) give the
eager model's hidden states and gradients, with and without q/k norm, over two shapes
(dynamic shapes: no recompilation is needed for a new batch)."""

from __future__ import annotations

import pytest
import torch

from quarl.model import Transformer, TransformerConfig
from quarl.model.compiled_ops import COMPILED_OPS
from quarl.model.transformer import batch_attention


@pytest.mark.parametrize("qk_norm", [True, False])
def test_compiled_ops_match_eager_values_and_grads(qk_norm):
    cfg = TransformerConfig(
        model_type="qwen3" if qk_norm else "qwen2", vocab_size=50, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=qk_norm,
        attention_bias=not qk_norm,
    )
    torch.manual_seed(3)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    for shape in ((3, 9), (2, 14)):
        ids = torch.randint(0, 50, shape)
        mask = torch.ones(shape, dtype=torch.long)
        mask[0, -2:] = 0
        pos, attn = batch_attention(ids, mask)
        w = torch.randn(*shape, 32)
        grads = []
        for ops in (None, COMPILED_OPS):
            model.zero_grad()
            h = model.hidden_states(ids, pos, attn) if ops is None else model.hidden_states(ids, pos, attn, ops)
            (h * w).sum().backward()
            grads.append((h.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        (h0, g0), (h1, g1) = grads
        torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-5)
        assert g0.keys() == g1.keys() and len(g0) > 10
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=n)


def test_one_row_then_two_rows_does_not_recompile():
    """A first micro-batch of one row must not specialise the compiled steps to one row:
    later micro-batches of 2 and 3 rows reuse the graphs (a recompile costs seconds mid-step
    on a GPU)."""
    from torch._dynamo.utils import counters

    cfg = TransformerConfig(
        model_type="qwen3", vocab_size=40, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=12, qk_norm=True,
    )
    torch.manual_seed(5)
    model = Transformer(cfg).to(torch.bfloat16)  # a dtype the other tests do not compile for

    def run(rows, t):
        ids = torch.randint(0, 40, (rows, t))
        pos, attn = batch_attention(ids)
        model.hidden_states(ids, pos, attn, COMPILED_OPS).float().sum().backward()

    run(1, 11)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    for rows, t in ((2, 7), (3, 13), (1, 5)):
        run(rows, t)
    assert counters["stats"]["unique_graphs"] == graphs


def _qwen2_model(hidden: int, intermediate: int, head_dim: int, seed: int) -> Transformer:
    """Two qwen2 layers (q/k/v biases) with weights ~ N(0, 0.3)."""
    cfg = TransformerConfig(
        model_type="qwen2", vocab_size=50, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, attention_bias=True,
    )
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def test_compiled_ops_with_fp8_kv_fake_quant_match_eager():
    """The learner's K/V rounding for an fp8 engine cache (``kv_quant="fp8"``) lives in the
    attention callable, outside the compiled steps: compiled and eager forwards agree, and
    the rounding is really applied (the hidden states differ from the unrounded ones)."""
    model = _qwen2_model(hidden=32, intermediate=48, head_dim=8, seed=3)
    ids = torch.randint(0, 50, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, -2:] = 0
    w = torch.randn(3, 9, 32)
    out = {}
    for kv_quant, ops in ((None, None), ("fp8", None), ("fp8", COMPILED_OPS)):
        pos, attn = batch_attention(ids, mask, kv_quant=kv_quant)
        model.zero_grad()
        h = model.hidden_states(ids, pos, attn) if ops is None else model.hidden_states(ids, pos, attn, ops)
        (h * w).sum().backward()
        out[kv_quant, ops is not None] = (h.detach(), model.layers[0].self_attn.k_proj.weight.grad.clone())
    (h_plain, _), (h_eager, g_eager), (h_comp, g_comp) = out.values()
    torch.testing.assert_close(h_comp, h_eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_comp, g_eager, rtol=1e-4, atol=1e-5)
    assert (h_eager - h_plain).abs().max() > 1e-3


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8-int8", "nvfp4"])
def test_compiled_ops_run_aligned_projections_grouped_with_the_eager_values(scheme):
    """An aligned (QAT) model under the compiled steps runs q/k/v and gate/up as one QAT GEMM
    each (not nvfp4: a per-tensor scale): hidden states and every master weight's gradient
    match the eager forward that runs them one by one."""
    from quarl.quant import quantize_model
    from quarl.quant.linear import qat_group

    model = _qwen2_model(hidden=64, intermediate=96, head_dim=16, seed=4)
    quantize_model(model, scheme)
    ids = torch.randint(0, 50, (3, 9))
    pos, attn = batch_attention(ids)
    w = torch.randn(3, 9, 64)
    out = []
    for ops in (None, COMPILED_OPS):
        model.zero_grad()
        h = model.hidden_states(ids, pos, attn) if ops is None else model.hidden_states(ids, pos, attn, ops)
        (h * w).sum().backward()
        out.append((h.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (h0, g0), (h1, g1) = out
    grouped = qat_group(model.layers[0].mlp, ("gate_proj", "up_proj")) is not None
    assert grouped == (scheme != "nvfp4")
    torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and "layers.0.self_attn.k_proj.weight" in g0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=n)
