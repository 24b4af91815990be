"""A built-in task with long worked solutions: cyclic arithmetic chains.

The arithmetic task's solutions grow with its prompts (each operation is written in the
prompt once). Here a short prompt names a cycle of four operations and how many times to
run it, so that a ~20-character prompt asks for a worked solution of 1-2k characters (the
built-in tokenizer's tokens; at difficulty 36: 750-1870, mean ~1260, 90% within 930-1650):
a response long enough for sampling errors to compound and for loops or garbled stretches
(:mod:`quarl.algos.errors`) to show.

Prompt ``13(+7-4+15-9)x30=``: start at 13, apply ``+7 -4 +15 -9`` in turn, 30 rounds.
Worked solution ``1:13+7=20;20-4=16;16+15=31;31-9=22;2:22+7=29;...;30:...;#N``: each round
is numbered, each operation one step in the arithmetic task's format, then ``#`` and the
final value. The verifier is the arithmetic task's (the integer after the last ``#``).

A cycle's operations sum to a nonzero total of at most 9 in size, so the value drifts a
little each round and no two rounds write the same text: a correct solution never ends in
a periodic tail (the loop detector's criterion). The number of rounds is drawn from
``ceil(2 * difficulty / 3)`` to ``difficulty``, and the values' digits grow along a chain,
so response lengths spread over a factor of two (the mismatch metrics' length quartiles
separate).
"""

from __future__ import annotations

import random

from quarl.tasks.base import Example
from quarl.tasks.synthetic import _SyntheticTask

OPS_PER_CYCLE = 4
MAX_OPERAND = 19
MAX_DRIFT = 9  # |sum of a cycle's operations| (at least 1)


def cycle_solution(start: int, ops: list[int], rounds: int) -> tuple[str, int]:
    """The worked solution of running ``ops`` (signed operands) ``rounds`` times from
    ``start``, and the final value."""
    value, parts = start, []
    for r in range(1, rounds + 1):
        parts.append(f"{r}:")
        for op in ops:
            new = value + op
            parts.append(f"{value}{'+' if op >= 0 else '-'}{abs(op)}={new};")
            value = new
    return "".join(parts) + f"#{value}", value


def min_rounds(difficulty: int) -> int:
    """The fewest rounds a problem of ``difficulty`` has: ``ceil(2 * difficulty / 3)``."""
    return -(-2 * difficulty // 3)


def cycle_prompt(start: int, ops: list[int], rounds: int) -> str:
    return f"{start}(" + "".join(f"{'+' if op >= 0 else '-'}{abs(op)}" for op in ops) + f")x{rounds}="


class CycleTask(_SyntheticTask):
    """Cyclic arithmetic chains (module docstring): ``difficulty`` is the largest number of
    rounds; a problem has :func:`min_rounds` to ``difficulty`` rounds of four steps."""

    name = "cycle"
    builtin_reward = "quarl.tasks.synthetic:arith_reward"

    def sample(self, rng: random.Random) -> Example:
        start = rng.randint(0, MAX_OPERAND)
        while True:
            ops = [rng.choice((1, -1)) * rng.randint(1, MAX_OPERAND) for _ in range(OPS_PER_CYCLE)]
            if 1 <= abs(sum(ops)) <= MAX_DRIFT:
                break
        rounds = rng.randint(min_rounds(self.difficulty), self.difficulty)
        solution, value = cycle_solution(start, ops, rounds)
        return Example(prompt=cycle_prompt(start, ops, rounds), answer=str(value), solution=solution,
                       meta={"start": start, "ops": ops, "rounds": rounds})
