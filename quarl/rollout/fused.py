"""Fused elementwise kernels for the engine's GPU forward (fewer, larger launches).

A decode step of a small model at batch 256 is dominated by dozens of tiny elementwise
launches per layer (RMSNorm's six, rotary's ten, SiLU-and-mul, residual adds). These
kernels do each group in one pass and reproduce the reference's bf16 rounding steps
(``quarl.model.transformer``): RMSNorm in float32 then cast, then times the weight;
rotary as ``bf16(bf16(x*cos) + bf16(rot(x)*sin))``; ``bf16(bf16(silu(g)) * u)``; residual
adds in the activation dtype. Launched without FMA contraction (``NO_FMA``), they equal
torch's ops bit for bit on the H200 (with contraction ~25% of rotary outputs differed). :class:`FusedOps` runs the
model's own ``hidden_states`` loop over them, for the engine's GPU path only; the CPU
path and the learner run the same loop over the model's modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from quarl.model.lora import LoRALinear
from quarl.model.moe import SparseMoeBlock
from quarl.model.transformer import AttnFn, TorchOps, Transformer
from quarl.quant import ops
from quarl.quant.linear import QuantLinear, stackable
from quarl.quant.qweight import QuantizedWeight, concat_quantized
from quarl.quant.kernels import launch
from quarl.quant.kernels.w4_layout import RepackCache
from quarl.quant.kernels.launch import act_quant_buffers, act_quant_from_partials
from quarl.quant.kernels.device import pdl
from quarl.quant.kernels.triton_kernels import (
    act_inv_scale, act_scale, e4m3_code, silu_mul_value, store_act_codes, wait_ahead,
)


# Launch option of every kernel here: no contraction of a rounded product and an add into
# one FMA. With Triton's default fusion, ``bf16(x * cos) + bf16(rot * sin)`` compiled to
# ``fma.rn.bf16`` (one rounding): ~25% of rotary outputs differed from the learner's torch
# ops on the H200 (PTX checked); the reference rounds each product.
NO_FMA = {"enable_fp_fusion": False}


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, s_ptr, n_cols, eps, stride_x, stride_r, stride_o,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr, IS_FP8: tl.constexpr,
                    PDL: tl.constexpr):
    wait_ahead(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(x_ptr.dtype.element_ty)
    if QUANT:  # per-token codes of y (the quantizer of quarl.quant, fused): y never goes to memory
        yf = y.to(tl.float32)
        s = act_scale(tl.max(tl.abs(yf), 0), IS_FP8)
        tl.store(s_ptr + row, s)
        store_act_codes(out_ptr + row * stride_o + cols, yf, act_inv_scale(s), mask, IS_FP8)
    else:
        tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            quant: str | None = None):
    """``weight * norm(x)`` over the last dim; with ``residual``: ``s = x + residual``
    is written back into ``residual`` and ``weight * norm(s)`` returned.

    ``quant="int8" | "fp8"``: instead of the normed rows, their per-token codes and fp32
    scales ``(q [rows, n], s [rows])``, the very values ``quarl.quant``'s activation
    quantizer gives for the normed rows (for the W8A8 GEMM that reads them next)."""
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    rows = x2.shape[0]
    block = triton.next_power_of_2(n)
    if quant is None:
        out = torch.empty_like(x2)
        out_arg, s = out, out
    else:
        out, out_arg, s = act_quant_buffers(rows, n, quant, x.device)
    r2 = residual.view(-1, n) if residual is not None else x2
    _rmsnorm_kernel[(rows,)](x2, r2, weight, out_arg, r2, s, n, eps, x2.stride(0), r2.stride(0), out.stride(0),
                             HAS_RES=residual is not None, BLOCK=block, QUANT=quant is not None, IS_FP8=quant == "fp8",
                             num_warps=min(8, max(1, block // 256)), **NO_FMA, **pdl(x.device))
    return out.view(shape) if quant is None else (out, s)


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, t, stride_ct, HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token ``t``'s cos / sin halves as ``[1, BLOCK_D]`` fp32 rows."""
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    c1 = tl.load(cos_ptr + t * stride_ct + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_ct + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_ct + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    return c1, c2, s1, s2


@triton.jit
def _rope_values(x_ptr, stride_xh, n_heads, c1, c2, s1, s2, dt: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, nw_ptr, eps, NORM: tl.constexpr):
    """Rotate one token's ``n_heads`` rows (``x_ptr`` at its first head): the halves
    y1 = x1*c1 + (-x2)*s1, y2 = x2*c2 + x1*s2 ``[BLOCK_H, BLOCK_D]`` in ``dt``, each product and
    the sum rounded to ``dt`` as in torch (0 off the mask), and the mask. NORM: each row first
    through its RMSNorm (weight ``nw_ptr [2 HALF]``, Qwen3's q / k norm), rounded as
    :func:`_rmsnorm_kernel` rounds (the normed row, then its product with the weight)."""
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = (heads < n_heads)[:, None] & (d < HALF)[None, :]
    base = x_ptr + heads[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(nw_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(nw_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2 * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    y1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    y2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    return y1, y2, m


@triton.jit
def _rope_heads(x_ptr, stride_xh, out_ptr, stride_oh, n_heads, c1, c2, s1, s2, dt: tl.constexpr,
                HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, nw_ptr, eps, NORM: tl.constexpr):
    """:func:`_rope_values` of one token's rows, stored at ``out_ptr`` (its first head) in out's dtype."""
    y1, y2, m = _rope_values(x_ptr, stride_xh, n_heads, c1, c2, s1, s2, dt, HALF, BLOCK_H, BLOCK_D, nw_ptr, eps,
                             NORM)
    st = out_ptr.dtype.element_ty
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    obase = out_ptr + heads[:, None] * stride_oh + d[None, :]
    tl.store(obase, y1.to(st), mask=m)
    tl.store(obase + HALF, y2.to(st), mask=m)


# quarl.quant.kv: scale = max(amax, KV_AMAX_FLOOR) / 448, codes e4m3(x / scale)
_KV_AMAX_FLOOR = tl.constexpr(2.0**-100)


@triton.jit
def _kv_fp8_scale(amax):
    """Per-row scale: the power of two at or above ``max(amax, 2^-100) / 448`` (IEEE
    division, then the exponent bits rounded up; as quarl.quant.kv.kv_scales)."""
    r = tl.math.div_rn(tl.maximum(amax, _KV_AMAX_FLOOR), tl.full(amax.shape, 448.0, tl.float32))
    bits = r.to(tl.int32, bitcast=True)
    e = bits & 0x7F800000
    return tl.where((bits & 0x007FFFFF) == 0, e, e + 0x00800000).to(tl.float32, bitcast=True)


@triton.jit
def _kv_fp8_codes(x, s):
    """e4m3 bytes of fp32 rows ``x [H, BLOCK]`` under their scales ``s [H]``: ``e4m3(x / s)``."""
    return e4m3_code(tl.math.div_rn(x, s[:, None] + tl.zeros_like(x))).to(tl.uint8)


@triton.jit
def _store_k_fp8(y1, y2, m, codes_ptr, scale_ptr, n_heads, D: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token's rotated K halves (``_rope_values``) as fp8 codes at ``codes_ptr [H, D]`` and
    scales at ``scale_ptr [H]``: the row maximum spans both halves."""
    a1, a2 = tl.abs(y1.to(tl.float32)), tl.abs(y2.to(tl.float32))
    s = _kv_fp8_scale(tl.maximum(tl.max(a1, 1), tl.max(a2, 1)))
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    base = codes_ptr + heads[:, None] * D + d[None, :]
    tl.store(base, _kv_fp8_codes(y1.to(tl.float32), s), mask=m)
    tl.store(base + HALF, _kv_fp8_codes(y2.to(tl.float32), s), mask=m)
    tl.store(scale_ptr + heads, s, mask=heads < n_heads)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_heads, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, t, stride_ct, HALF, BLOCK_D)
    _rope_heads(x_ptr + t * stride_xt, stride_xh, out_ptr + t * stride_ot, stride_oh, n_heads, c1, c2, s1, s2,
                out_ptr.dtype.element_ty, HALF, BLOCK_H, BLOCK_D, x_ptr, 0.0, False)


@triton.jit
def _rope_store_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,
                          qn_ptr, kn_ptr, q_eps, k_eps,
                          n_q, n_kv, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
                          stride_ot, stride_oh, D: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                          BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                          KV_FP8: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr):
    """One token: rotated q into ``qo``; rotated k and v into the paged caches' slot of the
    token (``[slots, n_kv, D]`` contiguous), in the cache dtype; the rotation rounds as
    ``_rope_kernel`` with q's dtype. KV_FP8: the caches are e4m3 bytes and the token's
    per-head scales go to ``ks`` / ``vs`` (``[slots, n_kv]``), as quarl.quant.kv.quantize_kv.
    QK_NORM: q's and k's rows through their RMSNorms (weights ``qn`` / ``kn``) before the
    rotation (Qwen3: two launches and their strided copies fewer per layer)."""
    wait_ahead(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    dt = qo_ptr.dtype.element_ty
    c1, c2, s1, s2 = _cos_sin(cos_ptr, sin_ptr, t, stride_ct, HALF, BLOCK_D)
    _rope_heads(q_ptr + t * stride_qt, stride_qh, qo_ptr + t * stride_ot, stride_oh, n_q, c1, c2, s1, s2, dt, HALF,
                BLOCK_HQ, BLOCK_D, qn_ptr, q_eps, QK_NORM)
    heads = tl.arange(0, BLOCK_HKV)
    d = tl.arange(0, BLOCK_DV)
    m = (heads < n_kv)[:, None] & (d < D)[None, :]
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=m, other=0.0)
    v_dst = vc_ptr + slot * (n_kv * D) + heads[:, None] * D + d[None, :]
    if KV_FP8:
        y1, y2, km = _rope_values(k_ptr + t * stride_kt, stride_kh, n_kv, c1, c2, s1, s2, dt, HALF, BLOCK_HKV,
                                  BLOCK_D, kn_ptr, k_eps, QK_NORM)
        _store_k_fp8(y1, y2, km, kc_ptr + slot * (n_kv * D), ks_ptr + slot * n_kv, n_kv, D, HALF, BLOCK_HKV,
                     BLOCK_D)
        vf = v.to(tl.float32)
        vs = _kv_fp8_scale(tl.max(tl.abs(vf), 1))
        tl.store(v_dst, _kv_fp8_codes(vf, vs), mask=m)
        tl.store(vs_ptr + slot * n_kv + heads, vs, mask=heads < n_kv)
    else:
        _rope_heads(k_ptr + t * stride_kt, stride_kh, kc_ptr + slot * (n_kv * D), D, n_kv, c1, c2, s1, s2, dt, HALF,
                    BLOCK_HKV, BLOCK_D, kn_ptr, k_eps, QK_NORM)
        tl.store(v_dst, v.to(vc_ptr.dtype.element_ty), mask=m)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[N, H, D]`` (any strides with unit last), cos/sin ``[N, D]`` in x's dtype -> new ``[N, H, D]``."""
    n, h, d = x.shape
    out = torch.empty((n, h, d), dtype=x.dtype, device=x.device)
    _rope_kernel[(n,)](x, cos, sin, out, h, x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1),
                       HALF=d // 2, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d // 2),
                       num_warps=4, **NO_FMA)
    return out


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  qk_norm: tuple[nn.Module, nn.Module] | None = None) -> torch.Tensor:
    """``rope(q, cos, sin)``, with ``rope(k, cos, sin)`` and ``v`` written into the paged
    caches at ``slots`` in one launch (what ``rope`` twice and two ``index_copy_`` do):
    q / k / v ``[N, H, D]`` (unit last stride), caches ``[..., Hkv, D]`` contiguous,
    slots ``[N]`` (``block * block_size + offset``). An fp8 cache (float8_e4m3fn, with
    ``k_scale`` / ``v_scale [..., Hkv]`` float32 contiguous) gets the codes and scales of
    :func:`quarl.quant.kv.quantize_kv` of rope(k) and v, bit for bit. ``qk_norm``: the q and k
    RMSNorm modules (Qwen3), applied first in the same launch: ``rope(rmsnorm(q))`` and
    ``rope(rmsnorm(k))`` with :func:`rmsnorm`'s rounding steps (its sum of squares in another
    order: equal to the last bit of the normed values but for rare ties of rounding)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    fp8 = k_scale is not None
    if fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    else:
        k_scale = v_scale = k_cache  # unused
    qn, kn = qk_norm if qk_norm is not None else (None, None)
    if n:
        _rope_store_kv_kernel[(n,)](
            q, k, v, cos, sin, out, k_cache, v_cache, k_scale, v_scale, slots,
            q if qn is None else qn.weight, q if kn is None else kn.weight,
            0.0 if qn is None else float(qn.eps), 0.0 if kn is None else float(kn.eps), hq, hkv,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            out.stride(0), out.stride(1),
            D=d, HALF=d // 2, BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HKV=triton.next_power_of_2(hkv),
            BLOCK_D=triton.next_power_of_2(d // 2), BLOCK_DV=triton.next_power_of_2(d), KV_FP8=fp8,
            QK_NORM=qk_norm is not None, num_warps=4, **NO_FMA, **pdl(q.device),
        )
    return out


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, amax_ptr, n_cols, stride_g, stride_u, stride_o,
                     BLOCK: tl.constexpr, WITH_AMAX: tl.constexpr, PDL: tl.constexpr):
    """Grid ``(rows, column blocks)``; WITH_AMAX: also the block's ``max |y|`` per row, to
    ``amax [rows, column blocks]`` (the partials ``act_quant_from_partials`` reduces)."""
    wait_ahead(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = out_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = silu_mul_value(g, u, dt)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
    if WITH_AMAX:
        tl.store(amax_ptr + row * tl.num_programs(1) + tl.program_id(1), tl.max(tl.abs(y.to(tl.float32)), axis=0))


@triton.jit
def _silu_mul_quant_rows_kernel(g_ptr, u_ptr, y_ptr, q_ptr, s_ptr, rows, n_cols, stride_g, stride_u, stride_q,
                                IS_FP8: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Persistent SiLU-and-mul + per-token quantizer for many rows: program ``p`` takes rows
    ``p, p + P, ...``. Pass 1 streams the row's g and u once (marked evict-first), writes
    ``y`` to the program's own scratch row ``y_ptr[p]`` (marked evict-last) and keeps the
    running ``max |y|``; pass 2 reads ``y`` back from that scratch row, just written and
    reused for every row, and writes the codes. One launch and one grid instead of two (the
    scratch rows need not stay in L2 for this to pay; docs/kernels.md)."""
    wait_ahead(PDL)
    pid = tl.program_id(0)
    dt = y_ptr.dtype.element_ty
    scratch = y_ptr + pid.to(tl.int64) * n_cols
    offs = tl.arange(0, BLOCK)
    for row in range(pid, rows, tl.num_programs(0)):
        r = tl.full([], row, tl.int64)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + offs
            m = cols < n_cols
            g = tl.load(g_ptr + r * stride_g + cols, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
            u = tl.load(u_ptr + r * stride_u + cols, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
            y = silu_mul_value(g, u, dt)
            tl.store(scratch + cols, y, mask=m, eviction_policy="evict_last")
            amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
        s = act_scale(tl.max(amax, axis=0), IS_FP8)
        tl.store(s_ptr + r, s)
        inv_s = act_inv_scale(s)
        tl.debug_barrier()  # the row's y, written by all threads, is read back by others
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + offs
            m = cols < n_cols
            v = tl.load(scratch + cols, mask=m, other=0.0).to(tl.float32)
            store_act_codes(q_ptr + r * stride_q + cols, v, inv_s, m, IS_FP8)
        tl.debug_barrier()  # every thread is done reading before the next row overwrites it


# Rows from which silu_mul(quant=) runs the persistent kernel on the GPU, its programs per
# SM, columns per block and warps: below that row count the two-kernel path is as fast
# (the sweeps behind these numbers: docs/kernels.md, "Rollout engine kernels").
SILU_QUANT_ROWS_MIN = 512
SILU_QUANT_ROWS_CONFIG = dict(per_sm=4, block=4096, num_warps=16)


def _silu_mul_quant_rows(g2: torch.Tensor, u2: torch.Tensor, quant: str, per_sm: int, block: int, num_warps: int,
                         sms: int | None = None):
    """The persistent kernel's launch. ``sms``: the GPU's SM count, given by a caller that
    runs this inside a ``torch.compile`` region (the compiler traces the launch itself)."""
    rows, n = g2.shape
    q, q_arg, s = act_quant_buffers(rows, n, quant, g2.device)
    progs = min(rows, per_sm * (launch.num_sms(g2.device) if sms is None else sms))
    scratch = torch.empty(progs, n, dtype=g2.dtype, device=g2.device)
    _silu_mul_quant_rows_kernel[(progs,)](g2, u2, scratch, q_arg, s, rows, n, g2.stride(0), u2.stride(0), q.stride(0),
                                          IS_FP8=quant == "fp8", BLOCK=block, num_warps=num_warps, **NO_FMA,
                                          **pdl(g2.device))
    return q, s


def silu_mul(g: torch.Tensor, u: torch.Tensor, quant: str | None = None, persistent: bool | None = None):
    """``silu(g) * u`` with the reference's rounding (g, u ``[..., I]``); with
    ``quant="int8" | "fp8"`` its per-token codes and scales ``(q [rows, I], s [rows])``
    (as :func:`rmsnorm`). Below ``SILU_QUANT_ROWS_MIN`` rows (or ``persistent=False``) the
    SiLU-and-mul writes ``y`` and per-block row maxima, then a parallel pass quantizes
    ``y`` (one program per row would leave most SMs idle at decode batch sizes); from there on
    (prefill, the learner's batches) the persistent :func:`_silu_mul_quant_rows_kernel`
    does both in one launch (GPU only)."""
    n = g.shape[-1]
    g2, u2 = g.reshape(-1, n), u.reshape(-1, n)
    rows = g2.shape[0]
    if persistent is None:
        persistent = rows >= SILU_QUANT_ROWS_MIN and g.device.type == "cuda"
    if quant is not None and persistent:
        return _silu_mul_quant_rows(g2, u2, quant, **SILU_QUANT_ROWS_CONFIG)
    out = torch.empty_like(g2)
    block = 1024 if g.device.type == "cuda" else 64
    grid = (rows, triton.cdiv(n, block))
    amax = torch.empty(grid, dtype=torch.float32, device=g.device) if quant is not None else out
    if rows:
        _silu_mul_kernel[grid](g2, u2, out, amax, n, g2.stride(0), u2.stride(0), out.stride(0),
                               BLOCK=block, WITH_AMAX=quant is not None, num_warps=4, **NO_FMA, **pdl(g2.device))
    if quant is not None:
        return act_quant_from_partials(out, amax, quant)
    return out.view(g.shape)


def silu_mul_quant_rows(gate_up: torch.Tensor, quant: str, sms: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token codes and scales of ``silu(gate) * up`` for stacked rows ``gate_up [M, 2 I]``
    in one launch of the persistent kernel, written so that a ``torch.compile`` region traces
    the launch into its own code (the learner's W8A8 down projection,
    :func:`quarl.learner.swiglu.swiglu_codes`): no custom-op dispatch on the host."""
    inter = gate_up.shape[-1] // 2
    return _silu_mul_quant_rows(gate_up[:, :inter], gate_up[:, inter:], quant, **SILU_QUANT_ROWS_CONFIG, sms=sms)


def silu_mul_for(fused_gu: "FusedLinear", h, quant: str | None):
    """The MLP's ``silu(gate) * up`` for down_proj from a fused gate/up projection: plain
    rows, or (``quant`` set: down_proj quantizes its input) ``(codes, scales)``. A W8A8
    gate/up on quantized input (``h`` a tuple) runs the gated GEMM (SiLU-and-mul in its
    epilogue) where its dispatch allows; otherwise the GEMM, then :func:`silu_mul`."""
    if quant is not None and isinstance(h, tuple) and fused_gu.bias is None:
        gated = ops.gated_silu_quantized_input(h[0], h[1], fused_gu.weight, h[2])
        if gated is not None:
            return act_quant_from_partials(*gated, quant)
    if quant is None and not isinstance(h, tuple) and fused_gu.bias is None and fused_gu.adapters is None \
            and isinstance(fused_gu.weight, QuantizedWeight):  # w4a16: the wgmma kernel's gated epilogue
        gated = ops.gated_silu_weight_only(h, fused_gu.weight, fused_gu.repacked)
        if gated is not None:
            return gated
    gu = fused_gu(h)
    inter = gu.shape[-1] // 2
    return silu_mul(gu[:, :inter], gu[:, inter:], quant=quant)


class FusedLinear:
    """One GEMM standing in for several linears that read the same input.

    ``weight`` is the ``[sum N, K]`` buffer (a tensor for plain linears, a
    ``QuantizedWeight`` for quantized ones) whose row blocks are the modules' own
    parameters/buffers, so loading a module's weights by name writes straight into it.

    ``adapters``: the members' LoRA adapters as one :class:`GroupAdapter` (None without any);
    it adds into the fused output in place. Its input is the plain rows, so the fused GEMM
    then takes plain rows too (``act_format`` None)."""

    def __init__(self, weight, bias: torch.Tensor | None, adapters: "GroupAdapter | None" = None) -> None:
        self.weight, self.bias = weight, bias
        self.adapters = adapters
        self.act_format = None if adapters is not None else act_format_of(weight)
        self.repacked = RepackCache()  # kernel layouts of a quantized fused weight

    def __call__(self, x) -> torch.Tensor:
        """``x``: the input rows, or ``(codes, scales, out_dtype)`` already quantized for a
        W8A8 scheme (:func:`rmsnorm` with ``quant=self.act_format``)."""
        if isinstance(self.weight, torch.Tensor):
            y = F.linear(x, self.weight, self.bias)
        elif isinstance(x, tuple):
            return ops.quant_linear_quantized_input(*x[:2], self.weight, self.bias, x[2])
        elif isinstance(self.adapters, GroupAdapter):  # the w4a16 kernel adds the adapters in its epilogue
            return ops.quant_linear(x, self.weight, self.bias, self.repacked, self.adapters.term(x))
        else:
            y = ops.quant_linear(x, self.weight, self.bias, self.repacked)
        if self.adapters is not None:
            self.adapters.add_into(y, x)
        return y


# Activation formats whose quantizer runs inside the engine's RMSNorm / SiLU-and-mul
# (codes equal act_quant's bit for bit on the H200 once FMA contraction is off, NO_FMA).
FUSED_QUANTIZERS = ("int8", "fp8")


def act_format_of(weight) -> str | None:
    """The activation format when a GEMM on ``weight`` takes its input quantized by the
    kernel before it (see ``FUSED_QUANTIZERS``), else None."""
    fmt = getattr(getattr(weight, "scheme", None), "act_format", "none")
    return fmt if fmt in FUSED_QUANTIZERS else None


def _concat_param_as_views(mods: list[nn.Module], name: str) -> torch.Tensor | None:
    """Concatenate the modules' parameter ``name`` along dim 0 and make each module's
    parameter a row-block view of the result (None when the modules have none)."""
    if getattr(mods[0], name) is None:
        return None
    fused = torch.cat([getattr(m, name).detach() for m in mods], 0)
    row = 0
    for m in mods:
        n = m.out_features
        setattr(m, name, nn.Parameter(fused[row : row + n], requires_grad=False))
        row += n
    return fused


def _concat_as_views(mods: list[nn.Linear]) -> FusedLinear:
    """One ``[sum N, K]`` weight (and bias) whose row blocks become the modules' parameters.

    The modules keep their names and shapes, so in-place weight loading writes straight
    into the fused buffer and one GEMM serves them all.
    """
    return FusedLinear(_concat_param_as_views(mods, "weight"), _concat_param_as_views(mods, "bias"), _adapters(mods))


class GroupAdapter:
    """The LoRA adapters of a fused group's members as two GEMMs for the whole group.

    The members read the same input, so their ``A`` matrices are stacked into one
    ``[sum r, K]`` buffer (one shrink GEMM) and their ``B`` matrices are the diagonal blocks
    of one ``[sum N, sum r]`` buffer, zero elsewhere and in the rows of members without an
    adapter, so one ``addmm`` adds every member's ``scaling * B (A x)`` into its columns of
    the fused output (one rounding, as ``LoRAAdapter.add_to``). Each adapter's ``A`` and
    ``B`` become views of their blocks, so a publish by name writes straight into the
    buffers. A decode step then runs two small GEMMs per group instead of two per member
    (they are latency-bound: at batch 64 each costs a few microseconds whatever its size).
    """

    def __init__(self, members: list[tuple[int, int, "nn.Module"]], rows: int) -> None:
        """``members``: ``(first row, last row, adapter)`` of each adapted member; ``rows``:
        the fused output's width."""
        first = members[0][2]
        ranks = [ad.rank for _, _, ad in members]
        self.scaling = first.scaling
        self.rank = max(ranks)
        # the members' first output rows (the first from row 0: rows of no member are zero in B)
        # and first columns of A / B, as a LoRATerm describes them
        self.starts = (0, *(lo for lo, _, _ in members[1:]))
        self.cols = tuple(sum(ranks[:i]) for i in range(len(ranks)))
        with torch.no_grad():
            self.A = torch.cat([ad.A.detach() for _, _, ad in members], 0)
            self.B = first.B.new_zeros(rows, sum(ranks))
            col = 0
            for (lo, hi, ad), r in zip(members, ranks):
                self.B[lo:hi, col : col + r].copy_(ad.B.detach())
                grad = ad.A.requires_grad
                ad.A = nn.Parameter(self.A[col : col + r], requires_grad=grad)
                ad.B = nn.Parameter(self.B[lo:hi, col : col + r], requires_grad=grad)
                col += r

    def add_into(self, y: torch.Tensor, x: torch.Tensor) -> None:
        y.addmm_(F.linear(x, self.A), self.B.t(), alpha=self.scaling)

    def term(self, x: torch.Tensor) -> ops.LoRATerm:
        """The adapters on rows ``x`` as a GEMM's LoRA term (the shrink run, the expand left to the GEMM)."""
        return ops.LoRATerm(F.linear(x, self.A), self.B, self.scaling, self.rank, self.starts, self.cols)


class _MemberAdapters:
    """A group whose adapters cannot share buffers (their scalings or dtypes differ): each adds
    into its member's columns with its own ``add_into``."""

    def __init__(self, members: list[tuple[int, int, "nn.Module"]]) -> None:
        self.members = members

    def add_into(self, y: torch.Tensor, x: torch.Tensor) -> None:
        for lo, hi, ad in self.members:
            ad.add_into(y[:, lo:hi], x)


def _adapters(mods: list[nn.Module]) -> "GroupAdapter | _MemberAdapters | None":
    """The members' LoRA adapters, batched for the group (None when no member has one)."""
    members, row = [], 0
    for m in mods:
        ad = getattr(m, "lora", None)
        if ad is not None:
            members.append((row, row + m.out_features, ad))
        row += m.out_features
    if not members:
        return None
    if len({(ad.scaling, ad.A.dtype, ad.B.dtype, ad.A.device) for _, _, ad in members}) == 1:
        return GroupAdapter(members, row)
    return _MemberAdapters(members)


def _concat_quantized_as_views(mods: list) -> FusedLinear:
    """The ``QuantLinear`` version: every packed tensor (codes, per-row scales, zero points)
    is concatenated along N and each module's buffers become views of its row block.
    The modules are told their fused owner and row offset, so that an in-place load into
    one of them also refreshes what kernels derive from the fused weight (the w4 fragment
    copy) for those rows."""
    fields = mods[0]._fields
    fused = concat_quantized([m.qweight for m in mods])
    tensors = fused.tensors()
    group = FusedLinear(fused, _concat_param_as_views(mods, "bias"), _adapters(mods))
    row = 0
    for m in mods:
        n = m.out_features
        for f in fields:
            setattr(m, f, tensors[f][row : row + n])
        m._fused_owner = (group, row)
        row += n
    return group


def _fusable(mods: list[nn.Module]) -> str | None:
    """"plain", "quant" or None (mixed types, schemes, biases, or a per-tensor scale)."""
    if len({m.bias is None for m in mods}) != 1:
        return None
    if all(type(x) in (nn.Linear, LoRALinear) for x in mods):
        return "plain"
    return "quant" if stackable(mods, QuantLinear, adapters=True) else None


def fuse_projections(model: Transformer) -> int:
    """Back q/k/v and gate/up of each layer by one buffer each.

    Decode at rollout batch sizes is launch- and tile-bound on these small GEMMs: one
    ``[q+k+v]`` and one ``[2 I]`` product per layer replace five. Plain linears and
    ``QuantLinear`` groups of one scheme are fused (the quantized formats here keep their
    scales per output row, so concatenating rows gives the same products); nvfp4 (one
    tensor scale per module) and mixed groups are left alone, and so are an MoE layer's experts
    (already one stacked weight per projection). Returns the number of fused groups.
    """
    count = 0
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        groups = [("qkv", a, [a.q_proj, a.k_proj, a.v_proj])]
        if not isinstance(m, SparseMoeBlock):
            groups.append(("gate_up", m, [m.gate_proj, m.up_proj]))
        for name, owner, mods in groups:
            if hasattr(owner, f"_fused_{name}"):
                count += 1
                continue
            kind = _fusable(mods)
            if kind is None:
                continue
            setattr(owner, f"_fused_{name}",
                    _concat_as_views(mods) if kind == "plain" else _concat_quantized_as_views(mods))
            count += 1
    return count


def supports_fused(model: Transformer) -> bool:
    cfg = model.config
    return cfg.hidden_act == "silu" and cfg.head_dim % 2 == 0


class FusedOps(TorchOps):
    """The steps of ``Transformer.hidden_states`` over the fused kernels (same weights, same
    rounding steps as :class:`~quarl.model.transformer.TorchOps`), on 2-D ``[B*T, H]`` rows.

    W8A8: the per-token quantizer of the fused q/k/v, gate/up and down GEMMs runs inside
    the RMSNorm / SiLU-and-mul kernel before them (same codes, one launch fewer each); the
    paged attention's ``rope_store`` rotates q / k and writes K / V in one launch.
    """

    def norm(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None, consumer: nn.Module | None):
        if residual is None:  # the embeddings start the residual stream
            residual = x.reshape(-1, x.shape[-1]).clone()
            src, add_into = residual, None
        else:
            src, add_into = x, residual  # the kernel adds x into the stream in place
        linear = getattr(consumer, "_fused_qkv", getattr(consumer, "_fused_gate_up", None))
        fmt = linear.act_format if linear is not None else None
        if fmt is None:
            return rmsnorm(src, norm.weight, norm.eps, add_into), residual
        q, s = rmsnorm(src, norm.weight, norm.eps, add_into, quant=fmt)
        return (q, s, residual.dtype), residual

    def attention(self, a: nn.Module, h, cos: torch.Tensor, sin: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        b, t = cos.shape[:2]
        cos, sin = cos.reshape(b * t, -1), sin.reshape(b * t, -1)
        fused_qkv = getattr(a, "_fused_qkv", None)
        if fused_qkv is not None:
            qkv = fused_qkv(h)
            nq, nkv = a.n_heads * a.head_dim, a.n_kv * a.head_dim
            q = qkv[:, :nq].view(b * t, a.n_heads, a.head_dim)
            k = qkv[:, nq : nq + nkv].view(b * t, a.n_kv, a.head_dim)
            v = qkv[:, nq + nkv :].view(b * t, a.n_kv, a.head_dim)
        else:
            q = a.q_proj(h).view(b * t, a.n_heads, a.head_dim)
            k = a.k_proj(h).view(b * t, a.n_kv, a.head_dim)
            v = a.v_proj(h).view(b * t, a.n_kv, a.head_dim)
        rope_store = getattr(attn, "rope_store", None)  # the engine's paged attention: one launch
        qk_norm = (a.q_norm, a.k_norm) if a.q_norm is not None else None
        if rope_store is not None:  # (Qwen3's q / k norms in the same launch)
            q = rope_store(a.layer_idx, q, k, v, cos, sin, qk_norm)
            out = attn.attend(a.layer_idx, q.view(b, t, a.n_heads, a.head_dim))
        else:
            if qk_norm is not None:
                q = rmsnorm(q, a.q_norm.weight, a.q_norm.eps)
                k = rmsnorm(k, a.k_norm.weight, a.k_norm.eps)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            out = attn(a.layer_idx, q.view(b, t, a.n_heads, a.head_dim), k.view(b, t, a.n_kv, a.head_dim),
                       v.reshape(b, t, a.n_kv, a.head_dim))
        return a.o_proj(out.reshape(b * t, -1))

    def mlp(self, mlp: nn.Module, h) -> torch.Tensor:
        if isinstance(mlp, SparseMoeBlock):  # its own forward on the rows (``norm`` gave plain rows: no fused gate/up),
            return mlp(h, fused_route=True)  # its routing in one launch
        fused_gu = getattr(mlp, "_fused_gate_up", None)
        if fused_gu is None:
            return mlp.down_proj(silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
        down = mlp.down_proj  # its quantizer runs in the SiLU-and-mul kernel, unless an adapter needs plain rows
        down_fmt = None if getattr(down, "lora", None) is not None else act_format_of(getattr(down, "qweight", None))
        y = silu_mul_for(fused_gu, h, down_fmt)
        if down_fmt is not None:
            return ops.quant_linear_quantized_input(*y, down.qweight, down.bias, h_dtype(h))
        return down(y)


FUSED_OPS = FusedOps()


def h_dtype(h) -> torch.dtype:
    """The activation dtype of ``h``: a tensor, or a quantized ``(codes, scales, dtype)``."""
    return h[2] if isinstance(h, tuple) else h.dtype
