"""Stages 1-3 of a step: the next prompts, ``n`` completions each from the engine, and their
rewards from the task's verifier (DAPO's dynamic sampling refills uniform groups).

The samples of a prompt are seeded by ``(seed, step)`` and the prompt's place in the step,
not by the rank, so a resumed run (on any number of ranks) repeats an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable

import torch

from quarl.algos import informative_groups
from quarl.config.run import DataConfig, RolloutConfig, TrainerConfig
from quarl.distributed import Dist
from quarl.rollout import SamplingParams
from quarl.trainer.ranks import union_of_ranks
from quarl.trainer.stages import Rollout, StageClock


def sampling_params(rollout: RolloutConfig, eos_token_id: int, seed: int, temperature: float | None = None,
                    n: int | None = None) -> SamplingParams:
    """The run's sampling settings (``temperature`` and ``n`` where given instead)."""
    return SamplingParams(
        n=rollout.n if n is None else n,
        temperature=rollout.temperature if temperature is None else temperature,
        top_p=rollout.top_p, top_k=rollout.top_k, max_new_tokens=rollout.max_new_tokens,
        stop_token_ids=(eos_token_id,), seed=seed,
    )


def chat_prompt(tokenizer, task, example, max_prompt_len: int) -> list[int]:
    """``example``'s prompt in the chat template, its last ``max_prompt_len`` tokens."""
    return tokenizer.apply_chat_template(task.messages(example))[-max_prompt_len:]


class PromptStream:
    """The train split in a seeded shuffle per epoch; ``position`` counts the examples drawn
    (a checkpoint keeps it, so a resumed run draws what the interrupted one would have)."""

    def __init__(self, examples: list, tokenizer, task, data: DataConfig, position: int = 0) -> None:
        self.examples, self.tokenizer, self.task, self.data = examples, tokenizer, task, data
        self.position = position
        self._epoch_order: tuple[int, list[int]] = (-1, [])

    def next(self, count: int) -> tuple[list[list[int]], list]:
        """The next ``count`` examples and their prompts' token ids."""
        n = len(self.examples)
        out_prompts, out_examples = [], []
        for _ in range(count):
            epoch, idx = divmod(self.position, n)
            if self._epoch_order[0] != epoch:
                order = list(range(n))
                random.Random(self.data.seed * 1_000_003 + epoch).shuffle(order)
                self._epoch_order = (epoch, order)
            ex = self.examples[self._epoch_order[1][idx]]
            self.position += 1
            out_prompts.append(chat_prompt(self.tokenizer, self.task, ex, self.data.max_prompt_len))
            out_examples.append(ex)
        return out_prompts, out_examples


class RolloutCollector:
    """Samples a step's rollouts with ``engine`` and scores them with ``rewards`` (a reward
    pool); on several ranks each rank samples its share of the step's prompts."""

    def __init__(self, rollout: RolloutConfig, trainer: TrainerConfig, engine, tokenizer, rewards,
                 prompts: PromptStream, dist: Dist) -> None:
        self.rollout, self.trainer = rollout, trainer
        self.engine, self.tokenizer, self.rewards = engine, tokenizer, rewards
        self.prompts, self.dist = prompts, dist

    def collect(self, step: int, clock: StageClock, stop: Callable[[], bool] | None = None) -> tuple[Rollout, int]:
        """Stages 1-3 of step ``step + 1``: this rank's rollout and its engine's preemptions
        (a KV cache too small for its rollouts). ``stop``: whether to stop waiting for the
        verifier."""
        prompts, examples = self.prompts.next(self.trainer.prompts_per_step)
        mine = self.dist.share(len(prompts))  # every rank draws the step's prompts, then takes its share
        prompts, examples = prompts[mine.start : mine.stop], examples[mine.start : mine.stop]
        with clock.stage("rollout", memory=True):
            completions, preempted = self.sample(prompts, step, seed_offset=0, first=mine.start)
        rewards, reward_metrics = self.verify(completions, examples, stop)
        rollout = Rollout(prompts, examples, completions, rewards, reward_metrics,
                          sum(len(c.token_ids) for c in completions))
        if self.trainer.dynamic_sampling:
            rollout, more = self._dynamic_sampling(rollout, step, stop)
            preempted += more
        return rollout, preempted

    def sample(self, prompts: list[list[int]], step: int, seed_offset: int, first: int = 0) -> tuple[list, int]:
        """``n`` completions of each prompt and the engine's preemptions; ``first``: the step's
        index of ``prompts[0]`` (a rank's share starts there)."""
        base = (self.trainer.seed * 1_000_003 + step) * 1009 + seed_offset
        eos = self.tokenizer.eos_token_id
        params = [sampling_params(self.rollout, eos, base * 4099 + first + i) for i in range(len(prompts))]
        completions = self.engine.generate(prompts, params)
        return completions, self.engine.stats.preemptions

    def verify(self, completions, examples: list[Any], stop: Callable[[], bool] | None = None
               ) -> tuple[torch.Tensor, dict[str, float]]:
        """The verifier's reward of each completion, and its counts (timeouts, errors)."""
        texts = [self.tokenizer.decode(c.token_ids) for c in completions]
        exs = [examples[c.prompt_index] for c in completions]
        scores, stats = self.rewards.score(texts, exs, stop=stop)
        assert len(scores) == len(completions) == len(examples) * self.rollout.n
        return torch.tensor(scores, dtype=torch.float32), stats

    def _dynamic_sampling(self, first: Rollout, step: int, stop: Callable[[], bool] | None) -> tuple[Rollout, int]:
        """DAPO: keep the groups whose rewards differ, refill from fresh prompts (3 rounds at most).
        On several ranks the choice is made over every rank's groups (each rank samples its
        share of a refill too), and the kept groups are then shared out again."""
        n, want = self.rollout.n, self.trainer.prompts_per_step
        kept, current, dropped, rounds, preempted = None, union_of_ranks(self.dist, first, routes=True), 0, 0, 0
        while True:
            take = []
            for g, informative in enumerate(informative_groups(current.rewards, n).tolist()):
                if len(take) + (len(kept.prompts) if kept else 0) == want:
                    break
                if informative:
                    take.append(g)
                else:
                    dropped += 1
            part = current.select(take, n)
            kept = part if kept is None else kept.extend(part)
            if len(kept.prompts) == want or rounds >= 3:
                break
            rounds += 1
            prompts, examples = self.prompts.next(want)
            mine = self.dist.share(want)
            prompts, examples = prompts[mine.start : mine.stop], examples[mine.start : mine.stop]
            completions, more = self.sample(prompts, step, seed_offset=rounds, first=mine.start)
            preempted += more
            rewards, _ = self.verify(completions, examples, stop)
            current = union_of_ranks(self.dist, Rollout(prompts, examples, completions, rewards, {}, 0), routes=True)
        # every group was uniform: train on the last batch as is (zero advantages); so too when
        # fewer groups than ranks are left (a rank cannot train on none)
        if len(kept.prompts) < self.dist.world:
            kept = current
        k, r = self.dist.world, self.dist.rank
        count = len(kept.prompts)
        kept = kept.select(list(range(count * r // k, count * (r + 1) // k)), n)
        extra = {"dapo/dropped_groups": float(dropped), "dapo/refill_rounds": float(rounds)}
        return dataclasses.replace(kept, reward_metrics={**first.reward_metrics, **extra},
                                   generated_tokens=first.generated_tokens), preempted
