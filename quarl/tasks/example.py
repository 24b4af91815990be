"""One prompt with its gold answer: what a task hands the trainer and a reward function scores."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Message = dict[str, str]


@dataclass
class Example:
    """One prompt with its gold answer.

    ``prompt`` is the user's text, or a full list of chat messages ``{role, content}``.
    ``solution`` is a complete assistant response that earns reward 1 (used for the
    supervised warm-start); ``meta`` carries whatever else the reward needs (countdown's
    numbers, a dataset's extra columns).
    """

    prompt: str | list[Message]
    answer: str
    solution: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
