"""Error tokens in the trainer: the batch's alignment, flagged rows, ranks, and a tiny run's logs."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from quarl.algos import error_metrics, garbled_starts, loop_starts
from quarl.config import load_run_config
from quarl.learner.batch import build_batch
from quarl.trainer.error_tokens import flagged_rows, flagged_sample, loop_fields, response_columns
from quarl.trainer.loop import Trainer
from quarl.trainer.ranks import cat_of_all_ranks as _cat_of_all_ranks
from quarl.trainer.ranks import rows_of_all_ranks as _rows_of_all_ranks
from tests.trainer.test_train_e2e import TINY


class _SpaceTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" if i == 0 and not skip_special_tokens else "" if i == 0 else f"{i} " for i in ids)


def test_starts_on_the_batch_layout_are_response_token_indices():
    # prompt 5 tokens ending "... 4 4" (the response's loop token: must not count), response:
    # 6 varied tokens then "4" x 16 -> the loop starts at response token 6. The sampler's log-prob
    # of response token 2 is -7 and the learner's -10 (bad by 10 > 8 and 3 > 2): garbled at 2.
    prompt, response = [9, 8, 7, 4, 4], [1, 2, 3, 5, 6, 7] + [4] * 16
    sampler = [-0.5] * len(response)
    sampler[2] = -7.0
    batch = build_batch([prompt, [3, 3]], [response, [2] * 3], [sampler, [-0.1] * 3], [0.0, 0.0], torch.zeros(2))
    first = len(prompt) - 1  # column of the first response token in the [B, T-1] layout
    ids = batch.input_ids[:, 1:]
    assert ids[0, first + 6 : first + 22].tolist() == [4] * 16
    assert loop_starts(ids, batch.response_mask).tolist() == [first + 6, ids.shape[1]]
    learner = batch.sampler_logp.clone()
    learner[0, first + 2] = -10.0
    assert garbled_starts(learner, batch.sampler_logp, batch.response_mask, min_bad=1).tolist() == \
        [first + 2, ids.shape[1]]
    # the shifted layout would be off by one: input_ids itself puts the loop one column later
    assert loop_starts(batch.input_ids[:, :-1], batch.response_mask).tolist() != [first + 6, ids.shape[1]]


def test_response_columns_is_the_batch_response_mask():
    rng = random.Random(0)
    prompts = [[1] * rng.randint(1, 6) for _ in range(40)]
    responses = [[2] * rng.randint(0, 9) for _ in range(40)]
    batch = build_batch(prompts, responses, [[0.0] * len(r) for r in responses], [0.0] * 40, torch.zeros(40))
    got = response_columns(batch.attention_mask, [len(p) for p in prompts])
    assert torch.equal(got, batch.response_mask)


def test_flagged_rows_take_turns_and_skip_starts_outside_the_response():
    # responses [first, end): 0 [2, 12), 1 [0, 4), 2 [1, 7), 3 [3, 9), 4 [0, 5), width 16 = none
    first, end = [2, 0, 1, 3, 0], [12, 4, 7, 9, 5]
    loops = [7, 3, 16, 5, 2]
    garbled = [16, 2, 9, 5, 4]  # row 2's 9 is past its end (another rank's width): none
    # row 0 loop at 5; row 1 garbled (2 < 3) at 2; row 3 a tie at column 5 -> loop at 2; row 4 loop at 2
    assert flagged_rows(loops, garbled, first, end, limit=10) == \
        [(1, 2, "garbled"), (0, 5, "loop"), (3, 2, "loop"), (4, 2, "loop")]
    assert flagged_rows(loops, garbled, first, end, limit=2) == [(1, 2, "garbled"), (0, 5, "loop")]
    assert flagged_rows([16] * 5, [16] * 5, first, end, limit=4) == []


def test_flagged_sample_splits_at_the_bad_token():
    s = flagged_sample(_SpaceTokenizer(), [5, 6], [1, 2, 0, 3], "4", 0.5, pos=2, kind="garbled")
    assert s == {"prompt": "5 6 ", "completion": "1 2 3 ", "answer": "4", "reward": 0.5, "flagged": True,
                 "error_kind": "garbled", "error_pos": 2, "response_tokens": 4,
                 "error_text": ["1 2 ", "<0>", "3 "]}  # the bad token shows even when special


def test_loop_fields_of_evaluation_responses():
    looping = list(range(10, 20)) + [7] * 16
    assert loop_fields([looping, list(range(30)), []]) == [
        {"error_kind": "loop", "error_pos": 10}, {"error_kind": None, "error_pos": None},
        {"error_kind": None, "error_pos": None}]
    assert loop_fields([]) == []


class _TwoRanks:
    """rank 0 of 2: gather returns this rank's object and rank 1's given one."""

    world = 2

    def __init__(self, other):
        self.other = list(other)

    def gather(self, obj):
        return [obj, self.other.pop(0)]


def test_error_metrics_over_ranks_of_different_widths():
    # rank 0: width 10, one response [2, 10) looping from column 6 (rel 4/8) and one empty row;
    # rank 1: width 6, responses [1, 6) garbled at 3 (rel 2/5) and [0, 6) clean (its starts: 6 = its T).
    # Padded to width 10, rank 1's "6" falls in padding: none. 3 responses, 2 flagged:
    # response_frac 2/3, first_pos (0.5 + 0.4) / 2, token_frac_after (4 + 3) / (8 + 5 + 6)
    mask0 = torch.zeros(2, 10)
    mask0[0, 2:] = 1
    mask1 = torch.zeros(2, 6)
    mask1[0, 1:], mask1[1, :] = 1, 1
    dist = _TwoRanks([(mask1,), torch.tensor([6, 6]), torch.tensor([3, 6])])
    (mask,) = _rows_of_all_ranks(dist, mask0)
    loops = _cat_of_all_ranks(dist, torch.tensor([6, 10]))
    garbled = _cat_of_all_ranks(dist, torch.tensor([10, 10]))
    assert mask.shape == (4, 10) and loops.tolist() == [6, 10, 6, 6] and garbled.tolist() == [10, 10, 3, 6]
    m = {k: float(v) for k, v in error_metrics(loops, garbled, mask).items()}
    assert m["errors/response_frac"] == pytest.approx(2 / 3)
    assert m["errors/loop_frac"] == pytest.approx(1 / 3) and m["errors/garbled_frac"] == pytest.approx(1 / 3)
    assert m["errors/first_pos"] == pytest.approx(0.45)
    assert m["errors/token_frac_after"] == pytest.approx(7 / 19)


# every response token whose sampler log-prob beats the learner's is bad: a quantized rollout has many
PERMISSIVE = ["--algo.error_surprise=0", "--algo.error_gap=0", "--algo.error_min_bad=1"]


def _run(run_dir, *overrides):
    cfg = load_run_config(None, TINY + [f"--trainer.run_dir={run_dir}", "--trainer.steps=1",
                                        "--trainer.sft_warmup_steps=0", "--quant.mode=rollout",
                                        "--algo.loss=ppo", *overrides])
    Trainer(cfg).run()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    path = run_dir / "samples.jsonl"
    samples = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return rows[-1], samples


def test_a_run_logs_error_metrics_and_flagged_responses(tmp_path):
    last, samples = _run(tmp_path / "a", *PERMISSIVE, "--trainer.eval_every=1")
    assert last["errors/garbled_frac"] > 0.5 and last["errors/response_frac"] >= last["errors/garbled_frac"]
    assert 0 <= last["errors/first_pos"] < 1 and 0 < last["errors/token_frac_after"] <= 1
    flagged = [s for s in samples if s.get("flagged")]
    assert len(flagged) == 2 and all(s["step"] == 1 for s in flagged)
    for s in flagged:
        assert s["error_kind"] in ("loop", "garbled") and 0 <= s["error_pos"] < s["response_tokens"]
        assert len(s["error_text"]) == 3 and {"prompt", "completion", "answer", "reward"} <= set(s)
    evaluated = [s for s in samples if not s.get("flagged")]
    assert evaluated and all("error_kind" in s and "error_pos" in s for s in evaluated)
    # default thresholds: the same rollout's numbers rarely part by 8 nats; the keys are there all the same
    last, samples = _run(tmp_path / "b")
    assert {"errors/response_frac", "errors/loop_frac", "errors/garbled_frac", "errors/first_pos",
            "errors/token_frac_after"} <= set(last)


def test_overlong_filtered_responses_count_without_their_log_probs(tmp_path):
    # the filter drops the responses cut at the length limit (the learner computes no log-probs
    # for them, so none can be garbled); they still count among the responses
    last, _ = _run(tmp_path / "c", *PERMISSIVE, "--trainer.overlong_filter=true", "--trainer.log_samples=0")
    assert last["response/clip_frac"] > 0
    assert last["errors/garbled_frac"] <= 1 - last["response/clip_frac"] + 1e-9
    assert not (tmp_path / "c" / "samples.jsonl").exists()  # log_samples=0: no flagged rows either


def test_truncate_at_error_and_rejection_take_tokens_out_of_the_update(tmp_path):
    # permissive thresholds flag most responses early: truncation removes their tails
    last, _ = _run(tmp_path / "t", *PERMISSIVE, "--algo.truncate_at_error=true", "--trainer.log_samples=0")
    assert last["errors/truncated_frac"] > 0 and last["correction/drop_frac"] == 0
    assert last["errors/truncated_frac"] <= last["errors/token_frac_after"] + 1e-9
    # a narrow token band in rollout mode (w4a16 sampler, bf16 learner) removes some tokens, not all
    last, _ = _run(tmp_path / "r", "--algo.correction=tis", "--algo.reject=token", "--algo.reject_low=0.99",
                   "--algo.reject_high=1.01", "--algo.veto=0.01", "--trainer.log_samples=0")
    assert 0 < last["correction/drop_frac"] < 1 and 0 <= last["correction/row_drop_frac"] <= 1
    assert last["errors/truncated_frac"] == 0 and math.isfinite(last["loss/policy"])


def test_positive_only_takes_its_negative_responses_out_before_the_update(tmp_path):
    last, _ = _run(tmp_path / "p", "--algo.loss=positive_only", "--trainer.log_samples=0")
    # digit_one's rewards differ within the groups: some responses have A < 0, not all
    assert 0 < last["positive_only/drop_frac"] < 1
    assert math.isfinite(last["loss/policy"])


@pytest.mark.parametrize("overlong", [False, True])
def test_truncation_and_the_error_metrics_scan_the_responses_once(tmp_path, monkeypatch, overlong):
    """With algo.truncate_at_error the update's scan is reused for the errors/* metrics; with the
    overlong filter the metrics' rows differ (its dropped responses count), so they scan again."""
    import quarl.trainer.error_tokens as error_tokens

    calls = []
    real = error_tokens.garbled_starts
    monkeypatch.setattr(error_tokens, "garbled_starts", lambda *a, **k: calls.append(1) or real(*a, **k))
    last, _ = _run(tmp_path / "t", *PERMISSIVE, "--algo.truncate_at_error=true", "--trainer.log_samples=0",
                   f"--trainer.overlong_filter={str(overlong).lower()}")
    assert len(calls) == (2 if overlong else 1)
    assert last["errors/truncated_frac"] > 0 and last["errors/response_frac"] > 0
