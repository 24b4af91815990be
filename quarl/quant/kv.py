"""The fp8 KV-cache format: one definition for the engine's cache and the learner's attention.

With ``rollout.engine.kv_cache_dtype=fp8`` the engine stores each (token, kv head) row of
K (after the rotary embedding: what the cache holds) and of V as ``D`` float8 e4m3fn codes
plus one float32 scale:

    amax  = max over the row's D values of |x|, in float32        x: the model-dtype row
    s     = 2^ceil(log2(max(amax, KV_AMAX_FLOOR) / 448))           the power of two at or
                                                                   above the IEEE quotient
    code  = e4m3fn(x_fp32 / s)                                     round to nearest even
    value = float32(code) * s, in the model dtype                  what attention reads

448 is e4m3fn's largest finite value, so the row's largest entry maps into (224, 448] and
every entry keeps e4m3's 3 mantissa bits (entries below 2^-7 / 448 of the row maximum fall
into e4m3's subnormal range and keep fewer). The scale is a power of two so that the value
is exact in any model dtype (no second rounding) and so that attention can multiply the
scale in after a dot product with the raw codes with the very same result: the decode
kernels read the codes, convert them (exactly) to the model dtype and scale the scores
and the probabilities instead of every element. The scale is dynamic per row: a token's K/V are quantized once, when
they are written, and never requantized, so the stored value of a token does not depend
on the batch, on later tokens or on the step that wrote it. ``KV_AMAX_FLOOR`` (2^-100)
only matters for rows that are (almost) all zero: their scale stays a normal float32 and
their codes 0.

Cost: ``D + 4`` bytes per (token, kv head) instead of ``2 D`` in bf16 (132 vs 256 at
``D = 128``), so a KV budget holds ~1.9x the tokens, and a decode step reads half the K/V
bytes. In ``aligned`` training the learner's attention sees :func:`fake_quantize_kv` of its
K (after rotary) and V, the very values the engine's attention reads, with a
straight-through gradient; so the cache adds no sampler/learner mismatch there.

Functions (shapes ``[..., D]``; scales ``[...]``):
:func:`quantize_kv` ``x -> (codes e4m3fn, scales fp32)``; :func:`dequantize_kv`
``(codes, scales, dtype) -> x_hat``; :func:`fake_quantize_kv` ``x -> x_hat`` (STE).
The Triton kernels of :mod:`quarl.rollout.fused` (writes) and :mod:`quarl.rollout.kernels`
(reads) reproduce these bit for bit.
"""

from __future__ import annotations

import torch

from quarl.runtime import compiled

KV_CACHE_DTYPES = ("auto", "fp8")  # "auto": the model dtype
KV_FP8_MAX = 448.0  # largest finite float8 e4m3fn
KV_AMAX_FLOOR = 2.0**-100  # keeps a zero row's scale a normal float32 (its codes are 0)
KV_FP8_DTYPE = torch.float8_e4m3fn


def check_kv_cache_dtype(value: str) -> str:
    """``value`` if it names a KV-cache format, else a ValueError that names the fix."""
    if value not in KV_CACHE_DTYPES:
        hint = " (quarl's fp8 cache is e4m3: write 'fp8')" if str(value).lower().startswith("fp8") else ""
        raise ValueError(
            f"kv_cache_dtype must be 'auto' (K/V in the model dtype) or 'fp8' (e4m3 codes with a float32 scale "
            f"per token and kv head), got {value!r}{hint}"
        )
    return value


def kv_scales(x: torch.Tensor) -> torch.Tensor:
    """Scales ``[...]`` float32 of rows ``x [..., D]``: the power of two at or above
    ``max(amax, KV_AMAX_FLOOR) / 448`` (IEEE division, then the exponent rounded up by bits)."""
    amax = x.float().abs().amax(-1).clamp_min(KV_AMAX_FLOOR)
    r = amax / torch.full_like(amax, KV_FP8_MAX)  # tensor / tensor: IEEE division on every device
    bits = r.view(torch.int32)
    exp = bits & 0x7F800000
    return torch.where((bits & 0x007FFFFF) == 0, exp, exp + 0x00800000).view(torch.float32)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [..., D]`` (bf16 / fp16 / fp32) -> ``(codes [..., D] e4m3fn, scales [...] fp32)``.

    ``codes = e4m3fn(x_fp32 / s)`` rounded to nearest even (the quotient is at most 448:
    the clamp only guards torch's cast, which turns values past 448 into NaN)."""
    s = kv_scales(x)
    t = x.float() / s[..., None]
    return t.clamp(-KV_FP8_MAX, KV_FP8_MAX).to(KV_FP8_DTYPE), s


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``float32(codes) * scales[..., None]`` in ``dtype`` (exact: the scale is a power of two):
    what attention reads."""
    return (codes.float() * scales[..., None]).to(dtype)


def _round_trip(x: torch.Tensor) -> torch.Tensor:
    return dequantize_kv(*quantize_kv(x), x.dtype)


class _FakeQuantizeKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fused: bool) -> torch.Tensor:  # type: ignore[override]
        if fused:  # one compiled kernel instead of ~15 elementwise passes over K or V
            # on a fresh contiguous copy without grad: the learner's K and V are views of
            # different strides (a fused projection's slices), with and without grad, and each
            # combination compiled the kernel again (W1-long: a learner step of 18 s, not 7)
            return compiled(_round_trip)(x.detach().clone(memory_format=torch.contiguous_format))
        return _round_trip(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad, None  # straight-through: d x_hat / d x taken as the identity


def kv_seen(x: torch.Tensor) -> torch.Tensor:
    """``fake_quantize_kv(x)`` as plain tensor ops for a compiled region (no autograd function):
    the round trip's value, exactly (``x + (r - x)`` in float32: the difference of two nearby
    bf16 values is exact), with the identity as its gradient."""
    xf = x.float()
    r = dequantize_kv(*quantize_kv(x), torch.float32)
    return (xf + (r - xf).detach()).to(x.dtype)


def fake_quantize_kv(x: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """``dequantize_kv(*quantize_kv(x), x.dtype)`` with a straight-through (identity) gradient:
    the learner's K (after rotary) and V as the engine's fp8 cache gives them back.
    ``fused`` (default: on CUDA): the round trip through ``torch.compile``, the same values."""
    return _FakeQuantizeKV.apply(x, x.is_cuda if fused is None else fused)
