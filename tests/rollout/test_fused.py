"""The fused decode path (Triton norm/rope/SiLU kernels, fused q/k/v and gate/up GEMMs),
run under the Triton interpreter against the model's own forward."""

from __future__ import annotations

import copy

import torch

from quarl.model.presets import build_random_model
from quarl.model.transformer import batch_attention
from quarl.rollout.fused import fuse_projections, fused_hidden_states
from quarl.rollout.weights import load_weights_in_place


def test_fused_projections_are_views_and_forward_matches():
    torch.manual_seed(0)
    model = build_random_model("tiny", seed=1, std=0.2)
    for layer in model.layers:  # give q/k/v biases, as Qwen2 has
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            lin.bias = torch.nn.Parameter(0.1 * torch.randn(lin.out_features))
    ref = copy.deepcopy(model)
    assert fuse_projections(model) == 2 * len(model.layers)
    a = model.layers[0].self_attn
    w, b = a._fused_qkv
    assert a.k_proj.weight.data_ptr() == w[a.q_proj.out_features :].data_ptr()
    ids = torch.randint(0, 128, (2, 7))
    positions, attn = batch_attention(ids)
    with torch.no_grad():
        want = ref.hidden_states(ids, positions, attn)
        got = fused_hidden_states(model, ids, positions, attn)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # loading weights by name writes into the fused buffers
    new = {n: p.detach() * 0.5 for n, p in ref.named_parameters()}
    load_weights_in_place(model, new)
    for n, p in ref.named_parameters():
        p.data.mul_(0.5)
    with torch.no_grad():
        torch.testing.assert_close(fused_hidden_states(model, ids, positions, attn),
                                   ref.hidden_states(ids, positions, attn), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w[: a.q_proj.out_features], ref.layers[0].self_attn.q_proj.weight)
