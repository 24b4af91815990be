"""Learner update: micro-batching by token budget gives the same step as one big batch."""

from __future__ import annotations

import copy

import pytest
import torch

from quarl.algos.corrections import CorrectionSpec, mismatch_correction
from quarl.learner.batch import Packing, budget_ranges, build_batch, micro_batches, split_by_token_budget
from quarl.learner.learner import Learner, UpdateSettings
from quarl.model.presets import build_random_model


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts, responses, lps = [], [], []
    for i in range(6):
        p = torch.randint(3, 120, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        r = torch.randint(3, 120, (1 if i == 0 else int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        prompts.append(p)
        responses.append(r)
        lps.append((-torch.rand(len(r), generator=g) * 4).tolist())
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    adv = torch.tensor([0.5, -0.5, 0.7, 0.1, -1.0, -0.3])
    return build_batch(prompts, responses, lps, rewards, adv)


def test_build_batch_layout():
    b = build_batch([[5, 6, 7]], [[8, 9]], [[-0.5, -0.25]], [1.0], torch.tensor([1.0]))
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9]]
    # position t predicts input_ids[t+1]: responses are predicted from positions 2 and 3
    assert b.response_mask.tolist() == [[0.0, 0.0, 1.0, 1.0]]
    assert b.sampler_logp.tolist() == [[0.0, 0.0, -0.5, -0.25]]


def test_split_by_token_budget_respects_budget():
    b = _batch()
    lengths = b.attention_mask.sum(-1)
    groups = split_by_token_budget(b, 24)
    assert sorted(torch.cat(groups).tolist()) == list(range(b.size))
    for g in groups:
        assert len(g) == 1 or int(lengths[g].max()) * len(g) <= 24


def test_budget_ranges_hand_computed():
    # budget 10: [3, 3, 3] fits (9), a 4 makes 4 x 4 = 16; [4, 2] = 8; a 12 is alone; [1, 1]
    assert budget_ranges([3, 3, 3, 4, 2, 12, 1, 1], 10) == [(0, 3), (3, 5), (5, 6), (6, 8)]
    assert budget_ranges([], 10) == []
    assert budget_ranges([20, 20], 10) == [(0, 1), (1, 2)]


def test_micro_batches_are_the_split_as_host_known_slices():
    """Same rows as split_by_token_budget, with widths and response-token counts read once;
    ``rows`` gives exactly what ``select`` gives for those rows."""
    b = _batch()
    parts = micro_batches(b, 24)
    groups = split_by_token_budget(b, 24)
    assert [list(range(p.lo, p.hi)) for p in parts] == [g.tolist() for g in groups]
    for p, g in zip(parts, groups):
        want = b.select(g)
        got = b.rows(p)
        assert p.width == want.input_ids.shape[1] and p.response_tokens == want.num_response_tokens
        for name in ("input_ids", "attention_mask", "response_mask", "sampler_logp", "advantages"):
            assert torch.equal(getattr(got, name), getattr(want, name))


def _lengths_batch(lengths: list[int]):
    """Rows of ``lengths`` tokens (prompt of 1, the rest response)."""
    prompts = [[5] for _ in lengths]
    responses = [[7] * (n - 1) for n in lengths]
    lps = [[-0.5] * (n - 1) for n in lengths]
    return build_batch(prompts, responses, lps, [0.0] * len(lengths), torch.zeros(len(lengths)))


def test_longest_first_orders_rows_by_length_keeping_ties_in_order():
    b = _lengths_batch([3, 9, 3, 9, 5, 2])
    assert b.longest_first(torch.arange(6)).tolist() == [1, 3, 4, 0, 2, 5]
    assert b.longest_first(torch.tensor([5, 2, 0])).tolist() == [2, 0, 5]


def test_packing_hand_computed_and_longest_first_pads_less():
    # budget 20: in row order [2, 10] [2, 10] (two micro-batches of 2 x 10 = 20 padded, 12 real each);
    # longest first [10, 10] (20 padded, 20 real) and [2, 2] (4 padded, 4 real)
    b = _lengths_batch([2, 10, 2, 10])
    as_is = Packing.of(micro_batches(b, 20), 20)
    assert as_is == Packing(2, 40, 24, 10, 20) and as_is.fill == 1.0 and as_is.padding == pytest.approx(0.4)
    ordered = b.select(b.longest_first(torch.arange(4)))
    packed = Packing.of(micro_batches(ordered, 20), 20)
    assert packed == Packing(2, 24, 24, 10, 20)
    assert packed.metrics() == {"perf/micro_batches": 2.0, "perf/micro_batch_fill": 0.6, "perf/padding_frac": 0.0}
    # two optimizer steps: micro-batches per step, fill and padding over all of them
    both = as_is.merged(packed)
    assert both == Packing(4, 64, 48, 10, 20, 2)
    assert both.metrics() == {"perf/micro_batches": 2.0, "perf/micro_batch_fill": 0.8, "perf/padding_frac": 0.25}


def test_packing_advice_only_when_one_row_fills_little_of_the_budget():
    # rows of 4150 tokens under a budget of 8192: one per micro-batch, 51% full
    msg = Packing(4, 4 * 4150, 4 * 4150, 4150, 8192).advice()
    assert "one row of up to 4150 tokens" in msg and "51%" in msg and "--trainer.token_budget=8448" in msg
    assert Packing(2, 2 * 8300, 2 * 8300, 4150, 8448).advice() is None  # two fit: no advice
    assert Packing(2, 2 * 7400, 2 * 7400, 5000, 8192).advice() is None  # well filled
    assert Packing(0, 0, 0, 0, 8192).advice() is None


def test_update_packs_rows_longest_first():
    """The update's micro-batches hold rows longest first (its packing says so), and its
    log-probs still land on each row's own place."""
    model = build_random_model("tiny", seed=3, dtype=torch.float64, std=0.1)
    b = _lengths_batch([2, 10, 2, 10])
    b.advantages = torch.tensor([0.5, -0.5, 1.0, 0.2])
    learner = Learner(copy.deepcopy(model), lr=0.0)
    learner.update(b, UpdateSettings(loss_type="ppo", token_budget=20))
    assert learner.last_packing == Packing(2, 24, 24, 10, 20)
    want = Learner(copy.deepcopy(model)).logprobs(b, 1 << 20)
    torch.testing.assert_close(learner.last_logp, want, rtol=1e-9, atol=1e-12)
    # two mini-batches (rows 0-1, then 2-3): one micro-batch of [10, 2] each, 20 padded, 12 real
    b.old_logp = want
    learner.update(b, UpdateSettings(loss_type="ppo", token_budget=20, mini_batches=2))
    assert learner.last_packing == Packing(2, 40, 24, 10, 20, 2)
    assert learner.last_packing.metrics()["perf/micro_batches"] == 1.0


@pytest.mark.parametrize("loss_type,agg", [("ppo", "token-mean"), ("ppo", "seq-mean-token-mean"), ("tbpo", None),
                                           ("gspo", None), ("sapo", "seq-mean-token-sum-norm")])
def test_gradient_accumulation_matches_single_batch(loss_type, agg):
    model = build_random_model("tiny", seed=3, dtype=torch.float64, std=0.1)
    batch = _batch()
    with torch.no_grad():
        old = Learner(copy.deepcopy(model)).logprobs(batch, 1 << 20)
    batch.old_logp = old + 0.01 * torch.randn_like(old) * batch.response_mask  # off-policy a little
    hp = {} if agg is None else {"agg": agg}
    grads = []
    for budget in (1 << 20, 12):
        learner = Learner(copy.deepcopy(model), lr=0.0)
        s = UpdateSettings(loss_type=loss_type, loss_hparams=hp, token_budget=budget, grad_clip=1e9)
        learner.optimizer.zero_grad()
        # run the accumulation without stepping: lr=0 leaves weights unchanged but grads are computed
        learner.optimizer.zero_grad = lambda set_to_none=True: None  # keep grads for inspection
        learner.update(batch, s)
        grads.append(torch.cat([p.grad.flatten() for p in learner.model.parameters() if p.grad is not None]))
    assert len(split_by_token_budget(batch, 12)) > 2
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-12)
    assert grads[0].abs().max() > 0


