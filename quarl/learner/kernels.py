"""Triton kernels of the learner's LM-head log-probabilities (16-bit logits, float32 math).

:func:`logit_stats` reads each row of a ``[N, V]`` block of logits once and returns, for
``x = logits * inv_t`` in float32, the log-sum-exp, the target's log-prob and the
entropy. Each lane of the block keeps its own running max, sum of ``exp(x - max)`` and
sum of ``exp(x - max) * x``; the lanes are merged once at the end, so the loop over the
vocabulary has no cross-lane reduction. Entropy is ``lse - sum(p * x)``.

:func:`logit_grad_` overwrites the logits with ``d logp / d logits``
``= (onehot(target) - softmax(x)) * g * inv_t`` in their own dtype, one pass, from the
saved log-sum-exp. The two replace a dozen full-vocabulary float32 passes of the eager
formulation (cast, scale, max, exp, sum, softmax, scatter, ...).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _logit_stats_kernel(
    logits_ptr, targets_ptr, logp_ptr, lse_ptr, ent_ptr, V, stride, inv_t,
    WANT_ENT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    offs = tl.arange(0, BLOCK)
    m = tl.zeros([BLOCK], dtype=tl.float32) - 1e30
    s = tl.zeros([BLOCK], dtype=tl.float32)
    u = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, x)
        scale = tl.exp(m - m_new)
        e = tl.exp(x - m_new)
        s = s * scale + e
        if WANT_ENT:
            u = u * scale + e * tl.where(cols < V, x, 0.0)
        m = m_new
    big = tl.max(m, axis=0)
    w = tl.exp(m - big)
    total = tl.sum(s * w, axis=0)
    lse = big + tl.log(total)
    tgt = tl.load(targets_ptr + row)
    x_t = tl.load(base + tgt).to(tl.float32) * inv_t
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, x_t - lse)
    if WANT_ENT:
        tl.store(ent_ptr + row, lse - tl.sum(u * w, axis=0) / total)


@triton.jit
def _logit_grad_kernel(logits_ptr, targets_ptr, lse_ptr, g_ptr, V, stride, inv_t, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    ptr = logits_ptr + row * stride + cols
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32) * inv_t
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    tgt = tl.load(targets_ptr + row)
    d = (tl.where(cols == tgt, 1.0, 0.0) - tl.exp(x - lse)) * (g * inv_t)
    tl.store(ptr, d.to(logits_ptr.dtype.element_ty), mask=mask)


def logit_stats(logits: torch.Tensor, targets: torch.Tensor, inv_t: float, want_entropy: bool):
    """``(logp, lse, entropy or None)``, float32 ``[N]``, of ``softmax(logits * inv_t)`` for
    ``logits [N, V]`` (rows contiguous) and ``targets [N]``."""
    n, v = logits.shape
    assert logits.stride(1) == 1
    logp = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if want_entropy else logp
    if n:
        _logit_stats_kernel[(n,)](logits, targets, logp, lse, ent, v, logits.stride(0), float(inv_t),
                                  WANT_ENT=want_entropy, BLOCK=min(_BLOCK, triton.next_power_of_2(v)),
                                  num_warps=8)
    return logp, lse, (ent if want_entropy else None)


def logit_grad_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
                inv_t: float) -> torch.Tensor:
    """Overwrite ``logits [N, V]`` with ``(onehot(targets) - softmax(logits * inv_t)) * grad * inv_t``
    (``lse``, ``grad`` float32 ``[N]``) and return it."""
    n, v = logits.shape
    assert logits.stride(1) == 1
    block = min(_BLOCK, triton.next_power_of_2(v))
    if n:
        _logit_grad_kernel[(n, triton.cdiv(v, block))](logits, targets, lse, grad, v, logits.stride(0),
                                                       float(inv_t), BLOCK=block, num_warps=8)
    return logits
