"""Triton kernels of the engine's LoRA adapters at decode batch sizes.

An adapter adds ``scaling * B (A x)`` to its base's output. At decode sizes (M <= 64 rows)
both products are tiny and latency-bound: as cuBLAS GEMMs the shrink ``x A^T`` runs split-K
plus a reduce kernel and the expand an ``addmm``, three launches and their gaps per adapter
group. Here each is one kernel:

- :func:`lora_shrink`: ``h[M, R] += x[M, K] A[R, K]^T`` in float32, the K range split across
  programs whose partial products are added atomically into ``h`` (zeroed by the caller):
  one launch, no reduce kernel.
- :func:`lora_expand`: ``y[M, N] = y + scaling * bf16(h) B^T`` in place, one rounding of the
  sum (as ``addmm``). ``h`` is rounded to the model dtype first, as the learner's
  ``F.linear(x, A)`` rounds it, so engine and learner differ only in summation order.
  ``B`` is a fused group's block-diagonal ``[sum N, sum r]`` buffer (``GroupAdapter``):
  each column block of ``y`` belongs to one member, whose ``r`` columns of ``B`` alone are
  read (``segments``); members without an adapter are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quarl.quant.kernels.device import num_sms

MAX_M = 64  # rows (decode batch) the kernels take; larger batches keep cuBLAS
MAX_SEGMENTS = 4


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, M, K, R, stride_xm, stride_am, k_per_split,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < k_hi
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & kmask[None, :], other=0.0)
        a = tl.load(a_ptr + offs_r[None, :] * stride_am + offs_k[:, None],
                    mask=(offs_r[None, :] < R) & kmask[:, None], other=0.0)
        acc += tl.dot(x, a)
    tl.atomic_add(h_ptr + offs_m[:, None] * R + offs_r[None, :], acc,
                  mask=(offs_m[:, None] < M) & (offs_r[None, :] < R))


@triton.jit
def _expand_kernel(y_ptr, h_ptr, b_ptr, M, N, R, stride_ym, stride_bn, scaling,
                   start1, start2, start3, col0, col1, col2, col3,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RANK: tl.constexpr):
    pid_n = tl.program_id(0)
    n0 = pid_n * BLOCK_N
    # the member this column block belongs to (blocks never straddle two: see _block_n)
    seg = (n0 >= start1).to(tl.int32) + (n0 >= start2).to(tl.int32) + (n0 >= start3).to(tl.int32)
    col = tl.where(seg == 0, col0, tl.where(seg == 1, col1, tl.where(seg == 2, col2, col3)))
    if col >= 0:
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, RANK)
        mmask = offs_m < M
        nmask = offs_n < N
        h = tl.load(h_ptr + offs_m[:, None] * R + col + offs_r[None, :], mask=mmask[:, None], other=0.0)
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + col + offs_r[:, None], mask=nmask[None, :], other=0.0)
        prod = tl.dot(h.to(b.dtype), b)
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        ymask = mmask[:, None] & nmask[None, :]
        y = tl.load(y_ptrs, mask=ymask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + scaling * prod).to(y_ptr.dtype.element_ty), mask=ymask)


def applies(x: torch.Tensor) -> bool:
    """Whether an adapter's products on the rows ``x`` run as these kernels: the engine's
    decode (a GPU, no autograd, at most ``MAX_M`` contiguous rows)."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_M and x.stride(1) == 1
            and not torch.is_grad_enabled())


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, triton.next_power_of_2(n))


def lora_shrink(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ a[R, K]^T`` in float32 (``M <= MAX_M``), one launch."""
    m, k = x.shape
    r = a.shape[0]
    h = torch.zeros(m, r, device=x.device, dtype=torch.float32)
    block_m, block_r, block_k = _pow2_at_least(m, 16), 64 if r > 32 else _pow2_at_least(r, 16), 128
    r_blocks = triton.cdiv(r, block_r)
    k_blocks = triton.cdiv(k, block_k)
    # enough programs to fill the GPU about twice, each over whole BLOCK_K slices
    split = max(1, min(k_blocks, (2 * num_sms(x.device)) // r_blocks))
    k_per_split = triton.cdiv(k_blocks, split) * block_k
    split = triton.cdiv(k, k_per_split)
    _shrink_kernel[(r_blocks, split)](x, a, h, m, k, r, x.stride(0), a.stride(0), k_per_split,
                                      BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    return h


def _block_n(starts: list[int], n: int) -> int | None:
    """The widest column block (<= 128) that divides every member's first row, or None."""
    for bn in (128, 64, 32, 16):
        if all(s % bn == 0 for s in starts):
            return bn
    return None


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scaling: float,
                segments: list[tuple[int, int]], rank: int) -> None:
    """``y += scaling * bf16(h) @ b^T`` in place over the members' column ranges:
    ``segments`` are ``(first row of y's member, its first column in h and b, or -1 for a
    member without an adapter)``, in order; every adapter has ``rank`` columns."""
    m, n = y.shape
    starts = [s for s, _ in segments]
    block_n = _block_n(starts, n)
    if block_n is None or len(segments) > MAX_SEGMENTS:
        raise ValueError(f"members starting at rows {starts} have no common column block")
    pad = MAX_SEGMENTS - len(segments)
    row_starts = starts[1:] + [n] * pad
    cols = [c for _, c in segments] + [-1] * pad
    _expand_kernel[(triton.cdiv(n, block_n),)](
        y, h, b, m, n, h.shape[1], y.stride(0), b.stride(0), float(scaling), *row_starts, *cols,
        BLOCK_M=_pow2_at_least(m, 16), BLOCK_N=block_n, RANK=rank, num_warps=4)


def expandable(segments: list[tuple[int, int]], rank: int) -> bool:
    """Whether :func:`lora_expand` takes these members: a common column block and a rank
    ``tl.dot`` can use (a power of two from 16 up)."""
    return (len(segments) <= MAX_SEGMENTS and _block_n([s for s, _ in segments], 0) is not None
            and rank >= 16 and rank & (rank - 1) == 0)


def add_into(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> bool:
    """One adapter's ``y += scaling * B (A x)`` in place through the kernels, if they apply
    (:func:`applies`, a rank they take); False, and ``y`` untouched, if not."""
    rows = x.reshape(-1, x.shape[-1])
    rank = a.shape[0]
    if not (applies(rows) and y.is_contiguous() and expandable([(0, 0)], rank)):
        return False
    lora_expand(y.view(-1, y.shape[-1]), lora_shrink(rows, a), b, scaling, [(0, 0)], rank)
    return True
