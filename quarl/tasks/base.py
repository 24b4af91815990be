"""What a task is: examples with verifiable answers, a reward, and an evaluation.

A task hands the trainer :class:`Example` s (a prompt, the gold answer, optionally a
worked solution for the supervised warm-start) and owns how a completion is scored.
Its reward is a module-level function named by an import path (``reward_spec``,
``"module:function"``) so that :class:`quarl.tasks.rewards.RewardPool` can run it in
worker processes; every reward function has the signature
``fn(completion: str, answer: str, meta: dict) -> float``.
"""

from __future__ import annotations

from typing import Any

from quarl.tasks.example import Example, Message
from quarl.tasks.rewards import RewardFn, resolve_reward, reward_spec

__all__ = ["Example", "Message", "Task"]


class Task:
    """Base class: subclasses set ``name`` and ``builtin_reward`` and build the examples.

    ``reward`` chooses the verifier: ``"builtin"`` (the task's own), ``"math"``
    (math-verify on the ``\\boxed{}`` answer) or a ``"module:function"`` path.
    """

    name: str = "task"
    builtin_reward: str = ""  # "module:function" of the task's own verifier

    def __init__(self, system_prompt: str | None = None, reward: str = "builtin") -> None:
        self.system_prompt = system_prompt
        self.reward_spec = reward_spec(reward, self.builtin_reward)
        self._reward_fn: RewardFn = resolve_reward(self.reward_spec)  # fails early on a bad path

    def train_examples(self) -> list[Example]:
        raise NotImplementedError

    def eval_examples(self) -> list[Example]:
        raise NotImplementedError

    def messages(self, example: Example) -> list[Message]:
        """The chat messages of ``example``, with the system prompt first if one is set
        and the example brings none of its own."""
        if isinstance(example.prompt, str):
            msgs = [{"role": "user", "content": example.prompt}]
        else:
            msgs = [dict(m) for m in example.prompt]
        if self.system_prompt and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def encode_prompt(self, example: Example, tokenizer: Any) -> list[int]:
        """Prompt token ids, ending where the assistant's answer starts."""
        return tokenizer.apply_chat_template(self.messages(example), add_generation_prompt=True)

    def reward(self, completion: str, example: Example) -> float:
        """Score one completion in this process (no timeout; see ``RewardPool`` for that)."""
        return float(self._reward_fn(completion, example.answer, example.meta))

    def evaluate(
        self, completions: list[str], examples: list[Example], rewards: list[float] | None = None
    ) -> dict[str, float]:
        """``eval/acc`` (share with reward >= 1) and ``eval/reward_mean``.

        Pass ``rewards`` when they were already computed (e.g. by a ``RewardPool``).
        """
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions for {len(examples)} examples")
        if rewards is None:
            rewards = [self.reward(c, ex) for c, ex in zip(completions, examples)]
        n = max(len(rewards), 1)
        return {
            "eval/acc": sum(r >= 1.0 for r in rewards) / n,
            "eval/reward_mean": sum(rewards) / n,
        }
