"""The cyclic arithmetic task: long worked solutions from short prompts, verified like arith."""

from __future__ import annotations

import re
import statistics
from types import SimpleNamespace

import pytest
import torch

from quarl.algos.errors import loop_starts
from quarl.tasks import CycleTask, build_task
from quarl.tasks.cycles import MAX_DRIFT, OPS_PER_CYCLE, cycle_prompt, cycle_solution, min_rounds
from quarl.tasks.synthetic import arith_reward
from quarl.tasks.tokenizer import CharTokenizer

PROMPT = re.compile(r"(-?\d+)\(((?:[+-]\d+)+)\)x(\d+)=")
STEP = re.compile(r"(-?\d+)([+-])(\d+)=(-?\d+);")


def _parse_prompt(prompt: str) -> tuple[int, list[int], int]:
    m = PROMPT.fullmatch(prompt)
    assert m, prompt
    return int(m[1]), [int(x) for x in re.findall(r"[+-]\d+", m[2])], int(m[3])


def _check_solution(prompt: str, solution: str) -> int:
    """Re-derive the chain from the prompt alone, step by step; returns the final value."""
    start, ops, rounds = _parse_prompt(prompt)
    body, answer = solution.rsplit("#", 1)
    parts = re.split(r"(\d+):", body)
    assert parts[0] == "" and [int(x) for x in parts[1::2]] == list(range(1, rounds + 1))
    value = start
    for text in parts[2::2]:
        steps = STEP.findall(text)
        assert "".join(f"{a}{o}{b}={c};" for a, o, b, c in steps) == text  # nothing else in a round
        assert len(steps) == len(ops)
        for (a, o, b, c), op in zip(steps, ops):
            assert int(a) == value and int(f"{o}{b}") == op and int(c) == value + op
            value = int(c)
    assert int(answer) == value
    return value


def test_a_small_cycle_by_hand():
    solution, value = cycle_solution(13, [7, -4, 15, -9], 2)
    assert solution == "1:13+7=20;20-4=16;16+15=31;31-9=22;2:22+7=29;29-4=25;25+15=40;40-9=31;#31"
    assert value == 31 and cycle_prompt(13, [7, -4, 15, -9], 2) == "13(+7-4+15-9)x2="
    assert arith_reward(solution, "31") == 1.0 and arith_reward(solution, "30") == 0.0
    # a negative value and a negative operand on it
    assert cycle_solution(2, [-5, 1, 1, 1], 1) == ("1:2-5=-3;-3+1=-2;-2+1=-1;-1+1=0;#0", 0)


@pytest.mark.parametrize("difficulty", [3, 12, 36])
def test_every_example_is_a_correct_chain_with_a_drifting_cycle(difficulty):
    task = CycleTask(difficulty=difficulty, num_train=300, num_eval=64, seed=1)
    train, evals = task.train_examples(), task.eval_examples()
    assert len(train) == 300 and len(evals) == 64 and len({e.prompt for e in evals}) == 64
    assert not {e.prompt for e in train} & {e.prompt for e in evals}
    rounds_seen = set()
    for ex in train + evals:
        start, ops, rounds = _parse_prompt(ex.prompt)
        assert len(ops) == OPS_PER_CYCLE and all(1 <= abs(op) <= 19 for op in ops) and 0 <= start <= 19
        assert 1 <= abs(sum(ops)) <= MAX_DRIFT  # the value moves every round: no round repeats another
        assert min_rounds(difficulty) <= rounds <= difficulty
        rounds_seen.add(rounds)
        assert _check_solution(ex.prompt, ex.solution) == int(ex.answer)
        assert ex.meta == {"start": start, "ops": ops, "rounds": rounds}
        assert task.reward(ex.solution, ex) == 1.0
        assert task.reward(ex.solution.rsplit("#", 1)[0] + f"#{int(ex.answer) + 1}", ex) == 0.0
        assert task.reward(ex.solution.rsplit("#", 1)[0], ex) == 0.0  # no answer
    assert rounds_seen == set(range(min_rounds(difficulty), difficulty + 1))


def test_min_rounds_is_two_thirds_rounded_up():
    assert [min_rounds(d) for d in (1, 2, 3, 4, 36, 37)] == [1, 2, 2, 3, 24, 25]


def test_same_seed_same_examples_other_seed_other_examples():
    a = CycleTask(difficulty=5, num_train=100, num_eval=10, seed=3)
    b = CycleTask(difficulty=5, num_train=100, num_eval=10, seed=3)
    c = CycleTask(difficulty=5, num_train=100, num_eval=10, seed=4)
    assert a.train_examples() == b.train_examples() and a.eval_examples() == b.eval_examples()
    assert a.train_examples() != c.train_examples()
    assert CycleTask(difficulty=5, num_train=30, num_eval=10, seed=3).eval_examples() == a.eval_examples()


def test_difficulty_36_solutions_run_1_to_2k_tokens_from_short_prompts():
    """The long-response suite's setting (experiments/long/base.yaml): worked solutions of
    ~1-2k built-in tokens, within the 2048 sampled, from prompts of at most ~20."""
    tok = CharTokenizer()
    task = CycleTask(difficulty=36, num_train=2000, num_eval=256, seed=0)
    lengths = sorted(len(tok.encode(e.solution)) + 1 for e in task.train_examples() + task.eval_examples())  # + eos
    assert 700 <= lengths[0] and lengths[-1] <= 2000 < 2048
    assert 1150 <= statistics.mean(lengths) <= 1400
    assert 900 <= lengths[len(lengths) // 20] and lengths[-len(lengths) // 20] <= 1700  # 90% within ~0.9-1.7k
    assert max(len(e.prompt) for e in task.train_examples()) <= 22


def test_no_correct_solution_ends_in_a_loop():
    """A correct chain never ends in a periodic tail: the error-token detector flags a
    response that loops, not the task's own text (the values drift, so rounds differ)."""
    tok = CharTokenizer()
    task = CycleTask(difficulty=36, num_train=0, num_eval=128, seed=0)
    rows = [tok.encode(e.solution) + [tok.eos_token_id] for e in task.eval_examples()]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    assert (loop_starts(ids, mask) == width).all()
    # a response that repeats its last round until the cut is flagged where the repetition starts
    sol = task.eval_examples()[0].solution
    last = sol[sol.rindex(";", 0, sol.rindex(";")) + 1: sol.rindex(";") + 1]  # its last step
    looping = tok.encode(sol.rsplit("#", 1)[0] + last * 10)
    start = loop_starts(torch.tensor([looping]), torch.ones(1, len(looping)))
    assert int(start) <= len(tok.encode(sol.rsplit("#", 1)[0])) < len(looping)


def test_build_task_makes_it_by_name():
    cfg = SimpleNamespace(task="cycle", difficulty=4, num_train=20, num_eval=5, seed=2, system_prompt=None,
                          reward="builtin")
    task = build_task(cfg)
    assert isinstance(task, CycleTask) and task.name == "cycle"
    assert task.eval_examples() == CycleTask(difficulty=4, num_train=20, num_eval=5, seed=2).eval_examples()
    assert task.reward_spec == "quarl.tasks.synthetic:arith_reward"
    with pytest.raises(ValueError, match="choose arith, countdown, cycle or file"):
        build_task(SimpleNamespace(**{**vars(cfg), "task": "cycles"}))
