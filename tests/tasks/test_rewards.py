from __future__ import annotations

import sys
import re
import time

import pytest

from quarl.tasks import Example, RewardError, RewardPool, math_reward, resolve_reward
from quarl.tasks.rewards import MATH_REWARD, RewardFailed, last_boxed
from tests.tasks import reward_fns

EXACT = "tests.tasks.reward_fns:exact"


@pytest.mark.parametrize(
    "completion, answer, reward",
    [
        ("so the answer is \\boxed{1/2}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{1}{2}}", "1/2", 1.0),
        ("$\\boxed{x^2+2x+1}$", "(x+1)^2", 1.0),
        ("\\boxed{2} no wait \\boxed{5}", "5", 1.0),  # the last box is the answer
        ("\\boxed{5} no wait \\boxed{2}", "5", 0.0),
        ("\\boxed{3}", "4", 0.0),
        ("the answer is 0.5", "0.5", 0.0),  # no box, no reward
        ("\\boxed{\\frac{1}{2}", "0.5", 0.0),  # unclosed box
        ("\\boxed{42}", "\\boxed{42}", 1.0),  # a boxed gold answer works too
    ],
)
def test_math_reward(completion, answer, reward):
    assert math_reward(completion, answer, {}) == reward


def test_last_boxed():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\boxed{\\frac{1}{2}}"
    assert last_boxed("none") is None


def test_missing_math_verify_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(RewardError, match="pip install math-verify"):
        resolve_reward(MATH_REWARD)
    with pytest.raises(RewardError, match="pip install math-verify"):
        math_reward("\\boxed{1}", "1", {})


def test_resolve_reward_errors():
    assert resolve_reward(EXACT) is reward_fns.exact
    with pytest.raises(ValueError, match="module:function"):
        resolve_reward("no_colon")
    with pytest.raises(RewardError, match="cannot import module 'no_such_module_xyz'") as e:
        resolve_reward("no_such_module_xyz:f")
    assert "No module named 'no_such_module_xyz'" in str(e.value)
    assert "run from the directory that holds no_such_module_xyz.py or set PYTHONPATH" in str(e.value)
    assert isinstance(e.value, ValueError)  # the CLI turns ValueErrors into one line, exit 2
    with pytest.raises(RewardError, match="has no function 'exactt'.*its functions: exact"):
        resolve_reward("tests.tasks.reward_fns:exactt")
    with pytest.raises(RewardError, match="not a function"):
        resolve_reward("tests.tasks.reward_fns:NOT_A_FUNCTION")


def examples(answers: str) -> list[Example]:
    return [Example(prompt="p", answer=a) for a in answers]


def test_inline_pool_scores_and_counts_errors():
    with RewardPool(lambda c, a, m: float(c == a), workers=0) as pool:
        assert pool.score(["a", "x", "c"], examples("abc")) == (
            [1.0, 0.0, 1.0], {"reward/timeouts": 0.0, "reward/errors": 0.0}
        )
    with RewardPool(EXACT, workers=0) as pool:
        rewards, metrics = pool.score(["a", "raise", "none"], examples("abc"))
        assert rewards == [1.0, 0.0, 0.0] and metrics["reward/errors"] == 2.0
        with pytest.raises(ValueError, match="2 completions for 3 examples"):
            pool.score(["a", "b"], examples("abc"))


def test_worker_pool_needs_an_importable_function():
    with pytest.raises(ValueError, match="module:function"):
        RewardPool(lambda c, a, m: 0.0, workers=1)
    with RewardPool(reward_fns.exact, workers=1, timeout_s=5.0) as pool:
        assert pool.spec == EXACT
        assert pool.score(["a"], examples("a"))[0] == [1.0]


def test_hung_crashing_and_raising_verifiers_never_stall_the_batch():
    completions = ["a", "hang", "c", "raise", "e", "die", "none", "x", "i"]
    start = time.monotonic()
    with RewardPool(EXACT, workers=2, timeout_s=1.0) as pool:
        rewards, metrics = pool.score(completions, examples("abcdefghi"))
        elapsed = time.monotonic() - start
        assert rewards == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
        assert metrics == {"reward/timeouts": 1.0, "reward/errors": 3.0}  # raise, die, none
        # The pool recovered: replaced workers score the next batch.
        assert pool.score(list("abcd"), examples("abcd")) == (
            [1.0] * 4, {"reward/timeouts": 0.0, "reward/errors": 0.0}
        )
    assert elapsed < 8.0


