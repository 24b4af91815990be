"""Decode attention over an fp8 KV cache as a CUDA kernel (``decode_fp8.cu``, package data).

The Triton decode kernel on an fp8 cache reads half the bytes of the bf16 one but takes ~0.76x
its time (docs/kv-cache.md): it issues ~4x the instructions per byte, because the
unpacked codes go through shared memory into the mma operand layout. The CUDA kernel reads
every code straight into its fragment position (the head dimension is permuted for K, the
tokens of each 16-token chunk for V; see the source) and converts it in integer ops. Same
numerics class as the Triton kernel (the fp32 scores and the bf16 probabilities of the dot
products over the dequantized rows, online softmax in base 2), another summation order.

What it takes: head_dim 128, bf16 queries, at most 16 query heads per kv head, a block size
that is a multiple of 16, an sm80+ GPU with NVRTC through torch. :func:`supported` says
whether a call qualifies; the caller keeps the Triton kernel otherwise.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import NamedTuple

import torch

from quarl.quant.kernels import nvrtc_cache
from quarl.quant.kernels.cuda_launch import launch
from quarl.quant.kernels.device import nvrtc_available

HEAD_DIM = 128
MAX_GROUP = 16


class Fp8DecodeConfig(NamedTuple):
    """``warps`` per block (each streams its own tiles), ``stages`` of each warp's cp.async
    ring, ``chunks`` of 16 tokens per tile (one softmax update per tile)."""

    warps: int = 4
    stages: int = 2
    chunks: int = 1

    def smem_bytes(self) -> int:
        tok = 16 * self.chunks
        ring = self.warps * self.stages * (2 * tok * HEAD_DIM + 8 * tok)
        merge = self.warps * (32 + 16 * 4 * 36) * 4
        return max(ring, merge)


@functools.lru_cache(maxsize=1)
def _source() -> str:
    return resources.files(__package__).joinpath("decode_fp8.cu").read_text()


@functools.lru_cache(maxsize=32)
def _kernel(cfg: Fp8DecodeConfig, page: int, two: bool):
    name = f"decode_fp8<{cfg.warps}, {cfg.stages}, {cfg.chunks}, {page}, {'true' if two else 'false'}>"
    kern = nvrtc_cache.compile_kernel(_source(), name, nvcc_options=["-std=c++17"])
    kern.set_shared_memory_config(cfg.smem_bytes())
    return kern


def supported(q: torch.Tensor, k_cache: torch.Tensor, kv_scales: tuple) -> bool:
    """Whether :func:`fp8_decode_attention` takes this call (else the Triton kernel does)."""
    if kv_scales[0] is None or not q.is_cuda or q.dtype != torch.bfloat16 or not nvrtc_available():
        return False
    b, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    return (d == HEAD_DIM and hq % hkv == 0 and hq // hkv <= MAX_GROUP and page % 16 == 0
            and q.stride(2) == 1 and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0
            and k_cache.stride(3) == 1 and all(s % 16 == 0 for s in k_cache.stride()[:3]))


def fp8_decode_attention(q, k_cache, v_cache, kv_scales, block_tables, context_lens, split_len, out, part_out,
                         part_lse, num_splits: int, qk_scale: float, cfg: Fp8DecodeConfig = Fp8DecodeConfig()) -> None:
    """The split-K pass of :func:`quarl.rollout.kernels.paged_decode_attention` on an fp8 cache
    (arguments as there; ``qk_scale`` already times log2(e)): ``out`` with one split, else the
    partials ``part_out`` / ``part_lse`` that the caller merges."""
    b, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    k_scale, v_scale = kv_scales
    if k_scale.stride() != v_scale.stride() or k_scale.stride(2) != 1:
        raise ValueError("fp8 KV scales must be [blocks, block_size, Hkv] with unit head stride, K and V alike")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("the fp8 K and V caches must have the same strides")
    if context_lens.dtype != torch.int32:
        context_lens = context_lens.int()
    if split_len.dtype != torch.int32:
        split_len = split_len.int()
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        block_tables = block_tables.int().contiguous()
    if num_splits == 1:
        part_out = part_lse = out
    kern = _kernel(cfg, page, hq // hkv > 8)
    launch(kern, (b, hkv, num_splits), (32 * cfg.warps, 1, 1), shared_mem=cfg.smem_bytes(), args=[
        q, k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale, v_scale, block_tables, context_lens,
        split_len, out, part_out, part_lse, float(qk_scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        hq // hkv, num_splits,
    ])
