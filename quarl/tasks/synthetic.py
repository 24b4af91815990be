"""Built-in tasks with verifiable answers, generated from a seed: no files, no downloads.

Both are sized for the built-in character tokenizer and a ~1M-parameter model that
must learn difficulty 1 from a short supervised warm-start and then improve with RL,
so prompts and solutions are compact strings (< 40 characters at difficulty 1-2).

Examples are drawn with ``random.Random(seed)``: the eval set first (so it does not
depend on ``num_train``), then the train set from the problems not in it. When a
difficulty has fewer distinct problems than ``num_train``, the train set repeats
problems; it never contains an eval problem.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from fractions import Fraction
from typing import Callable

from quarl.tasks.base import Example, Task

_INT = re.compile(r"-?\d{1,30}")


def _draw(
    sample: Callable[[random.Random], Example], num_train: int, num_eval: int, seed: int
) -> tuple[list[Example], list[Example]]:
    """Disjoint (train, eval) lists of examples; a problem is identified by its prompt."""
    rng = random.Random(seed)
    eval_set: dict[str, Example] = {}
    for _ in range(100 * num_eval + 1000):
        if len(eval_set) == num_eval:
            break
        ex = sample(rng)
        eval_set.setdefault(ex.prompt, ex)
    if len(eval_set) < num_eval:
        raise ValueError(f"only {len(eval_set)} distinct problems found for num_eval={num_eval}; lower it")
    train: list[Example] = []
    seen: set[str] = set()
    misses = 0  # consecutive repeats; past 2000 the new problems are taken to have run out
    while len(train) < num_train:
        ex = sample(rng)
        if ex.prompt in eval_set:
            continue
        if ex.prompt in seen and misses < 2000:
            misses += 1
            continue
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            misses = 0
        train.append(ex)
    return train, list(eval_set.values())


class _SyntheticTask(Task):
    def __init__(
        self,
        difficulty: int = 1,
        num_train: int = 2000,
        num_eval: int = 64,
        seed: int = 0,
        system_prompt: str | None = None,
        reward: str = "builtin",
    ) -> None:
        super().__init__(system_prompt=system_prompt, reward=reward)
        if difficulty < 1:
            raise ValueError(f"difficulty must be >= 1, got {difficulty}")
        if num_train < 0 or num_eval < 0:
            raise ValueError("num_train and num_eval must be >= 0")
        self.difficulty = difficulty
        self._train, self._eval = _draw(self.sample, num_train, num_eval, seed)

    def sample(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def train_examples(self) -> list[Example]:
        return list(self._train)

    def eval_examples(self) -> list[Example]:
        return list(self._eval)


# --------------------------------------------------------------------------- arithmetic


class ArithmeticTask(_SyntheticTask):
    """Chains of ``difficulty`` additions/subtractions of operands 0..19, left to right.

    Prompt ``7+12-3=``; worked solution ``7+12=19;19-3=16;#16``: one step per
    operation, then ``#`` and the answer. See :func:`arith_reward` for the rule.
    """

    name = "arith"
    builtin_reward = "quarl.tasks.synthetic:arith_reward"

    def sample(self, rng: random.Random) -> Example:
        value = rng.randint(0, 19)
        prompt, steps = str(value), []
        for _ in range(self.difficulty):
            op, operand = rng.choice("+-"), rng.randint(0, 19)
            new = value + operand if op == "+" else value - operand
            prompt += f"{op}{operand}"
            steps.append(f"{value}{op}{operand}={new};")
            value = new
        return Example(prompt=prompt + "=", answer=str(value), solution="".join(steps) + f"#{value}")


def arith_reward(completion: str, answer: str, meta: dict | None = None) -> float:
    """1.0 if the text after the last ``#`` (whitespace stripped) is exactly the answer
    as an integer; 0.0 otherwise (no ``#``, anything else after the number)."""
    if "#" not in completion:
        return 0.0
    claim = completion.rsplit("#", 1)[1].strip()
    return 1.0 if _INT.fullmatch(claim) and int(claim) == int(answer) else 0.0


# --------------------------------------------------------------------------- countdown

_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
_TOKEN = re.compile(r"\s*(?:(\d+)|([-+*/()]))")
_MAX_EXPR_CHARS = 200


class CountdownTask(_SyntheticTask):
    """Reach a target with ``difficulty + 2`` numbers (1..20), + - * / and parentheses.

    Prompt ``3,4,5->17``; solution ``3*4+5#17``: an expression using every number once
    (a solver may use a subset), ``#``, the target. The generator only keeps targets in
    1..999 reached with non-negative, integer intermediate values.
    See :func:`countdown_reward` for the rule.
    """

    name = "countdown"
    builtin_reward = "quarl.tasks.synthetic:countdown_reward"

    def sample(self, rng: random.Random) -> Example:
        while True:
            numbers = [rng.randint(1, 20) for _ in range(self.difficulty + 2)]
            text, value, _ = _random_expression(rng, numbers)
            if 1 <= value <= 999:
                break
        shown = sorted(numbers)
        return Example(
            prompt=",".join(map(str, shown)) + f"->{value}",
            answer=str(value),
            solution=f"{text}#{value}",
            meta={"numbers": shown, "target": int(value)},
        )


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[str, int, int]:
    """A random binary tree over ``numbers`` (in order): (text, value, precedence).

    The operators are tried in a random order and the first that keeps the value a
    non-negative integer wins (``+`` always does); parentheses appear only where
    precedence needs them.
    """
    if len(numbers) == 1:
        return str(numbers[0]), numbers[0], 3
    k = rng.randint(1, len(numbers) - 1)
    lt, lv, lp = _random_expression(rng, numbers[:k])
    rt, rv, rp = _random_expression(rng, numbers[k:])
    ops = rng.sample(["+", "-", "*", "/"], 4)
    for op in ops:
        if op == "-" and lv < rv or op == "/" and (rv == 0 or lv % rv):
            continue
        value = {"+": lv + rv, "-": lv - rv, "*": lv * rv, "/": lv // rv if rv else 0}[op]
        prec = _PREC[op]
        left = f"({lt})" if lp < prec else lt
        right = f"({rt})" if rp < prec or (rp == prec and op in "-/") else rt
        return f"{left}{op}{right}", value, prec
    raise AssertionError("unreachable: '+' always qualifies")


def parse_expression(text: str) -> tuple[Fraction | None, list[int]] | None:
    """Parse and evaluate an expression of non-negative integers, + - * / and ( ).

    A hand-written recursive-descent parser (no ``eval``): returns (exact value,
    the integer literals used) or None if ``text`` holds anything else, is malformed
    or is longer than 200 characters. The value is None on division by zero.
    Unary minus is not allowed.
    """
    if len(text) > _MAX_EXPR_CHARS:
        return None
    tokens: list[str] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            return None
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    used: list[int] = []
    try:
        value, end = _parse_sum(tokens, 0, used)
    except SyntaxError:
        return None
    return (value, used) if end == len(tokens) else None


def _parse_sum(tokens: list[str], i: int, used: list[int]) -> tuple[Fraction | None, int]:
    value, i = _parse_product(tokens, i, used)
    while i < len(tokens) and tokens[i] in "+-":
        op = tokens[i]
        rhs, i = _parse_product(tokens, i + 1, used)
        value = None if value is None or rhs is None else (value + rhs if op == "+" else value - rhs)
    return value, i


def _parse_product(tokens: list[str], i: int, used: list[int]) -> tuple[Fraction | None, int]:
    value, i = _parse_atom(tokens, i, used)
    while i < len(tokens) and tokens[i] in "*/":
        op = tokens[i]
        rhs, i = _parse_atom(tokens, i + 1, used)
        if value is None or rhs is None or (op == "/" and rhs == 0):
            value = None
        else:
            value = value * rhs if op == "*" else value / rhs
    return value, i


def _parse_atom(tokens: list[str], i: int, used: list[int]) -> tuple[Fraction | None, int]:
    if i >= len(tokens):
        raise SyntaxError("expression ends early")
    if tokens[i].isdigit():
        used.append(int(tokens[i]))
        return Fraction(int(tokens[i])), i + 1
    if tokens[i] == "(":
        value, i = _parse_sum(tokens, i + 1, used)
        if i >= len(tokens) or tokens[i] != ")":
            raise SyntaxError("unclosed parenthesis")
        return value, i + 1
    raise SyntaxError(f"unexpected {tokens[i]!r}")


def countdown_reward(completion: str, answer: str, meta: dict) -> float:
    """Countdown's rule, on a completion of the form ``EXPR#N``.

    - 1.0: EXPR uses each of ``meta["numbers"]`` at most once (as a multiset; not
      all need be used), only + - * / ( ) and spaces, evaluates exactly (fractions,
      no division by zero) to the target ``answer``, and N equals the target;
    - 0.1: the completion is well formed (a parseable EXPR, ``#``, an integer N) but
      wrong in any of these ways;
    - 0.0: anything else (no ``#``, other characters, malformed, text after N).
    """
    text = completion.strip()
    if "#" not in text:
        return 0.0
    expr, claim = text.rsplit("#", 1)
    claim = claim.strip()
    parsed = parse_expression(expr)
    if parsed is None or not _INT.fullmatch(claim):
        return 0.0
    value, used = parsed
    target = int(answer)
    numbers_ok = not (Counter(used) - Counter(int(n) for n in meta["numbers"]))
    return 1.0 if numbers_ok and value == target and int(claim) == target else 0.1