@pytest.mark.parametrize("loss_type,agg,spec", [
    ("ppo", "token-mean", CorrectionSpec("token", 0.0, 2.0, reject="token", reject_low=0.8, reject_high=1.25)),
    ("ppo", "seq-mean-token-mean", CorrectionSpec("token", 0.0, 2.0, reject="geometric", reject_low=0.9,
                                                  reject_high=1.1, veto=0.5)),
    ("tbpo", None, CorrectionSpec("geometric", 0.5, 2.0, reject="sequence", reject_low=0.7, reject_high=1.4)),
])
def test_removed_tokens_leave_the_denominators_of_a_micro_batched_update(loss_type, agg, spec):
    """The trainer's path (the correction's removals taken out of the mask before the update,
    many micro-batches) gives the gradient of the loss that removes them itself in one batch."""
    model = build_random_model("tiny", seed=3, dtype=torch.float64, std=0.1)
    batch = _batch()
    with torch.no_grad():
        batch.old_logp = Learner(copy.deepcopy(model)).logprobs(batch, 1 << 20)
    g = torch.Generator().manual_seed(1)
    batch.sampler_logp = batch.old_logp - 0.3 * torch.randn(batch.old_logp.shape, generator=g)
    keep = mismatch_correction(spec, batch.old_logp, batch.sampler_logp, batch.response_mask).keep
    emptied = (batch.response_mask.sum(-1) > 0) & ~keep.any(-1)
    assert 0 < keep.sum() < batch.response_mask.sum() and emptied.any() and keep.any(-1).sum() > 1
    hp = {} if agg is None else {"agg": agg}
    grads = []
    for mask, correction, budget in ((batch.response_mask, spec, 1 << 20),
                                     (batch.response_mask * keep, spec.without_rejection(), 12)):
        learner = Learner(copy.deepcopy(model), lr=0.0)
        learner.optimizer.zero_grad = lambda set_to_none=True: None  # keep grads for inspection
        b = copy.deepcopy(batch)
        b.response_mask = mask
        learner.update(b, UpdateSettings(loss_type=loss_type, loss_hparams={**hp, "correction": correction},
                                         token_budget=budget, grad_clip=1e9))
        grads.append(torch.cat([p.grad.flatten() for p in learner.model.parameters() if p.grad is not None]))
    assert len(split_by_token_budget(batch, 12)) > 2
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-12)
    assert grads[0].abs().max() > 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_positive_only_on_the_pre_removed_mask_matches_one_batch(agg):
    """positive_only's A < 0 responses taken out of the mask before a micro-batched update (the
    trainer's path) give the gradient of one batch whose loss drops them itself."""
    from quarl.algos.losses import positive_advantage_mask

    model = build_random_model("tiny", seed=3, dtype=torch.float64, std=0.1)
    batch = _batch()
    with torch.no_grad():
        batch.old_logp = Learner(copy.deepcopy(model)).logprobs(batch, 1 << 20)
    batch.advantages = torch.tensor([1.0, -0.5, 0.25, -2.0, 0.0, 0.7])[: batch.advantages.shape[0]].to(batch.advantages)
    kept = positive_advantage_mask(batch.advantages, batch.response_mask)
    assert 0 < kept.sum() < batch.response_mask.sum()
    grads = []
    for mask, budget in ((batch.response_mask, 1 << 20), (kept, 12)):
        learner = Learner(copy.deepcopy(model), lr=0.0)
        learner.optimizer.zero_grad = lambda set_to_none=True: None  # keep grads for inspection
        b = copy.deepcopy(batch)
        b.response_mask = mask
        learner.update(b, UpdateSettings(loss_type="positive_only", loss_hparams={"agg": agg},
                                         token_budget=budget, grad_clip=1e9))
        grads.append(torch.cat([p.grad.flatten() for p in learner.model.parameters() if p.grad is not None]))
    assert len(split_by_token_budget(batch, 12)) > 2
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-12)
    assert grads[0].abs().max() > 0


