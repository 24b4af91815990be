"""The warm start's schedule and its teacher-forced held-out check."""

import pytest
import torch

from quarl.model.presets import build_random_model
from quarl.trainer.warmstart import heldout_metrics, supervised_finetune, wsd_factor


def test_wsd_factor_by_hand():
    # 100 steps, warmup 10, decay over the last 20 to 0.1
    assert wsd_factor(0, 100) == pytest.approx(0.1)
    assert wsd_factor(4, 100) == pytest.approx(0.5)
    assert wsd_factor(9, 100) == 1.0 and wsd_factor(79, 100) == 1.0
    assert wsd_factor(80, 100) == pytest.approx(1.0)
    assert wsd_factor(90, 100) == pytest.approx(1 - 0.9 * 10 / 20)  # 0.55
    assert wsd_factor(99, 100) == pytest.approx(1 - 0.9 * 19 / 20)
    assert wsd_factor(150, 100) == pytest.approx(0.1)  # never below the floor


@torch.no_grad()
def _reference(model, pairs):
    """Per pair, one unpadded forward in float64: exact = every target token is the argmax."""
    from quarl.model.transformer import batch_attention

    exact, nll, n = 0, 0.0, 0
    for p, r in pairs:
        ids = torch.tensor([p + r])
        pos, attn = batch_attention(ids, torch.ones_like(ids))
        logits = (model.hidden_states(ids, pos, attn)[0, :-1] @ model.lm_head_weight.T).double()
        target = ids[0, 1:]
        span = slice(len(p) - 1, len(p) + len(r) - 1)
        exact += int((logits.argmax(-1)[span] == target[span]).all())
        nll -= float(torch.log_softmax(logits, -1)[span].gather(-1, target[span, None]).sum())
        n += len(r)
    return exact / len(pairs), nll / n


@torch.no_grad()
def test_heldout_metrics_match_one_forward_per_pair():
    torch.manual_seed(0)
    model = build_random_model("tiny", seed=1, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    pairs = [(torch.randint(0, 100, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist(),
              torch.randint(0, 100, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist())
             for _ in range(9)]
    # make some pairs' targets the model's own greedy continuation, so exact is neither 0 nor 1
    from quarl.model.transformer import batch_attention

    for i in range(0, 9, 2):
        p, r = pairs[i]
        seq = list(p)
        for _ in range(len(r)):
            ids = torch.tensor([seq])
            pos, attn = batch_attention(ids, torch.ones_like(ids))
            h = model.hidden_states(ids, pos, attn)[0, -1]
            seq.append(int((h @ model.lm_head_weight.T).argmax()))
        pairs[i] = (p, seq[len(p):])
    got = heldout_metrics(model, pairs, batch_size=4)  # padded batches of mixed lengths
    exact, loss = _reference(model, pairs)
    assert 0 < exact < 1
    assert got["exact"] == pytest.approx(exact)
    assert got["loss"] == pytest.approx(loss, rel=1e-4)
    # logits bounded to one row at a time (a large vocabulary): the same scores
    one_row = heldout_metrics(model, pairs, batch_size=4, max_logits=1)
    assert one_row["exact"] == got["exact"] and one_row["loss"] == pytest.approx(got["loss"], rel=1e-6)


def test_supervised_finetune_reports_heldout_every_k_steps():
    model = build_random_model("tiny", seed=0, dtype=torch.float32)
    pairs = [([1, 2, 3], [4, 5, 6, 7])] * 4
    seen = []
    losses = supervised_finetune(model, pairs, 25, 3e-3, batch_size=4, heldout=pairs, eval_every=10,
                                 on_eval=lambda step, m: seen.append((step, m)))
    assert len(losses) == 25
    assert [s for s, _ in seen] == [10, 20, 25]
    assert seen[-1][1]["loss"] < seen[0][1]["loss"]  # it learns the one pair it sees


@pytest.mark.parametrize("before", [False, True])
def test_supervised_finetune_steps_under_deterministic_algorithms(before):
    """Every step and held-out check runs with torch's deterministic algorithms on; the
    caller's setting (and its warn-only flag) is back afterwards, also after an error."""
    model = build_random_model("tiny", seed=0, dtype=torch.float32)
    pairs = [([1, 2, 3], [4, 5, 6, 7])] * 4
    torch.use_deterministic_algorithms(before, warn_only=before)
    try:
        inside = []
        supervised_finetune(model, pairs, 3, 1e-3, batch_size=2, heldout=pairs, eval_every=2,
                            on_step=lambda i, loss: inside.append(torch.are_deterministic_algorithms_enabled()),
                            on_eval=lambda i, m: inside.append(torch.is_deterministic_algorithms_warn_only_enabled()))
        assert inside == [True, True, False, True, False]  # strict: nothing falls back to a warning
        assert torch.are_deterministic_algorithms_enabled() is before
        assert torch.is_deterministic_algorithms_warn_only_enabled() is before

        def fail(i, loss):
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            supervised_finetune(model, pairs, 3, 1e-3, batch_size=2, on_step=fail)
        assert torch.are_deterministic_algorithms_enabled() is before
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_warm_start_on_the_cpu_repeats_bit_for_bit():
    def run():
        model = build_random_model("tiny", seed=0, dtype=torch.float32)
        pairs = [([1, 2, 3, 4], [5, 6, 7, 8, 9]), ([2, 3], [9, 8, 7])] * 3
        supervised_finetune(model, pairs, 6, 3e-3, batch_size=3, seed=1)
        return model.state_dict()

    a, b = run(), run()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_supervised_finetune_stops_at_the_target_exact_share():
    """With a target, the rate holds after the warmup and training ends at the first
    check whose exact share reaches it; the same check without a target runs every step."""
    torch.manual_seed(0)
    pairs = [([1, 2, 3], [4, 5, 6, 7]), ([7, 3], [9, 8])] * 2
    seen, rates = [], []
    model = build_random_model("tiny", seed=0, dtype=torch.float32)
    losses = supervised_finetune(model, pairs, 200, 3e-3, batch_size=4, heldout=pairs, eval_every=5,
                                 on_eval=lambda step, m: seen.append((step, m["exact"])), target_exact=1.0)
    assert seen[-1][1] == 1.0 and all(e < 1.0 for _, e in seen[:-1])  # it stopped at the first hit
    assert len(losses) == seen[-1][0] < 200
    assert heldout_metrics(model, pairs)["exact"] == 1.0

    # the schedule: full rate from step 10 on (no decay) when a target is set
    model = build_random_model("tiny", seed=0, dtype=torch.float32)
    orig = torch.optim.AdamW.step

    def spy(self, *a, **k):
        rates.append(self.param_groups[0]["lr"])
        return orig(self, *a, **k)

    torch.optim.AdamW.step = spy
    try:
        supervised_finetune(model, pairs, 30, 1e-3, batch_size=2, heldout=pairs, eval_every=100,
                            target_exact=1.0)  # (checks only after the last step)
    finally:
        torch.optim.AdamW.step = orig
    assert rates[:10] == pytest.approx([1e-3 * (i + 1) / 10 for i in range(10)])
    assert rates[10:] == pytest.approx([1e-3] * 20)


def test_a_target_exact_share_needs_heldout_pairs():
    model = build_random_model("tiny", seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="held-out pairs"):
        supervised_finetune(model, [([1], [2])], 5, 1e-3, target_exact=0.5)
