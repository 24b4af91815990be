"""A sequence being generated: tokens, log-probs, block table, status and, on an engine that
records them, the experts each position ran (no tensors)."""

from __future__ import annotations

from enum import Enum, auto

import numpy as np

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
        self.routes: RouteLog | None = None  # (an engine that records routes: Engine(record_routes=True))

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


class RouteLog:
    """The experts one sequence's positions ran in each MoE layer of the engine: rows
    ``[position, moe layer, k]`` of int16 expert ids, ``-1`` where a position never ran (the
    last sampled token until the next step feeds it).

    A prefill writes positions ``[0, m)`` at once: :meth:`set_prefix` keeps the array it is
    given, which the ``n`` samples of a shared prompt hold together (one prefill: the K/V they
    all read came from it) and nobody writes in place. A recompute after a preemption sets a new
    prefix of the sequence's own (its recomputed K/V is what it reads from then on), dropping
    what it had. Each decode step then writes one position after the prefix (:meth:`put`) into
    the sequence's own rows, grown by doubling."""

    __slots__ = ("prefix", "own")

    def __init__(self, layers: int, k: int) -> None:
        self.prefix = np.empty((0, layers, k), dtype=np.int16)
        self.own = np.full((16, layers, k), -1, dtype=np.int16)

    def set_prefix(self, rows: np.ndarray) -> None:
        """Positions ``[0, len(rows))`` are ``rows`` (not copied); later ones unknown again."""
        self.prefix = rows
        self.own = np.full((16, *rows.shape[1:]), -1, dtype=np.int16)

    def put(self, position: int, row: np.ndarray) -> None:
        """Position ``position`` (after the prefix) ran experts ``row [layers, k]``."""
        i = position - len(self.prefix)
        if i >= len(self.own):
            grown = np.full((max(2 * len(self.own), i + 1), *self.own.shape[1:]), -1, dtype=np.int16)
            grown[: len(self.own)] = self.own
            self.own = grown
        self.own[i] = row

    def rows(self, length: int) -> np.ndarray:
        """Positions ``[0, length)`` as one new ``[length, layers, k]`` array."""
        out = np.full((length, *self.own.shape[1:]), -1, dtype=np.int16)
        m = min(length, len(self.prefix))
        out[:m] = self.prefix[:m]
        tail = min(length - m, len(self.own))
        out[m : m + tail] = self.own[:tail]
        return out
