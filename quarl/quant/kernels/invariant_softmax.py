"""Batch-invariant log-softmax over the vocabulary (exact mode): per row of logits, the
log-sum-exp of ``x = logits * inv_t`` (fp32; ``inv_t`` one scalar for every row, or one value
per row), the log-prob of one chosen token and, if asked, the entropy of the distribution.

The engine reports ``x[token] - logsumexp(x)`` for the tokens it samples and the learner
recomputes the same quantity over packed sequences; both call :func:`invariant_token_logprobs`
on logits from the batch-invariant LM head GEMM (:func:`.invariant.dense_gemm`), so a token
gets the same bits on both sides. torch's ``logsumexp`` is not batch-invariant on CUDA (its
reduction's split over threads and blocks is chosen from the number of rows).

How: one program per row (grid ``(R,)``) walks the vocabulary in fixed ``BLOCK``-wide chunks
from column 0, keeping per lane a running max ``m`` and a running sum of ``exp(x - m)``
(rescaled whenever the lane's max grows), and for the entropy a running sum of
``exp(x - m) * x``; at the end the lanes are combined in one fixed tree (``tl.max`` /
``tl.sum`` of ``[BLOCK]`` vectors). BLOCK and num_warps are functions of the vocabulary size
only (:func:`softmax_config`); the number of rows is not specialized on. Lanes that have only
seen masked columns keep ``m = -inf`` and contribute 0.

``lse = M + log(S)``, ``logp = x[target] - lse``, ``entropy = lse - T / S`` with ``M`` the
row max, ``S = sum exp(x - M)`` and ``T = sum exp(x - M) x``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quarl.quant.kernels.act_quant import interpreting, next_pow2


def softmax_config(v: int, interpret: bool = False) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for rows of ``v`` logits. Deliberately has no row-count argument."""
    if interpret:
        return min(next_pow2(v), 128), 4
    return min(next_pow2(v), 2048), 8


@triton.jit
def _lane_update(m, s, t, x, mask, WANT_ENT: tl.constexpr):
    """Fold one chunk ``x [BLOCK]`` (masked lanes -inf) into the lanes' running max ``m``, sum
    ``s`` of ``exp(x - m)`` and (WANT_ENT) sum ``t`` of ``exp(x - m) * x``."""
    m_new = tl.maximum(m, x)
    base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane with nothing yet: no inf - inf
    alpha = tl.exp(m - base)
    e = tl.exp(x - base)
    s = s * alpha + e
    if WANT_ENT:
        t = t * alpha + e * tl.where(mask, x, 0.0)
    return m_new, s, t


@triton.jit(do_not_specialize=["R"])
def inv_logsoftmax_kernel(
    logits_ptr, tgt_ptr, inv_t_ptr, logp_ptr, lse_ptr, ent_ptr, R, V, stride_l, stride_t,
    BLOCK: tl.constexpr, WANT_ENT: tl.constexpr,
):
    """Row ``program_id(0)`` of ``logits [R, V]``: lse, the target's log-prob and the entropy.
    The row's fp32 ``1 / T`` is read from ``inv_t_ptr + row * stride_t`` (stride 0: one for all
    rows), the same load and multiply whether the caller has one temperature or one per row."""
    row = tl.program_id(0).to(tl.int64)
    inv_t = tl.load(inv_t_ptr + row * stride_t)
    offs = tl.arange(0, BLOCK)
    base_ptr = logits_ptr + row * stride_l
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    t = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, tl.cdiv(V, BLOCK)):  # one fixed order over the vocabulary, whatever R
        cols = c * BLOCK + offs
        mask = cols < V
        x = tl.load(base_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        m, s, t = _lane_update(m, s, t, x, mask, WANT_ENT)
    big = tl.max(m, axis=0)
    w = tl.exp(m - big)  # lanes with m = -inf: 0
    total = tl.sum(s * w, axis=0)
    lse = big + tl.log(total)
    tgt = tl.load(tgt_ptr + row)
    x_tgt = tl.load(base_ptr + tgt).to(tl.float32) * inv_t
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, x_tgt - lse)
    if WANT_ENT:
        tl.store(ent_ptr + row, lse - tl.sum(t * w, axis=0) / total)


def invariant_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, inv_t: float | torch.Tensor = 1.0,
                             with_entropy: bool = False) -> tuple[torch.Tensor, ...]:
    """``(logp, lse)`` (and with ``with_entropy`` the entropy), fp32 ``[...]``, of
    ``log_softmax(logits.float() * inv_t)`` at ``targets``: logits ``[..., V]`` (any float
    dtype), targets ``[...]`` integer. ``inv_t``: a Python float (rounded to fp32, as a
    float32 tensor of the same value holds it) for every row, or a tensor of one value per
    row (``[...]``, the rows' ``1 / T``: the engine's per-request temperatures). Each row's
    values depend on that row (and its ``inv_t``) only."""
    lead, v = logits.shape[:-1], logits.shape[-1]
    if targets.shape != lead:
        raise ValueError(f"targets {tuple(targets.shape)} for logits {tuple(logits.shape)}")
    x = logits.reshape(-1, v)
    x = x if x.stride(-1) == 1 else x.contiguous()
    tgt = targets.reshape(-1).to(torch.int64).contiguous()
    r = x.shape[0]
    inv = _row_inv_t(inv_t, r, x.device)
    logp = torch.empty(r, dtype=torch.float32, device=x.device)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if with_entropy else lse
    if r and v:
        block, warps = softmax_config(v, interpreting(x))
        inv_logsoftmax_kernel[(r,)](
            x, tgt, inv, logp, lse, ent, r, v, x.stride(0), inv.stride(0), BLOCK=block, WANT_ENT=with_entropy,
            num_warps=warps,
        )
    out = (logp.view(lead), lse.view(lead))
    return out + (ent.view(lead),) if with_entropy else out


def _row_inv_t(inv_t: float | torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """fp32 ``[rows]`` (a stride-0 view of one value for a scalar) of the rows' ``1 / T``."""
    if not isinstance(inv_t, torch.Tensor):
        return torch.tensor([float(inv_t)], dtype=torch.float32, device=device).expand(rows)
    if inv_t.numel() == 1:
        return inv_t.reshape(1).to(device=device, dtype=torch.float32).expand(rows)
    if inv_t.numel() != rows:
        raise ValueError(f"{inv_t.numel()} temperatures for {rows} rows of logits")
    return inv_t.reshape(rows).to(device=device, dtype=torch.float32).contiguous()
