"""The learner's memory options: activation checkpointing (same values and gradients),
:class:`LeanAdamW` (torch's AdamW with bf16 moments and stochastically rounded bf16
weights), Muon with stochastic rounding, and an exact resume through their state."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import quarl.learner.optim as optim
import quarl.quant.linear as qlinear
from quarl.learner.learner import Learner, UpdateSettings
from quarl.learner.logprobs import sequence_logprobs
from quarl.learner.optim import (
    LeanAdamW,
    StochasticRoundingMuon,
    bytes_per_param,
    stochastic_round_to_bf16,
    training_memory_bytes,
)
from quarl.model.presets import build_random_model
from quarl.model.transformer import TORCH_OPS, CheckpointedOps
from quarl.quant.linear import QATLinear, quantize_model, set_per_use_dequant
from tests.learner.test_learner import _batch

BF16_ULP_AT_1 = 2.0**-7  # the gap between bf16 numbers in [1, 2)


# ---- activation checkpointing --------------------------------------------------------------------


def _model(mode: str) -> torch.nn.Module:
    model = build_random_model("tiny", seed=7, dtype=torch.float32, std=0.1)
    if mode != "bf16":
        quantize_model(model, "w4a16")  # quant.mode=aligned: QATLinear master weights, STE backward
    return model


def _update_grads(model: torch.nn.Module, checkpointing: bool, token_budget: int) -> tuple[dict, dict]:
    """One learner update without stepping: its metrics and the gradients it leaves."""
    learner = Learner(model, lr=0.0, activation_checkpointing=checkpointing)
    learner.optimizer.zero_grad = lambda set_to_none=True: None  # keep the gradients for inspection
    batch = _batch(2)
    metrics = learner.update(batch, UpdateSettings(loss_type="ppo", token_budget=token_budget, grad_clip=1e9))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return metrics, grads


# "leaf": the weight-only path of the GPU learner (F.linear over a dequantized leaf whose
# gradient a hook hands to the master weights), forced on CPU; "function": the STE autograd function
@pytest.mark.parametrize("mode", ["bf16", "aligned-w4a16-function", "aligned-w4a16-leaf"])
def test_checkpointed_update_has_the_same_loss_and_gradients(mode, monkeypatch):
    if mode.endswith("leaf"):
        monkeypatch.setattr(qlinear, "learner_runs_dequantized", lambda x, qw: qw.scheme.act_format == "none")
    runs = [_update_grads(_model(mode), checkpointing, token_budget=20) for checkpointing in (False, True)]
    (m_plain, g_plain), (m_ckpt, g_ckpt) = runs
    assert m_plain == m_ckpt
    assert g_plain.keys() == g_ckpt.keys() and len(g_plain) == len(list(_model(mode).parameters()))
    for name in g_plain:
        assert torch.equal(g_plain[name], g_ckpt[name]), name
    if mode != "bf16":  # the STE gradients reached the master weights of the aligned linears
        model = _model(mode)
        qat = [n + ".weight" for n, m in model.named_modules() if isinstance(m, QATLinear)]
        assert qat and all(g_ckpt[n].abs().max() > 0 for n in qat)


def test_per_use_dequant_keeps_no_dense_weight(monkeypatch):
    """``set_per_use_dequant`` (on with activation checkpointing): an aligned weight-only
    forward keeps neither a dequantized leaf between forwards nor the dense weight for its
    backward (it saves x only), with the same log-probs and gradients."""
    monkeypatch.setattr(qlinear, "learner_runs_dequantized", lambda x, qw: qw.scheme.act_format == "none")
    model = _model("aligned-w4a16")
    kept, logp_kept = _saved_bytes(model, TORCH_OPS)
    leaves = lambda: [h._leaf.leaf for h in qlinear._qat_holders(model) if h._leaf.leaf is not None]  # noqa: E731
    assert leaves()
    grads_kept = _grads_of(model)
    set_per_use_dequant(model)
    assert not leaves()
    per_use, logp_per_use = _saved_bytes(model, TORCH_OPS)
    assert not leaves() and torch.equal(logp_kept, logp_per_use)
    dense = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, QATLinear))
    assert kept - per_use >= dense, (kept, per_use, dense)
    grads = _grads_of(model)
    assert grads.keys() == grads_kept.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_kept[name]), name


def _grads_of(model) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    batch = _batch(2)
    with qlinear.deferred_master_grads(model):
        logp, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, right_padded=True)
        logp.sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _saved_bytes(model, ops) -> tuple[int, torch.Tensor]:
    """Bytes autograd keeps for the backward of one log-prob forward (outside any checkpoint)."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    batch = _batch(2)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, ops=ops, right_padded=True)
    return sum(saved), logp


