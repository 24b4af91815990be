from __future__ import annotations

import random

import pytest

from quarl.config import DataConfig
from quarl.tasks import ArithmeticTask, CountdownTask, build_task, get_task
from quarl.tasks.synthetic import arith_reward, countdown_reward, parse_expression

TASKS = [ArithmeticTask, CountdownTask]


@pytest.mark.parametrize("cls", TASKS)
def test_same_seed_same_examples_other_seed_other_examples(cls):
    a = cls(difficulty=2, num_train=200, num_eval=20, seed=3)
    b = cls(difficulty=2, num_train=200, num_eval=20, seed=3)
    c = cls(difficulty=2, num_train=200, num_eval=20, seed=4)
    assert a.train_examples() == b.train_examples() and a.eval_examples() == b.eval_examples()
    assert a.train_examples() != c.train_examples()
    # The eval set does not depend on how many training examples are drawn.
    assert cls(difficulty=2, num_train=50, num_eval=20, seed=3).eval_examples() == a.eval_examples()


@pytest.mark.parametrize("cls", TASKS)
@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_train_and_eval_are_disjoint_and_solutions_earn_full_reward(cls, difficulty):
    task = cls(difficulty=difficulty, num_train=1000, num_eval=64, seed=0)
    train, evals = task.train_examples(), task.eval_examples()
    assert len(train) == 1000 and len(evals) == 64
    assert len({e.prompt for e in evals}) == 64
    assert not {e.prompt for e in train} & {e.prompt for e in evals}
    for ex in train + evals:
        assert task.reward(ex.solution, ex) == 1.0, ex
        if difficulty <= 2:
            assert len(ex.prompt) < 40 and len(ex.solution) < 40


def test_arith_difficulty_one_repeats_train_problems_but_never_eval_ones():
    # 20 * 20 * 2 = 800 distinct problems, fewer than the default 2000 training examples.
    task = ArithmeticTask(difficulty=1, num_train=2000, num_eval=64, seed=0)
    train_prompts = {e.prompt for e in task.train_examples()}
    assert len(task.train_examples()) == 2000
    assert len(train_prompts) == 800 - 64
    assert not train_prompts & {e.prompt for e in task.eval_examples()}


def test_arith_format():
    ex = ArithmeticTask(difficulty=2, num_train=1, num_eval=1, seed=0).train_examples()[0]
    a, op1, b, op2, c = _split(ex.prompt[:-1])
    first = a + b if op1 == "+" else a - b
    final = first + c if op2 == "+" else first - c
    assert ex.prompt.endswith("=") and ex.answer == str(final)
    assert ex.solution == f"{a}{op1}{b}={first};{first}{op2}{c}={final};#{final}"


def _split(expr: str) -> list:
    out, num = [], ""
    for ch in expr:
        if ch in "+-" and num:
            out += [int(num), ch]
            num = ""
        else:
            num += ch
    return out + [int(num)]


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("7+12=19;19-3=16;#16", 1.0),
        ("#16", 1.0),
        ("# 16 ", 1.0),
        ("#15", 0.0),
        ("16", 0.0),  # no '#'
        ("#16x", 0.0),  # garbage after the number
        ("#16 17", 0.0),
        ("#-16", 0.0),
        ("#1#16", 1.0),  # the last '#' counts
        ("#16#", 0.0),
        ("#" + "9" * 5000, 0.0),
    ],
)
def test_arith_reward(completion, reward):
    assert arith_reward(completion, "16", {}) == reward


def test_arith_reward_negative_answer():
    assert arith_reward("3-15=-12;#-12", "-12", {}) == 1.0


def test_corrupted_solutions_get_no_reward():
    rng = random.Random(0)
    for cls in TASKS:
        task = cls(difficulty=2, num_train=200, num_eval=0, seed=1)
        for ex in task.train_examples():
            body, target = ex.solution.rsplit("#", 1)
            wrong = f"{body}#{int(target) + rng.randint(1, 9)}"
            assert task.reward(wrong, ex) < 1.0
            assert task.reward(ex.solution + "!", ex) == 0.0
            assert task.reward(body, ex) == 0.0


COUNTDOWN_META = {"numbers": [3, 4, 5], "target": 17}


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("3*4+5#17", 1.0),
        (" (5+3*4) # 17 ", 1.0),
        ("4*5-3#17", 1.0),
        ("3*4+5#16", 0.1),  # claimed result is not the target
        ("3*4+4#16", 0.1),  # 4 used twice, well formed
        ("3*4+5+0#17", 0.1),  # 0 is not a given number
        ("3*5#15", 0.1),  # a subset is allowed, but 15 != 17
        ("5/(4-4)#17", 0.1),  # division by zero
        ("3*4+5", 0.0),  # no '#'
        ("3*4+5=17#17", 0.0),  # illegal '='
        ("3**4#17", 0.0),  # malformed
        ("-3+20#17", 0.0),  # no unary minus
        ("(3*4+5#17", 0.0),  # unclosed parenthesis
        ("__import__('os')#17", 0.0),
        ("3*4+5#17 yes", 0.0),
        ("3.0*4+5#17", 0.0),
    ],
)
def test_countdown_reward(completion, reward):
    assert countdown_reward(completion, "17", COUNTDOWN_META) == reward


def test_countdown_uses_exact_fractions():
    meta = {"numbers": [1, 3, 4, 6], "target": 24}
    assert countdown_reward("6/(1-3/4)#24", "24", meta) == 1.0  # 3/4 is not truncated


def test_parse_expression():
    assert parse_expression("(1+2)*3 - 4/2") == (7, [1, 2, 3, 4, 2])
    assert parse_expression("1/0")[0] is None
    for bad in ["", "1+", "()", "1 2", "2^3", "abs(1)", "1e3", "(" * 150 + "1" + ")" * 150]:
        assert parse_expression(bad) is None, bad


def test_build_task_and_get_task():
    task = build_task(DataConfig(task="countdown", difficulty=1, num_train=10, num_eval=5, seed=2))
    assert isinstance(task, CountdownTask) and len(task.train_examples()) == 10
    assert task.reward_spec == "quarl.tasks.synthetic:countdown_reward"
    assert get_task("arith", num_train=5, num_eval=2).name == "arith"
    with pytest.raises(TypeError):
        get_task("arith", difficultyy=2)


def test_messages_and_system_prompt():
    task = ArithmeticTask(num_train=1, num_eval=0, system_prompt="Compute.")
    ex = task.train_examples()[0]
    assert task.messages(ex) == [
        {"role": "system", "content": "Compute."},
        {"role": "user", "content": ex.prompt},
    ]


def test_evaluate():
    task = ArithmeticTask(num_train=0, num_eval=4, seed=0)
    exs = task.eval_examples()
    completions = [exs[0].solution, exs[1].solution, "#x", ""]
    assert task.evaluate(completions, exs) == {"eval/acc": 0.5, "eval/reward_mean": 0.5}
    assert task.evaluate(completions, exs, rewards=[1.0, 0.1, 0.1, 0.0])["eval/acc"] == 0.25
