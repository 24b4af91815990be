"""Paged attention for the model's injected ``attn(layer_idx, q, k, v)`` callable.

A :class:`StepContext` describes one forward (which cache slots the new tokens go to,
each sequence's block table and lengths); :class:`PagedAttention` closes over it and
the cache. Every call first writes the new K/V into their slots, then attends over the
cache: a prefill/extend step packs all new tokens as ``[1, N]``, a decode step has
one token per sequence as ``[B, 1]``. Backends: Triton kernels on GPU
(:mod:`quarl.rollout.kernels`), and a torch loop over sequences (SDPA) on CPU, used
for parity tests. An fp8 cache (:mod:`quarl.quant.kv`) is quantized on the way in and
dequantized on the way out, by both backends, to the same values.

Exact mode (``exact=True``): prefill, extend and decode alike run the batch-invariant kernel
(:func:`quarl.quant.kernels.invariant_attention.invariant_paged_attention`; a decode step is
its case of one new token per sequence, ``cu_seqlens_q = 0, 1, .., B``), on either backend
(on the CPU through Triton's interpreter), the kernel the learner runs over its packed
sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quarl.quant.kv import dequantize_kv, quantize_kv
from quarl.rollout.kv_cache import KVCache


@dataclass
class StepContext:
    """Attention inputs of one forward; tensors on the model's device.

    slot_mapping ``[N]`` int64: cache slot (``block * block_size + offset``) of each new token.
    block_tables ``[S, max_blocks]`` int32; context_lens ``[S]`` int32: tokens of each
    sequence in the cache after this step's writes.
    Prefill: cu_seqlens_q ``[S+1]`` int32 offsets of each sequence's new tokens.
    Decode: split_len ``[1]`` int32 tokens per split of the split-K kernel; in exact mode
    cu_seqlens_q ``0 .. S`` too (one new token per sequence).
    ``host_*`` mirror the lengths on the host for the torch backend.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None = None
    max_seqlen_q: int = 1
    split_len: torch.Tensor | None = None
    num_splits: int = 1
    decode_block_n: int = 64
    decode_warps: int = 4
    decode_kernel: str = "triton"  # or "cuda": the fp8 cache's CUDA kernel (quarl.rollout.fp8_decode)
    host_context_lens: list[int] | None = None
    host_cu_seqlens_q: list[int] | None = None


class PagedAttention:
    """``attn(layer_idx, q, k, v) -> out`` over a paged KV cache for one step."""

    def __init__(self, cache: KVCache, ctx: StepContext, backend: str, exact: bool = False) -> None:
        self.cache = cache
        self.ctx = ctx
        self.backend = backend
        self.exact = exact

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        hkv, d = k.shape[2], k.shape[3]
        slots = self.ctx.slot_mapping
        for x, cache, scales in ((k, self.cache.k[layer_idx], self.cache.k_scale[layer_idx]),
                                 (v, self.cache.v[layer_idx], self.cache.v_scale[layer_idx])):
            rows = x.reshape(-1, hkv, d)
            if scales is None:
                cache.view(-1, hkv, d).index_copy_(0, slots, rows.to(cache.dtype))
            else:  # fp8: codes through a byte view (no index_copy_ for float8)
                codes, s = quantize_kv(rows)
                cache.view(torch.uint8).view(-1, hkv, d).index_copy_(0, slots, codes.view(torch.uint8))
                scales.view(-1, hkv).index_copy_(0, slots, s)
        return self.attend(layer_idx, q)

    @property
    def rope_store(self):
        """Triton backend: ``(layer_idx, q, k, v, cos, sin[, (q_norm, k_norm)]) -> rope(q)``,
        writing rope(k) and v into this step's cache slots in the same launch (then
        :meth:`attend`), q and k first through their RMSNorm modules where given; else None.
        Exact mode takes it too (without the norms): its rotary and its stores are the separate
        kernels' bits."""
        return self._rope_store if self.backend == "triton" else None

    def _rope_store(self, layer_idx: int, q, k, v, cos, sin, qk_norm=None) -> torch.Tensor:
        from quarl.rollout.fused import rope_store_kv

        c = self.cache
        return rope_store_kv(q, k, v, cos, sin, c.k[layer_idx], c.v[layer_idx], self.ctx.slot_mapping,
                             c.k_scale[layer_idx], c.v_scale[layer_idx], qk_norm)

    def attend(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of ``q [B, T, Hq, D]`` over the cache, this step's K/V already in it."""
        b, t, hq, d = q.shape
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        kv_scales = (self.cache.k_scale[layer_idx], self.cache.v_scale[layer_idx])  # (None, None) unless fp8
        scale = d**-0.5
        q_flat = q.reshape(b * t, hq, d)
        if self.exact:
            from quarl.quant.kernels.invariant_attention import invariant_paged_attention

            out = invariant_paged_attention(
                q_flat.contiguous(), k_cache, v_cache, self.ctx.block_tables, self.ctx.cu_seqlens_q,
                self.ctx.context_lens, self.ctx.max_seqlen_q, scale, kv_scales,
            )
        elif self.backend == "triton":
            from quarl.rollout import kernels

            if self.ctx.is_prefill:
                out = kernels.paged_prefill_attention(
                    q_flat, k_cache, v_cache, self.ctx.block_tables, self.ctx.cu_seqlens_q,
                    self.ctx.context_lens, self.ctx.max_seqlen_q, scale, kv_scales=kv_scales,
                )
            else:
                out = self._triton_decode(q_flat, k_cache, v_cache, scale, kv_scales)
        elif self.ctx.is_prefill:
            out = torch_prefill_attention(
                q_flat, k_cache, v_cache, self.ctx.block_tables, self.ctx.host_cu_seqlens_q,
                self.ctx.host_context_lens, scale, kv_scales,
            )
        else:
            out = torch_decode_attention(
                q_flat, k_cache, v_cache, self.ctx.block_tables, self.ctx.host_context_lens, scale, kv_scales
            )
        return out.view(b, t, hq, d)

    def _triton_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                       kv_scales: tuple) -> torch.Tensor:
        from quarl.rollout import kernels

        b, hq, d = q.shape
        splits = self.ctx.num_splits
        out = torch.empty_like(q)
        part_out = part_lse = None
        if splits > 1:
            part_out = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)
            part_lse = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
        return kernels.paged_decode_attention(
            q, k_cache, v_cache, self.ctx.block_tables, self.ctx.context_lens, self.ctx.split_len,
            out, part_out, part_lse, splits, scale, self.ctx.decode_block_n, self.ctx.decode_warps, kv_scales=kv_scales,
            kernel=self.ctx.decode_kernel,
        )