def test_math_reward_runs_in_a_worker_process():
    with RewardPool(MATH_REWARD, workers=1, timeout_s=20.0) as pool:
        rewards, metrics = pool.score(["\\boxed{1/2}", "\\boxed{3}"], [Example("p", "0.5"), Example("p", "4")])
    assert rewards == [1.0, 0.0] and metrics["reward/errors"] == 0.0


def test_pool_arguments():
    with pytest.raises(ValueError, match="workers"):
        RewardPool(EXACT, workers=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool(EXACT, workers=0, timeout_s=0)


def test_workers_import_a_module_from_the_working_directory(tmp_path, monkeypatch):
    """After a chdir, the parent imports from the new working directory, and so must its workers."""
    (tmp_path / "my_cwd_rewards.py").write_text(
        "import os\n\ndef score(c, a, m):\n    return float(c == a) + (10.0 if os.getpid() != m['parent'] else 0.0)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    import os

    exs = [Example("p", "a", meta={"parent": os.getpid()}), Example("p", "b", meta={"parent": os.getpid()})]
    with RewardPool("my_cwd_rewards:score", workers=1, timeout_s=20.0) as pool:
        rewards, metrics = pool.score(["a", "x"], exs)
    assert rewards == [11.0, 10.0] and metrics["reward/errors"] == 0.0  # scored in the worker, not inline
    sys.modules.pop("my_cwd_rewards", None)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_reward_failing_on_every_item_stops(workers):
    with RewardPool(EXACT, workers=workers, timeout_s=5.0) as pool:
        with pytest.raises(RewardFailed, match=r"reward tests.tasks.reward_fns:exact failed on all 3 items.*"
                                               r"first error: RuntimeError: verifier bug"):
            pool.score(["raise", "raise", "none"], examples("abc"))
        # a few errors are only counted
        assert pool.score(["raise", "b", "none"], examples("abc"))[1]["reward/errors"] == 2.0


def test_a_timeout_among_scored_items_is_only_counted_but_no_item_scored_stops():
    with RewardPool(EXACT, workers=2, timeout_s=0.5) as pool:
        rewards, metrics = pool.score(["hang", "raise", "c"], examples("abc"))
        assert rewards == [0.0, 0.0, 1.0] and metrics == {"reward/timeouts": 1.0, "reward/errors": 1.0}
        with pytest.raises(RewardFailed, match=r"failed on 1 and timed out on 1 of the 2 items.*verifier bug.*"
                                               r"raise data.reward_timeout_s \(now 0.5\)"):
            pool.score(["hang", "raise"], examples("ab"))
    with RewardPool(EXACT, workers=1, timeout_s=0.5) as pool:  # one slow first item is not a hung verifier
        assert pool.score(["hang", "b", "c"], examples("abc")) == ([0.0, 1.0, 1.0], {"reward/timeouts": 1.0,
                                                                                   "reward/errors": 0.0})


def test_a_verifier_that_hangs_on_everything_stops_after_about_two_timeouts():
    """Per-item timeouts alone would take 20 items x 1 s / 2 workers = 10 s."""
    start = time.monotonic()  # (the workers' start counts too)
    with RewardPool(EXACT, workers=2, timeout_s=1.0) as pool:
        with pytest.raises(RewardFailed) as e:
            pool.score(["hang"] * 20, examples("a" * 20))
        elapsed = time.monotonic() - start
    # each worker hangs twice before the batch stops: 4 items tried, or 5 when one worker's replacement takes
    # an item while the other's first item is still running (the timeouts need not fall in one wake-up)
    untried = re.search(r"timed out on all 20 items of the batch \(> 1 s each; the last (\d+) were not tried",
                        str(e.value))
    assert untried and 15 <= int(untried.group(1)) <= 16, str(e.value)
    assert "reward tests.tasks.reward_fns:exact" in str(e.value) and "data.reward_timeout_s (now 1)" in str(e.value)
    assert elapsed < 6.0, elapsed


def test_a_stop_cuts_a_hung_batch_short_and_the_pool_recovers():
    from quarl.tasks.rewards import STOP_GRACE_S, ScoringInterrupted

    with RewardPool(EXACT, workers=2, timeout_s=30.0) as pool:
        asked = []
        start = time.monotonic()
        with pytest.raises(ScoringInterrupted):
            pool.score(["a", "hang", "hang", "d"], examples("abcd"), stop=lambda: len(asked) > 3 or asked.append(1))
        assert time.monotonic() - start < STOP_GRACE_S + 3.0  # not the 30 s timeout
        assert pool.score(["a", "b"], examples("ab")) == ([1.0, 1.0], {"reward/timeouts": 0.0, "reward/errors": 0.0})
