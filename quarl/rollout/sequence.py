"""A sequence being generated: tokens, log-probs, block table and status (no tensors)."""

from __future__ import annotations

from enum import Enum, auto

from quarl.rollout.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One completion of one prompt.

    ``token_ids`` holds prompt + generated tokens. All tokens but the last have their
    K/V in the cache while the sequence runs (the last one is written by the next
    decode step). ``rng_key`` is the 32-bit key of this completion's random stream.
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt_index: int,
        sample_index: int,
        rng_key: int,
        stop_ids: frozenset[int],
    ) -> None:
        self.seq_id = seq_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.prompt_index = prompt_index
        self.sample_index = sample_index
        self.rng_key = rng_key
        self.stop_ids = stop_ids
        self.logprobs: list[float] = []
        self.block_table: list[int] = []
        self.table_epoch = 0  # bumped when blocks are replaced, not when one is appended
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def append(self, token_id: int, logprob: float) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)

    def __repr__(self) -> str:
        return f"Sequence(id={self.seq_id}, len={len(self)}, status={self.status.name})"