def test_positive_advantage_mask_by_hand():
    from quarl.algos.losses import positive_advantage_mask

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert torch.equal(positive_advantage_mask(torch.tensor([0.5, -1.0, 0.0]), mask),
                       torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))
    token_adv = torch.tensor([[1.0, -1.0, 5.0], [2.0, -3.0, 0.0], [-0.1, 0.0, 0.1]])
    assert torch.equal(positive_advantage_mask(token_adv, mask),
                       torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 1.0]]))


def test_nonfinite_loss_skips_update():
    model = build_random_model("tiny", seed=3, dtype=torch.float32, std=0.1)
    learner = Learner(model, lr=1e-2)
    batch = _batch()
    batch.advantages[0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    out = learner.update(batch, UpdateSettings(loss_type="ppo"))
    assert out["train/skipped_updates"] == 1.0
    for b, p in zip(before, model.parameters()):
        assert torch.equal(b, p)


def test_bf16_model_steps_through_fp32_masters():
    """lr far below a bf16 ulp: the masters accumulate the updates and the model is their rounding."""
    model = build_random_model("tiny", seed=3, dtype=torch.bfloat16, std=0.1)
    learner = Learner(model, lr=1e-6)
    assert learner.master is not None
    start = {n: m.clone() for n, m in learner.master.named_masters()}
    batch = _batch()
    for _ in range(3):
        learner.update(batch, UpdateSettings(loss_type="ppo"))
    moved = [n for n, m in learner.master.named_masters() if not torch.equal(m, start[n])]
    assert moved
    for (n, p), (_, m) in zip(model.named_parameters(), learner.master.named_masters()):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        assert torch.equal(p, m.to(torch.bfloat16)), n
    # tiny steps: most bf16 weights did not move, yet the fp32 masters did
    w = "layers.0.mlp.up_proj.weight"
    master = dict(learner.master.named_masters())[w]
    assert (master != start[w]).float().mean() > 0.5
    assert (dict(model.named_parameters())[w].float() != start[w].to(torch.bfloat16).float()).float().mean() < 0.5
    # round trip through a checkpoint
    sd = learner.state_dict()
    other = Learner(build_random_model("tiny", seed=4, dtype=torch.bfloat16, std=0.1), lr=1e-6)
    other.load_state_dict(sd)
    for (n, m1), (_, m2) in zip(learner.master.named_masters(), other.master.named_masters()):
        assert torch.equal(m1, m2), n


def test_single_step_update_reuses_its_forward_as_old_logp():
    model = build_random_model("tiny", seed=5, dtype=torch.float64, std=0.1)
    batch = _batch(1)
    a, b = Learner(copy.deepcopy(model), lr=0.0), Learner(copy.deepcopy(model), lr=0.0)
    for learner in (a, b):  # keep the gradients for inspection
        learner.optimizer.zero_grad = lambda set_to_none=True: None
    s = UpdateSettings(loss_type="tbpo", token_budget=20, grad_clip=1e9)
    separate = a.logprobs(batch, 1 << 20)
    batch_a = copy.deepcopy(batch)
    batch_a.old_logp = separate
    ma = a.update(batch_a, s)
    mb = b.update(copy.deepcopy(batch), s)  # no old_logp: the update's forward is the proximal policy
    torch.testing.assert_close(b.last_logp, separate, rtol=1e-12, atol=1e-12)
    # old log-probs are stored in float32, so the separate path sees ratios of 1 +- 1e-7
    assert ma["loss/policy"] == pytest.approx(mb["loss/policy"], rel=1e-5)
    ga = torch.cat([p.grad.flatten() for p in a.model.parameters()])
    gb = torch.cat([p.grad.flatten() for p in b.model.parameters()])
    torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6 * float(gb.abs().max()))
    assert gb.abs().max() > 0
    with pytest.raises(ValueError, match="old_logp is required"):
        b.update(copy.deepcopy(batch), UpdateSettings(loss_type="ppo", ppo_epochs=2))
