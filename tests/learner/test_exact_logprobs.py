"""Exact mode's update forward (autograd on): the log-probs the loss sees are the invariant
forward's bits, their gradients the ordinary forward's (``sequence_logprobs``, module doc of
``quarl.learner.logprobs``); an MoE policy takes that path only where its layers replay given
experts, else the invariant forward under autograd."""

from __future__ import annotations

import dataclasses

import torch

from quarl.learner.logprobs import _routes_alike, sequence_logprobs
from quarl.model.moe import moe_layer_ids, moe_routing
from quarl.model.presets import build_random_model, preset_config
from quarl.model.transformer import TORCH_OPS, CheckpointedOps
from quarl.quant.kernels.invariant_model import ExactMode


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


def _setup(preset: str, seed: int):
    """A random bf16 model of ``preset`` (vocabulary 128) in exact mode, a right-padded batch
    ``(ids, mask)`` and a random upstream gradient for its log-probs."""
    cfg = dataclasses.replace(preset_config(preset), vocab_size=128)
    model = build_random_model(cfg, dtype=torch.bfloat16, std=0.1)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (3, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 8:], mask[2, 5:] = 0, 0  # right-padded rows of other lengths
    upstream = torch.randn(3, 10, generator=gen) * mask[:, 1:]
    model.exact = ExactMode(page=4)
    return model, ids, mask, upstream, model.exact


def _grads_and_logp(model, ids, mask, upstream, exact):
    model.exact = exact
    model.zero_grad()
    logp, ent = sequence_logprobs(model, ids, mask, temperature=0.8, with_entropy=True,
                                  ops=CheckpointedOps(TORCH_OPS), right_padded=True)
    (logp * upstream).sum().backward()
    return logp, ent, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_exact_update_forward_has_invariant_values_and_the_ordinary_gradients():
    model, ids, mask, upstream, exact = _setup("tiny", seed=5)
    with torch.no_grad():
        want, want_ent = sequence_logprobs(model, ids, mask, temperature=0.8, with_entropy=True, right_padded=True)
    logp, ent, grads = _grads_and_logp(model, ids, mask, upstream, exact)
    _, _, ordinary = _grads_and_logp(model, ids, mask, upstream, None)
    real = mask[:, 1:].bool()
    assert logp.requires_grad
    assert torch.equal(_bits(logp.detach()[real]), _bits(want[real]))  # the invariant bits
    assert torch.equal(_bits(ent[real]), _bits(want_ent[real]))
    assert grads.keys() == ordinary.keys() and len(grads) == len(list(model.parameters()))
    for name, g in grads.items():  # the ordinary path's gradients, bit for bit
        assert torch.equal(g, ordinary[name]), name
    assert sum(float(g.abs().sum()) for g in grads.values()) > 0


def test_moe_exact_update_forward_takes_the_ordinary_gradients_only_with_replayed_routes():
    model, ids, mask, upstream, exact = _setup("moe-tiny", seed=8)
    layers = moe_layer_ids(model)
    with torch.no_grad(), moe_routing(model) as routing:
        want = sequence_logprobs(model, ids, mask, temperature=0.8, right_padded=True)[0]
    replay = {i: routing.expert_ids[i].clone() for i in layers}  # the invariant forward's own experts
    real = mask[:, 1:].bool()
    with moe_routing(model, replay=replay):
        logp, _, grads = _grads_and_logp(model, ids, mask, upstream, exact)
    with moe_routing(model, replay=replay):
        _, _, ordinary = _grads_and_logp(model, ids, mask, upstream, None)
    assert torch.equal(_bits(logp.detach()[real]), _bits(want[real]))
    for name, g in grads.items():
        assert torch.equal(g, ordinary[name]), name
    # without replay the routes of the two forwards could part: the invariant forward runs under
    # autograd (its backward recomputes each op's ordinary forward), the same values
    logp_free, _, free = _grads_and_logp(model, ids, mask, upstream, exact)
    assert torch.equal(_bits(logp_free.detach()[real]), _bits(want[real]))
    assert free.keys() == grads.keys() and all(bool(torch.isfinite(g).all()) for g in free.values())
    assert not _routes_alike(model)
    with moe_routing(model, replay=replay):
        assert _routes_alike(model)
    with moe_routing(model, replay={max(layers) + 1: replay[layers[0]]}):  # no replay for the model's layers
        assert not _routes_alike(model)


def test_exact_update_under_autograd_has_the_invariant_values_and_close_gradients():
    """quant.exact_update=autograd: the invariant forward under autograd (no layer recomputed):
    the same log-prob bits as the engine's; gradients from each op's ordinary backward at the
    invariant activations, equal to the ordinary path's up to bf16 rounding."""
    model, ids, mask, upstream, exact = _setup("tiny", seed=6)
    with torch.no_grad():
        want = sequence_logprobs(model, ids, mask, temperature=0.8, right_padded=True)[0]
    logp, _, grads = _grads_and_logp(model, ids, mask, upstream, exact._replace(update="autograd"))
    _, _, ordinary = _grads_and_logp(model, ids, mask, upstream, None)
    real = mask[:, 1:].bool()
    assert torch.equal(_bits(logp.detach()[real]), _bits(want[real]))
    assert grads.keys() == ordinary.keys() and len(grads) == len(list(model.parameters()))
    flat = torch.cat([g.float().flatten() for g in grads.values()])
    ref = torch.cat([ordinary[n].float().flatten() for n in grads])
    assert float(ref.norm()) > 0
    # bf16 activations rounded at other steps (invariant vs fused ordinary kernels): a few percent
    assert float((flat - ref).norm() / ref.norm()) < 0.05
    cos = float(flat @ ref / (flat.norm() * ref.norm()))
    assert cos > 0.998
