"""An MoE layer's routing in one launch: softmax, top-k and renormalisation of the router logits.

:func:`quarl.model.moe.route` runs it as torch ops: a float32 softmax, ``torch.topk`` (two
kernels on a GPU: a radix select and a sort of the k winners), the sum of the k
probabilities, the division and the cast back to the model's dtype: six launches per layer,
about 1 ms of a 13 ms decode step of Qwen3-30B-A3B at batch 64 on an H100 (48 layers; the
top-k's two kernels alone 0.6 ms; ``quarl bench rollout --profile-kernels``). Here one
program takes ``BLOCK_T`` rows: each row's logits in registers (E <= 256 experts), the softmax
in float32 (max, exponentials, sum, one division per probability, as torch's), then k rounds
of "largest probability, the lowest expert id among equal ones" (route's rule: descending,
ties by id), each winner masked out for the next round, and the k probabilities divided by
their sum when ``norm_topk_prob``.

Same experts and, up to the last bits of the float32 softmax (a sum over 128 values in
another order), the same weights as the torch ops: the engine takes it for its own decode
and prefill (:class:`~quarl.rollout.fused.FusedOps`), never exact mode's engine, whose
routing must be the learner's op for op. No autograd (the learner's router needs gradients:
it keeps the torch ops).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quarl.quant.kernels.act_quant import interpreting

MAX_EXPERTS = 256  # a row of logits in registers


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, N, E, stride_l,
                  TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < N
    live = row_ok[:, None] & (cols < E)[None, :]
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + cols[None, :], mask=live,
                other=float("-inf")).to(tl.float32)
    m = tl.where(row_ok, tl.max(x, axis=1), 0.0)  # (rows past N: zeros, never stored)
    ex = tl.where(live, tl.exp(x - m[:, None]), 0.0)
    p = ex / tl.where(row_ok, tl.sum(ex, axis=1), 1.0)[:, None]
    work = tl.where(live, p, -1.0)  # (probabilities are >= 0: a padded column never wins)
    ks = tl.arange(0, BLOCK_K)  # (k rounded up to a power of two; the ranks past k stay unused)
    top_p = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(work, axis=1)
        idx = tl.min(tl.where(work == best[:, None], cols[None, :], BLOCK_E), axis=1)
        top_p = tl.where(ks[None, :] == j, best[:, None], top_p)
        top_i = tl.where(ks[None, :] == j, idx[:, None], top_i)
        work = tl.where(cols[None, :] == idx[:, None], -1.0, work)
    if NORM:  # (the ranks past k hold 0)
        top_p = top_p / tl.sum(top_p, axis=1)[:, None]
    at = rows[:, None].to(tl.int64) * TOP_K + ks[None, :]
    out_ok = row_ok[:, None] & (ks < TOP_K)[None, :]
    tl.store(w_ptr + at, top_p.to(w_ptr.dtype.element_ty), mask=out_ok)
    tl.store(ids_ptr + at, top_i.to(tl.int64), mask=out_ok)


def route_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [N, k] in dtype, expert ids [N, k] int64)`` of router ``logits [N, E]``, as
    :func:`quarl.model.moe.route` computes them without replayed experts (module doc)."""
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [tokens, experts], not {tuple(logits.shape)}")
    n, e = logits.shape
    if e > MAX_EXPERTS or not 0 < top_k <= e:
        raise ValueError(f"route_topk takes 1 <= top_k ({top_k}) <= experts ({e}) <= {MAX_EXPERTS}")
    weights = torch.empty(n, top_k, dtype=dtype, device=logits.device)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    if n:
        block_e = max(16, triton.next_power_of_2(e))
        block_t = 4 if interpreting(logits) else max(1, 2048 // block_e)
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        _route_kernel[(triton.cdiv(n, block_t),)](
            logits, weights, ids, n, e, logits.stride(0),
            TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), NORM=norm_topk_prob, BLOCK_T=block_t,
            BLOCK_E=block_e, num_warps=4,
        )
    return weights, ids