def test_checkpointing_keeps_only_the_layer_inputs():
    model = _model("bf16")
    plain, logp_plain = _saved_bytes(model, TORCH_OPS)
    ckpt, logp_ckpt = _saved_bytes(model, CheckpointedOps(TORCH_OPS))
    assert torch.equal(logp_plain, logp_ckpt)
    assert ckpt < plain / 4, (ckpt, plain)
    with torch.no_grad():  # no gradients: the blocks run as the inner ops run them, nothing to recompute
        ids = _batch(2).input_ids
        assert torch.equal(sequence_logprobs(model, ids, ops=CheckpointedOps(TORCH_OPS))[0],
                           sequence_logprobs(model, ids, ops=TORCH_OPS)[0])


# ---- LeanAdamW ------------------------------------------------------------------------------------


def _params(dtype=torch.float32, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(17, 33), (64,), (5, 4, 3)]
    return [torch.randn(s, generator=g).to(dtype).requires_grad_(True) for s in shapes]


def _grads(params, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=g) * 0.1 + 0.05).to(p.dtype) for p in params]


def _run(opt, params, steps: range) -> None:
    for step in steps:
        for p, grad in zip(params, _grads(params, step)):
            p.grad = grad
        opt.step()


@pytest.mark.parametrize("chunk", [None, 7])
def test_lean_adamw_with_float32_states_is_torch_adamw(chunk, monkeypatch):
    """Also stepped in slices smaller than the tensors (``STEP_CHUNK``, 7 elements: slices
    that cross rows and a ragged last one): the update is elementwise, so it is the same."""
    if chunk is not None:
        monkeypatch.setattr(optim, "STEP_CHUNK", chunk)
    hp = dict(lr=3e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ours, torchs = _params(), _params()
    _run(LeanAdamW(ours, **hp), ours, range(8))
    _run(torch.optim.AdamW(torchs, **hp), torchs, range(8))
    for a, b in zip(ours, torchs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert not torch.equal(a, _params()[0]) if a.shape == (17, 33) else True


@pytest.mark.parametrize("chunk", [None, 100])
def test_bf16_moments_track_float32_moments(chunk, monkeypatch):
    """After 600 steps of noisy gradients the bf16 moments are unbiased (mean drift < 0.5%)
    and within the random walk stochastic rounding makes over each moment's horizon (m: a
    couple of ulps, v over 1/(1-beta2) = 1000 steps: ~10), and the weights stay close; also
    when the step runs in slices (``STEP_CHUNK``)."""
    if chunk is not None:
        monkeypatch.setattr(optim, "STEP_CHUNK", chunk)
    hp = dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    ref, lean = _params(), _params()
    opt_ref, opt_lean = LeanAdamW(ref, **hp), LeanAdamW(lean, state_dtype=torch.bfloat16, **hp)
    _run(opt_ref, ref, range(600))
    _run(opt_lean, lean, range(600))
    ulp = 2.0**-8  # bf16's relative spacing
    for p_ref, p_lean, p0 in zip(ref, lean, _params()):
        s_ref, s_lean = opt_ref.state[p_ref], opt_lean.state[p_lean]
        assert s_lean["exp_avg"].dtype == torch.bfloat16 and s_lean["exp_avg_sq"].dtype == torch.bfloat16
        for key, ulps in (("exp_avg", 2), ("exp_avg_sq", 10)):
            want, got = s_ref[key], s_lean[key].float()
            rel = (got - want).abs() / want.abs().clamp_min(1e-12)
            assert float(rel.median()) < ulps * ulp, key
            assert abs(float((got - want).sum() / want.abs().sum())) < 5e-3, key
        moved = (p_ref - p0).detach().abs().mean()
        assert float((p_lean - p_ref).detach().abs().mean()) < 0.02 * float(moved)


def test_bf16_second_moment_decays_as_in_float32():
    """v * 0.999 is within half a bf16 ulp of v: rounded to nearest, v would never decay.
    After 50 steps of gradient 1 and 1000 of gradient 0, float32 v is 0.999^1000 = 0.37 of
    its peak; the stochastically rounded bf16 v matches it on average."""
    w32, w16 = torch.zeros(1024, requires_grad=True), torch.zeros(1024, requires_grad=True)
    opt32, opt16 = LeanAdamW([w32], lr=1e-3), LeanAdamW([w16], lr=1e-3, state_dtype=torch.bfloat16)
    for step in range(1050):
        for w, opt in ((w32, opt32), (w16, opt16)):
            w.grad = torch.full_like(w, 1.0 if step < 50 else 0.0)
            opt.step()
    v32, v16 = opt32.state[w32]["exp_avg_sq"], opt16.state[w16]["exp_avg_sq"].float()
    assert float(v16.mean()) == pytest.approx(float(v32.mean()), rel=0.01)
    peak = torch.tensor(1 - 0.999**50).to(torch.bfloat16)
    assert (peak.float() * 0.999).to(torch.bfloat16) == peak  # what rounding to nearest would keep


def test_stochastic_rounding_is_unbiased():
    gen = torch.Generator().manual_seed(0)
    x = torch.tensor([1.0 + 0.3 * BF16_ULP_AT_1, -(1.0 + 0.7 * BF16_ULP_AT_1), 3.0, float("inf")])
    rounded = torch.stack([stochastic_round_to_bf16(x, gen) for _ in range(20000)]).float()
    assert set(rounded[:, 0].tolist()) == {1.0, 1.0 + BF16_ULP_AT_1}  # only the two neighbours
    torch.testing.assert_close(rounded.mean(0)[:2], x[:2], rtol=0, atol=0.02 * BF16_ULP_AT_1)
    assert torch.equal(rounded[:, 2:], x[2:].expand(20000, 2))  # bf16 values and infinities stay


@pytest.mark.parametrize("stochastic", [True, False])
def test_updates_far_below_one_ulp_accumulate_only_with_stochastic_rounding(stochastic):
    """1000 AdamW steps of 0.01 ulp each (a constant gradient: Adam's step is lr) on bf16
    weights at 1.0: ~10 ulps on average with stochastic rounding, nothing when rounded to nearest."""
    w = torch.ones(2048, dtype=torch.bfloat16, requires_grad=True)
    opt = LeanAdamW([w], lr=0.01 * BF16_ULP_AT_1, stochastic_rounding=stochastic)
    for _ in range(1000):
        w.grad = -torch.ones_like(w)
        opt.step()
    moved_ulps = float((w.detach().float() - 1.0).mean()) / BF16_ULP_AT_1
    if stochastic:
        assert moved_ulps == pytest.approx(10.0, rel=0.03)
    else:
        assert moved_ulps == 0.0


def test_stochastic_rounding_takes_bf16_weights_only():
    with pytest.raises(ValueError, match="writes bfloat16 weights, got a torch.float16 parameter"):
        LeanAdamW([torch.zeros(3, dtype=torch.float16, requires_grad=True)], stochastic_rounding=True)


def _resume_is_exact(make_opt, dtype) -> None:
    """Six steps straight, against three steps, a state_dict through bytes into a new
    optimizer over copies of the weights, three more: equal bit for bit."""
    straight = _params(dtype)
    _run(make_opt(straight), straight, range(6))
    first = _params(dtype)
    opt = make_opt(first)
    _run(opt, first, range(3))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    second = [p.detach().clone().requires_grad_(True) for p in first]
    opt2 = make_opt(second)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    _run(opt2, second, range(3, 6))
    for a, b in zip(straight, second):
        assert torch.equal(a, b)
    for p in second:
        for key, t in opt2.state[p].items():
            if key.startswith("exp_avg"):
                assert t.dtype == getattr(opt2, "state_dtype", t.dtype)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_lean_adamw_state_dict_continues_exactly(state_dtype):
    _resume_is_exact(lambda ps: LeanAdamW(ps, lr=1e-3, state_dtype=state_dtype, stochastic_rounding=True, seed=3),
                     torch.bfloat16)


def test_muon_with_stochastic_rounding_moves_bf16_weights_and_resumes_exactly():
    matrix = torch.ones(32, 32, dtype=torch.bfloat16, requires_grad=True)
    opt = StochasticRoundingMuon([matrix], lr=1e-3, adjust_lr_fn="match_rms_adamw")
    plain = torch.ones(32, 32, dtype=torch.bfloat16, requires_grad=True)
    plain_opt = torch.optim.Muon([plain], lr=1e-3, adjust_lr_fn="match_rms_adamw")
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        grad = torch.randn(32, 32, generator=g).to(torch.bfloat16)
        matrix.grad, plain.grad = grad, grad.clone()
        opt.step()
        plain_opt.step()
    assert torch.equal(plain, torch.ones_like(plain))  # round to nearest: every update lost
    assert (matrix != 1).float().mean() > 0.05

    def make(ps):
        return _CombinedMuon(ps)

    _resume_is_exact(make, torch.bfloat16)


class _CombinedMuon(torch.optim.Optimizer):
    """Muon on the 2-D tensors, LeanAdamW on the rest (as build_optimizer splits them)."""

    def __init__(self, params):
        self.muon = StochasticRoundingMuon([p for p in params if p.dim() == 2], lr=1e-3, seed=1)
        self.adam = LeanAdamW([p for p in params if p.dim() != 2], lr=1e-3, state_dtype=torch.bfloat16,
                              stochastic_rounding=True, seed=2)
        self.state = self.adam.state

    def step(self):
        self.muon.step()
        self.adam.step()

    def state_dict(self):
        return {"muon": self.muon.state_dict(), "adam": self.adam.state_dict()}

    def load_state_dict(self, sd):
        self.muon.load_state_dict(sd["muon"])
        self.adam.load_state_dict(sd["adam"])


# ---- the learner with the lean options ------------------------------------------------------------


@pytest.mark.parametrize("optim_name", ["adamw", "muon"])
def test_lean_learner_resumes_exactly(optim_name):
    """A bf16 learner without fp32 masters, bf16 moments and checkpointing: two updates,
    against one, a state_dict round trip into a fresh learner, one more."""
    def learner(seed):
        model = build_random_model("tiny", seed=seed, dtype=torch.bfloat16, std=0.1)
        return Learner(model, optim_name=optim_name, lr=1e-4, fp32_master=False, state_dtype=torch.bfloat16,
                       activation_checkpointing=True, seed=5)

    s = UpdateSettings(loss_type="ppo", token_budget=24)
    straight = learner(3)
    assert straight.master is None
    for _ in range(2):
        straight.update(_batch(), s)
    first = learner(3)
    first.update(_batch(), s)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    second = learner(4)
    second.load_state_dict(torch.load(buf, weights_only=True))
    second.update(_batch(), s)
    a, b = straight.model.state_dict(), second.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], first.model.state_dict()[k]) for k in a)


