"""Continuous batching: which sequences run in the next step (no tensors here)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from quarl.rollout.block_manager import BlockManager
from quarl.rollout.config import EngineConfig
from quarl.rollout.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One model step.

    Prefill: each group's leader (``groups[i][0]``) runs all its tokens; every member of
    the group samples its next token from the leader's last logits. Decode: every group
    has one sequence, which runs its last token. ``block_copies`` are copy-on-write
    ``(src, dst)`` block copies to do before the step.
    """

    is_prefill: bool
    groups: list[list[Sequence]]
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def seqs(self) -> list[Sequence]:
        return [s for g in self.groups for s in g]


class Scheduler:
    """Prefill first, then decode; preempts the newest sequence (recompute) when full.

    A fresh request with ``n`` samples waits as one group and is prefilled once: its
    members fork the leader's blocks. A preempted sequence waits alone and is
    recomputed from its prompt and the tokens it already generated.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.waiting: deque[list[Sequence]] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, group: list[Sequence]) -> None:
        self.waiting.append(group)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> ScheduledBatch:
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        groups: list[list[Sequence]] = []
        num_seqs, num_tokens = len(self.running), 0
        while self.waiting:
            group = self.waiting[0]
            leader = group[0]
            if num_seqs + len(group) > self.max_num_seqs:
                break
            if num_tokens + len(leader) > self.max_num_batched_tokens:
                break
            if not self.block_manager.can_allocate(len(leader)):
                break
            self.waiting.popleft()
            self.block_manager.allocate(leader, len(leader))
            for member in group[1:]:
                self.block_manager.fork(leader, member)
            for member in group:
                member.status = SequenceStatus.RUNNING
            self.running.extend(group)
            groups.append(group)
            num_seqs += len(group)
            num_tokens += len(leader)
        return ScheduledBatch(True, groups) if groups else None

    def _schedule_decode(self) -> ScheduledBatch:
        scheduled: list[Sequence] = []
        copies: list[tuple[int, int]] = []
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                copy = self.block_manager.append_slot(seq)
                if copy is not None:
                    copies.append(copy)
                scheduled.append(seq)
        if not scheduled:
            # Everything was preempted and the cache is empty: recompute the oldest.
            batch = self._schedule_prefill()
            if batch is None:
                raise RuntimeError("the KV cache cannot hold a single sequence; enlarge it or lower max_model_len")
            return batch
        self.running.extend(scheduled)
        return ScheduledBatch(False, [[s] for s in scheduled], copies)

    def lookahead(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The decode step after ``batch`` (a decode step launched, its tokens not sampled
        yet), planned while the GPU runs it: every sequence gets one more token and none
        stops, so the next step runs the same sequences in the same order, each writing
        position ``len(seq)``; its blocks are taken now (``append_slot`` at that position,
        which ``schedule`` later repeats as a no-op if the plan is dropped). ``None`` where
        the next step cannot be planned this way: groups wait for a prefill, a sequence
        reaches its length limit with this token, or the cache lacks a block (preemption).
        If a sampled token turns out to be a stop token, the engine drops the plan and
        schedules normally."""
        if batch.is_prefill or self.waiting or len(batch.groups) != len(self.running):
            return None
        seqs = batch.seqs
        bm = self.block_manager
        need = 0
        for seq in seqs:
            if seq.num_generated + 1 >= seq.params.max_new_tokens or len(seq) + 1 >= self.max_model_len:
                return None
            need += bm.needs_block(seq, len(seq))
        if need > bm.num_free_blocks:
            return None
        copies = [c for c in (bm.append_slot(seq, len(seq)) for seq in seqs) if c is not None]
        return ScheduledBatch(False, [[s] for s in seqs], copies)

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.block_manager.free(seq)
        self.waiting.appendleft([seq])
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], logprobs: list[float]) -> list[Sequence]:
        """Append the sampled tokens; returns the sequences that finished (blocks freed). A
        sequence that finished before takes no token: the engine queues a decode step before
        it reads the one ahead, so a sequence that stops there has a row in the next one."""
        finished = []
        for seq, token, logprob in zip(seqs, token_ids, logprobs):
            if seq.status == SequenceStatus.FINISHED:
                continue
            seq.append(token, logprob)
            if token in seq.stop_ids:
                seq.finish_reason = "stop"
            elif seq.num_generated >= seq.params.max_new_tokens or len(seq) >= self.max_model_len:
                seq.finish_reason = "length"
            else:
                continue
            seq.status = SequenceStatus.FINISHED
            self.block_manager.free(seq)
            finished.append(seq)
        if finished:
            done = {s.seq_id for s in finished}
            self.running = deque(s for s in self.running if s.seq_id not in done)
        return finished
