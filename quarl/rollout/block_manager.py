"""Paged KV-cache bookkeeping: free list, reference counts, fork and copy-on-write."""

from __future__ import annotations

from collections import deque

from quarl.rollout.sequence import Sequence


class BlockManager:
    """Owns which cache blocks hold which sequence's K/V; never touches tensors.

    A block holds ``block_size`` consecutive tokens of one sequence. Completions of one
    prompt share the prompt's blocks (``fork``), counted by reference. Before a token
    is written into a block that is still shared, ``append_slot`` moves the writer to a
    private copy and returns the ``(src, dst)`` block copy for the model runner to do.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks for the first ``num_tokens`` tokens of a sequence that holds none."""
        assert not seq.block_table, seq
        seq.block_table = [self._take() for _ in range(self.blocks_for(num_tokens))]
        seq.table_epoch += 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share every block of ``parent``."""
        assert not child.block_table, child
        child.block_table = list(parent.block_table)
        child.table_epoch += 1
        for block in parent.block_table:
            self.ref_counts[block] += 1

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.table_epoch += 1

    def needs_block(self, seq: Sequence, position: int | None = None) -> bool:
        """Whether writing ``position`` (default ``len(seq) - 1``, the token the next decode
        step writes) takes a free block: a new one, or a private copy of a shared one."""
        position = len(seq) - 1 if position is None else position
        index = position // self.block_size
        return index >= len(seq.block_table) or self.ref_counts[seq.block_table[index]] > 1

    def can_append(self, seq: Sequence) -> bool:
        return not self.needs_block(seq) or self.num_free_blocks > 0

    def append_slot(self, seq: Sequence, position: int | None = None) -> tuple[int, int] | None:
        """Make the block of ``position`` (default ``len(seq) - 1``) private; returns a CoW
        copy if any. Idempotent: a second call for the same position changes nothing."""
        index = (len(seq) - 1 if position is None else position) // self.block_size
        if index >= len(seq.block_table):
            assert index == len(seq.block_table), (seq, index)
            seq.block_table.append(self._take())
            return None
        block = seq.block_table[index]
        if self.ref_counts[block] == 1:
            return None
        new_block = self._take()
        self._release(block)
        seq.block_table[index] = new_block
        seq.table_epoch += 1
        return block, new_block