def test_lean_learner_builds_the_lean_optimizers():
    bf16 = build_random_model("tiny", seed=1, dtype=torch.bfloat16)
    lean = Learner(copy.deepcopy(bf16), fp32_master=False)
    assert isinstance(lean.optimizer, LeanAdamW) and lean.optimizer.stochastic_rounding
    assert lean.optimizer.state_dtype == torch.float32
    masters = Learner(copy.deepcopy(bf16), state_dtype=torch.bfloat16)  # fp32 masters, bf16 moments
    assert isinstance(masters.optimizer, LeanAdamW) and not masters.optimizer.stochastic_rounding
    plain = Learner(build_random_model("tiny", seed=1))
    assert type(plain.optimizer) is torch.optim.AdamW  # the defaults keep torch's optimizer
    muon = Learner(copy.deepcopy(bf16), optim_name="muon", fp32_master=False)
    kinds = [type(o) for o in muon.optimizer.optimizers]
    assert kinds == [StochasticRoundingMuon, LeanAdamW]


def test_memory_per_parameter():
    assert bytes_per_param(torch.bfloat16) == 20  # bf16 weight + grad, fp32 master + grad, fp32 m + v
    assert bytes_per_param(torch.bfloat16, fp32_master=False) == 12
    assert bytes_per_param(torch.bfloat16, fp32_master=False, state_dtype=torch.bfloat16) == 8
    assert bytes_per_param(torch.float32) == 16  # a float32 model needs no master
    assert training_memory_bytes(10**9, torch.bfloat16, False, torch.bfloat16) == 8 * 10**9
