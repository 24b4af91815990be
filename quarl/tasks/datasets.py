"""Tasks read from files: JSONL (one JSON object a line) or parquet, chosen by extension.

Each row has a prompt column (a string, or a list of chat messages ``{role,
content}``) and an answer column; their names are ``prompt_key`` / ``answer_key``.
An optional ``solution`` column (a full assistant response) feeds the supervised
warm-start; every other column goes to ``Example.meta`` and so reaches the reward
function. The eval set is ``eval_path`` if given, else the last ``num_eval`` rows.

Rewards: ``"builtin"`` and ``"math"`` both mean math-verify on the last
``\\boxed{}`` of the completion; ``"module:function"`` names your own
``fn(completion: str, answer: str, meta: dict) -> float``.

Parquet needs pyarrow (in the ``train`` extra), imported only when a parquet file
is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from quarl.tasks.base import Example, Task
from quarl.tasks.rewards import MATH_REWARD

_ROLES = ("system", "user", "assistant")


class DatasetError(ValueError):
    """A data file is missing, empty or malformed; the message names file and line."""


class FileTask(Task):
    name = "file"
    builtin_reward = MATH_REWARD

    def __init__(
        self,
        path: str | Path,
        eval_path: str | Path | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        num_eval: int = 64,
        system_prompt: str | None = None,
        reward: str = "builtin",
    ) -> None:
        super().__init__(system_prompt=system_prompt, reward=reward)
        self.path = Path(path)
        train = read_examples(path, prompt_key, answer_key)
        if eval_path is not None:
            self._train, self._eval = train, read_examples(eval_path, prompt_key, answer_key)
        elif num_eval <= 0:
            self._train, self._eval = train, []
        elif num_eval >= len(train):
            raise DatasetError(
                f"{path} has {len(train)} examples: too few to hold out num_eval={num_eval} for "
                "evaluation and train on the rest; lower data.num_eval or set data.eval_path"
            )
        else:
            self._train, self._eval = train[:-num_eval], train[-num_eval:]

    def train_examples(self) -> list[Example]:
        return list(self._train)

    def eval_examples(self) -> list[Example]:
        return list(self._eval)


def read_examples(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Example]:
    """All examples of a ``.jsonl`` or ``.parquet`` file; raises ``DatasetError``."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"data file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        rows: Iterator[tuple[str, Any]] = _jsonl_rows(path)
    elif suffix in (".parquet", ".pq"):
        rows = _parquet_rows(path)
    else:
        raise DatasetError(f"{path}: unknown data format {suffix!r}; use .jsonl or .parquet")
    examples = [_to_example(row, where, prompt_key, answer_key) for where, row in rows]
    if not examples:
        raise DatasetError(f"{path} is empty: it holds no examples")
    return examples


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    # Bytes, split on b"\n" only: a text-mode read would also split on a lone "\r" and misnumber the
    # lines after it, and a byte that is not UTF-8 would fail with no line at all.
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                column = len(raw[: e.start].decode("utf-8", errors="replace")) + 1
                raise DatasetError(f"{path}, line {lineno}, column {column}: not UTF-8 (byte 0x{raw[e.start]:02x}); "
                                   "save the file as UTF-8") from None
            # the line's own text, without its end: an error at the end of a cut line (a missing "}")
            # would otherwise be placed after the newline, at column 1 of the next line
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:  # (one line holds no "\n": e.colno is the column in it)
                raise DatasetError(f"{where}: bad JSON ({e.msg} at column {e.colno})") from None
            yield where, row


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(
            f'reading {path} needs pyarrow: pip install -e ".[train]" (or pip install pyarrow)'
        ) from None
    for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield f"{path}, row {i}", row


def _to_example(row: Any, where: str, prompt_key: str, answer_key: str) -> Example:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key, config in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
        if key not in row:
            raise DatasetError(
                f"{where}: missing key {key!r} (available keys: {', '.join(map(repr, row)) or 'none'}); "
                f"set data.{config} to the right column"
            )
    answer = row[answer_key]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DatasetError(f"{where}: {answer_key!r} must be a string or a number, got {type(answer).__name__}")
    solution = row.get("solution")
    if solution is not None and not isinstance(solution, str):
        raise DatasetError(f"{where}: 'solution' must be a string, got {type(solution).__name__}")
    meta = {k: v for k, v in row.items() if k not in (prompt_key, answer_key, "solution")}
    return Example(_check_prompt(row[prompt_key], where, prompt_key), str(answer), solution, meta)


def _check_prompt(prompt: Any, where: str, key: str) -> str | list[dict[str, str]]:
    if isinstance(prompt, str):
        return prompt
    wrong = f"{where}: {key!r} must be a string or a non-empty list of chat messages {{role, content}}"
    if not isinstance(prompt, list) or not prompt:
        raise DatasetError(f"{wrong}, got {'an empty list' if prompt == [] else type(prompt).__name__}")
    for j, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in _ROLES:
            raise DatasetError(f"{wrong}; message {j} is {m!r} (role must be one of {', '.join(_ROLES)})")
    return [{"role": m["role"], "content": m["content"]} for m in prompt]
