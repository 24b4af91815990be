"""The paged KV cache tensors."""

from __future__ import annotations

import torch

from quarl.quant.kv import KV_FP8_DTYPE, check_kv_cache_dtype


class KVCache:
    """K and V of every layer: ``data [2, L, num_blocks + 1, block_size, Hkv, D]``.

    The extra last block is scratch: padded rows of a CUDA-graph batch write their K/V
    there (``scratch_slot``) so they never touch a sequence's blocks.

    ``kv_cache_dtype="fp8"``: ``data`` holds float8 e4m3fn codes and ``scales
    [2, L, num_blocks + 1, block_size, Hkv]`` float32 one scale per (token, kv head) row
    (:mod:`quarl.quant.kv`); ``k_scale[i]`` / ``v_scale[i]`` are layer ``i``'s views, None
    for a cache in the model dtype (``"auto"``). Both tensors are allocated once, so
    captured CUDA graphs keep their addresses.
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
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.quantized = check_kv_cache_dtype(kv_cache_dtype) == "fp8"
        shape = (2, num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.data = torch.zeros(shape, dtype=KV_FP8_DTYPE if self.quantized else dtype, device=device)
        self.k = [self.data[0, i] for i in range(num_layers)]
        self.v = [self.data[1, i] for i in range(num_layers)]
        self.scales: torch.Tensor | None = None
        self.k_scale: list[torch.Tensor | None] = [None] * num_layers
        self.v_scale: list[torch.Tensor | None] = [None] * num_layers
        if self.quantized:
            self.scales = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
            self.k_scale = [self.scales[0, i] for i in range(num_layers)]
            self.v_scale = [self.scales[1, i] for i in range(num_layers)]
        self.scratch_slot = num_blocks * block_size

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> int:
        """Bytes of one block across layers, K and V: codes plus scales for fp8."""
        rows = 2 * num_layers * block_size * num_kv_heads
        if check_kv_cache_dtype(kv_cache_dtype) == "fp8":
            return rows * (head_dim * 1 + 4)
        return rows * head_dim * torch.empty(0, dtype=dtype).element_size()

    def zero_(self) -> None:
        self.data.view(torch.uint8).zero_()
        if self.scales is not None:
            self.scales.zero_()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` of every layer gets the contents of block ``src`` (codes and scales)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.data.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.data.device)
        data = self.data.view(torch.uint8) if self.quantized else self.data
        data[:, :, dst] = data[:, :, src]
        if self.scales is not None:
            self.scales[:, :, dst] = self.scales[:, :, src]
