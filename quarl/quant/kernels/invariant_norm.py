"""Batch-invariant RMSNorm (exact mode), optionally after the residual add.

``y = weight * round(x_f32 * rstd)``, ``rstd = 1 / sqrt(mean(x_f32^2) + eps)``: the steps
and roundings of :func:`quarl.model.transformer.rms_norm`, with the sum of squares taken in
an order that depends only on the row's length. torch's own reduction over the last dim is
not batch-invariant on CUDA: how it splits a row among threads and blocks is chosen from the
number of rows. Here:

* a program owns ``ROWS`` rows (one on a GPU, grid ``(M,)``; 16 in the interpreter) as a
  ``[ROWS, BLOCK]`` tile and walks them in fixed ``BLOCK``-wide chunks from column 0, adding
  each chunk's squares into a ``[ROWS, BLOCK]`` fp32 tile, then one ``tl.sum`` along the rows
  (the same reduction tree for every row: the layout of the tile over ``num_warps`` warps is
  fixed by ROWS, BLOCK and num_warps; rows never mix);
* ``BLOCK``, ``num_warps`` and ``ROWS`` are functions of the row length N only
  (:func:`norm_config`), M is not specialized on;
* ``sqrt_rn`` and an IEEE division for ``rstd`` (correctly rounded, the same on any GPU).

With a residual (``residual + x``, rounded to the model dtype as torch's add rounds) the new
stream is written too; the add is elementwise, and the second pass recomputes it (the same
operation on the same values) rather than reading back what other threads wrote.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quarl.quant.kernels.act_quant import interpreting, next_pow2
from quarl.quant.kernels.invariant import _bf16_rne


def norm_config(n: int, interpret: bool = False) -> tuple[int, int, int]:
    """``(BLOCK, num_warps, ROWS)`` for rows of ``n`` columns, ROWS rows per program. Deliberately
    has no M argument. One row per program on a GPU; 16 in the interpreter, where every tile
    operation costs a fixed ~ms of Python whatever its size (the rows of a tile never mix)."""
    if interpret:
        return min(next_pow2(n), 64), 4, 16
    block = min(next_pow2(n), 4096)
    return block, (4 if block <= 1024 else 8), 1


@triton.jit
def round_to(v, dt: tl.constexpr, INTERP_BF16: tl.constexpr):
    """fp32 ``v`` rounded to the nearest value of ``dt`` (ties to even). INTERP_BF16 (the
    interpreter, whose fp32 -> bf16 cast truncates): rounded in fp32 bits, kept as fp32."""
    if INTERP_BF16:
        return _bf16_rne(v)
    else:
        return v.to(dt).to(tl.float32)


@triton.jit
def _stream_chunk(x_ptr, r_ptr, cols, mask, dt: tl.constexpr, HAS_RES: tl.constexpr, INTERP_BF16: tl.constexpr):
    """One chunk of the row as fp32: ``x``, or ``round_dt(residual + x)``."""
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = round_to(r + x, dt, INTERP_BF16)
    return x


@triton.jit(do_not_specialize=["M"])
def inv_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, r_out_ptr, M, N, eps, stride_x, stride_r, stride_y, stride_ro,
    BLOCK: tl.constexpr, HAS_RES: tl.constexpr, INTERP_BF16: tl.constexpr, ROWS: tl.constexpr,
):
    """Rows ``program_id(0) * ROWS + i``, ``i < ROWS`` (:func:`norm_config`), as one
    ``[ROWS, BLOCK]`` tile whose rows never mix: ``y = w * round_dt(s * rstd)`` with ``s = x``
    (or ``round_dt(residual + x)``, written to ``r_out``); dt is x's dtype."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    dt: tl.constexpr = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    x_rows = x_ptr + rows[:, None] * stride_x
    r_rows = r_ptr + rows[:, None] * stride_r
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for c in range(0, tl.cdiv(N, BLOCK)):  # one fixed order over the row, whatever M
        cols = c * BLOCK + offs
        mask = row_ok[:, None] & (cols < N)[None, :]
        s = _stream_chunk(x_rows, r_rows, cols[None, :], mask, dt, HAS_RES, INTERP_BF16)
        if HAS_RES:
            tl.store(r_out_ptr + rows[:, None] * stride_ro + cols[None, :], s.to(r_out_ptr.dtype.element_ty),
                     mask=mask)
        acc += s * s
    mean = tl.sum(acc, axis=1) / N  # per row: the same [BLOCK] reduction for every row
    rstd = 1.0 / tl.sqrt_rn(mean + eps)
    for c in range(0, tl.cdiv(N, BLOCK)):
        cols = c * BLOCK + offs
        mask = row_ok[:, None] & (cols < N)[None, :]
        s = _stream_chunk(x_rows, r_rows, cols[None, :], mask, dt, HAS_RES, INTERP_BF16)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = w[None, :] * round_to(s * rstd[:, None], dt, INTERP_BF16)
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(x, weight, eps)`` batch-invariant in every row (x ``[..., N]``, weight ``[N]``),
    in ``promote_types(weight.dtype, x.dtype)`` as the module computes it. With ``residual``
    (same shape and dtype as x): ``(rms_norm(residual + x), residual + x)``, the add rounded to
    x's dtype."""
    lead, n = x.shape[:-1], x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} for rows of {n}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} against x {tuple(x.shape)} {x.dtype}")
    x2 = _rows(x)
    m = x2.shape[0]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    interp = interpreting(x)
    # the interpreter's float -> bf16 store truncates: it writes fp32 here (values already
    # rounded to bf16 by the kernel, or rounded once by torch below: RNE as the GPU's store)
    y = torch.empty(m, n, dtype=torch.float32 if interp else out_dtype, device=x.device)
    r2 = _rows(residual) if residual is not None else x2
    r_out = torch.empty(m, n, dtype=torch.float32 if interp else x.dtype, device=x.device) \
        if residual is not None else y
    if m and n:
        block, warps, rows = norm_config(n, interp)
        inv_rms_norm_kernel[(triton.cdiv(m, rows),)](
            x2, r2, weight.contiguous(), y, r_out, m, n, float(eps), x2.stride(0), r2.stride(0), y.stride(0),
            r_out.stride(0), BLOCK=block, HAS_RES=residual is not None,
            INTERP_BF16=interp and x.dtype == torch.bfloat16, ROWS=rows, num_warps=warps,
        )
    y = y.to(out_dtype).view(*lead, n)
    if residual is None:
        return y
    return y, r_out.to(x.dtype).view(*lead, n)
