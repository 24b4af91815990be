"""The paged KV cache tensors."""

from __future__ import annotations

import torch


class KVCache:
    """K and V of every layer: ``data [2, L, num_blocks + 1, block_size, Hkv, D]``.

    The extra last block is scratch: padded rows of a CUDA-graph batch write their K/V
    there (``scratch_slot``) so they never touch a sequence's blocks.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (2, num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.k = [self.data[0, i] for i in range(num_layers)]
        self.v = [self.data[1, i] for i in range(num_layers)]
        self.scratch_slot = num_blocks * block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` of every layer gets the contents of block ``src``."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.data.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.data.device)
        self.data[:, :, dst] = self.data[:, :, src]