# (k_scale, v_scale) of one layer's fp8 cache: [blocks, block_size, Hkv] float32 each; (None, None) otherwise
KVScales = tuple[torch.Tensor | None, torch.Tensor | None]


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, ...]`` of one sequence from ``cache [blocks, block_size, ...]``."""
    n_blocks = -(-length // cache.shape[1])
    return cache[block_table[:n_blocks].long()].flatten(0, 1)[:length]


def _values(cache: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as attention reads them: fp8 codes dequantized (:func:`dequantize_kv`), else cast."""
    return cache.to(dtype) if scales is None else dequantize_kv(cache, scales, dtype)


def torch_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: list[int],
    kv_lens: list[int],
    scale: float,
    kv_scales: KVScales = (None, None),
) -> torch.Tensor:
    """Reference of :func:`kernels.paged_prefill_attention` (same arguments, host lengths)."""
    out = torch.empty_like(q)
    k_scale, v_scale = kv_scales
    for s, kv_len in enumerate(kv_lens):
        q0, q1 = cu_seqlens_q[s], cu_seqlens_q[s + 1]
        cached = kv_len - (q1 - q0)
        bt = block_tables[s]
        k = _values(_gather(k_cache, bt, kv_len), None if k_scale is None else _gather(k_scale, bt, kv_len), q.dtype)
        v = _values(_gather(v_cache, bt, kv_len), None if v_scale is None else _gather(v_scale, bt, kv_len), q.dtype)
        rows = torch.arange(cached, kv_len, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= rows[:, None]
        o = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        out[q0:q1] = o.transpose(0, 1)
    return out


def torch_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: list[int],
    scale: float,
    kv_scales: KVScales = (None, None),
) -> torch.Tensor:
    """Reference of :func:`kernels.paged_decode_attention`: q ``[B, Hq, D]``.

    All sequences at once: their blocks are gathered into ``[B, L, Hkv, D]`` (L = the
    longest context, rounded up to whole blocks) and positions past each context are
    masked, so one SDPA call serves the batch.
    """
    bs = k_cache.shape[1]
    n_blocks = -(-max(context_lens) // bs)
    idx = block_tables[:, :n_blocks].long()
    k_scale, v_scale = kv_scales
    k = _values(k_cache[idx].flatten(1, 2), None if k_scale is None else k_scale[idx].flatten(1, 2), q.dtype)
    v = _values(v_cache[idx].flatten(1, 2), None if v_scale is None else v_scale[idx].flatten(1, 2), q.dtype)
    lens = torch.tensor(context_lens, device=q.device)
    mask = torch.arange(k.shape[1], device=q.device)[None, :] < lens[:, None]  # [B, L]
    o = F.scaled_dot_product_attention(
        q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True,
    )
    return o[:, :, 0]
