"""Pure-torch reference for every format: the source of truth the kernels must match.

Notation: a linear weight ``w [N, K]`` (``nn.Linear`` layout: N outputs, K inputs),
activations ``x [M, K]``, output ``y = x @ w.T [M, N]``.

Weight formats and their stored tensors (``QuantizedWeight`` fields):

* ``w8a8-int8``: ``qdata int8 [N, K]``, ``scales fp32 [N]``;
  ``s_n = clip * max|w_n| / 127``, ``q = clamp(round(w / s), -127, 127)``, ``w ~ q * s``.
* ``w8a8-fp8``: ``qdata float8_e4m3fn [N, K]``, ``scales fp32 [N]``;
  ``s_n = clip * max|w_n| / 448``, ``q = e4m3(clamp(w / s, +-448))`` (round to nearest even).
* int4 / int2 with groups of G along K (``w4a16``, ``w4a16-asym``, ``w4a8-int8``, ``w2a16``):
  codes are unsigned ``u`` in ``[0, 2^b)``. Symmetric: ``s = clip * max|w_g| / (2^(b-1) - 1)``,
  ``u = clamp(round(w / s), -2^(b-1), 2^(b-1) - 1) + 2^(b-1)``, ``w ~ (u - 2^(b-1)) * s``.
  Asymmetric: ``lo = min(min w_g, 0)``, ``hi = max(max w_g, 0)`` (times clip),
  ``s = (hi - lo) / (2^b - 1)``, ``z = clamp(round(-lo / s), 0, 2^b - 1)``,
  ``u = clamp(round(w / s) + z, 0, 2^b - 1)``, ``w ~ (u - z) * s``.
  ``s`` is then rounded to the nearest bf16 value (:func:`bf16_scale`): vLLM keeps these
  scales in bf16, and the w4a16 wgmma kernel scales weights with one bf16 multiply, both
  exact only on bf16 scales. (A group's extreme may then lie up to 2^-8 of its range past
  the outermost code, which it takes. Symmetric: quantizing a dequantized weight again gives
  the same weight.)
  ``scales fp32 [N, Kp / G]``, ``zeros uint8 [N, Kp / G]`` (asymmetric only).
* ``nvfp4``: e2m1 codes, G = 16. Tensor scale ``t = max|w| / (448 * 6)`` (fp32, stored in
  ``global_scale``), group scale ``g = e4m3(max|w_g| / 6 / t)`` (``scales float8_e4m3fn
  [N, Kp/16]``), ``w ~ e2m1(u) * g * t``.
* ``mxfp4``: e2m1 codes, G = 32, OCP MX scale ``2^(floor(log2 max|w_g|) - 2)`` stored as the
  e8m0 byte ``E = exponent + 127`` (``scales uint8 [N, Kp/32]``, clamped to [1, 254]);
  values beyond 6 x scale saturate to 6 (OCP behaviour).

e2m1 code (4 bits, sign-magnitude): bit 3 sign, bits 2-1 exponent e, bit 0 mantissa m;
magnitude ``m / 2`` if e == 0 else ``(1 + m / 2) * 2^(e - 1)``, i.e. codes 0..7 are
``0, 0.5, 1, 1.5, 2, 3, 4, 6``.

Bit layout of the sub-byte formats. K is zero-padded to ``Kp``, a multiple of
``PACK_K = 128`` (padding quantizes to exact zeros); each row of ``qdata`` is a sequence of
chunks, one per 128 columns of K:

* 4-bit (``qdata uint8 [N, Kp / 2]``): in chunk c, byte ``64 c + j`` (j < 64) holds the code
  of column ``128 c + j`` in bits 0-3 and of column ``128 c + 64 + j`` in bits 4-7.
* 2-bit (``qdata uint8 [N, Kp / 4]``): in chunk c, byte ``32 c + j`` (j < 32) holds the code
  of column ``128 c + 32 i + j`` in bits ``2i .. 2i+1`` for i = 0..3.

Splitting each chunk into contiguous halves (quarters) rather than interleaving
neighbours lets a GEMM kernel unpack a tile with one shift and one mask and multiply it
by a contiguous slice of x: no shuffles.

Activations (``act_format``), per token, dynamic, symmetric, computed in fp32:
``s_m = max|x_m| * fp32(1/127)`` (int8) or ``* fp32(1/448)`` (fp8), 1 for an all-zero row;
``q = clamp(round(x * r), -127, 127)`` or ``e4m3(clamp(x * r, +-448))`` with ``r = fp32(1 / s)``
rounded once per row (vLLM's per-token quantizers multiply by the reciprocal too).

The GEMM each scheme implies is ``y = xq @ wq.T`` with ``xq`` the activations as
quantized and dequantized (x itself for weight-only formats) and ``wq`` the dequantized
weight; :func:`reference_linear` evaluates it (exactly, in float64, when asked).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quarl.quant.scheme import PACK_K, QuantScheme

E4M3_MAX = 448.0
E2M1_MAX = 6.0
INT8_MAX = 127.0

# Magnitudes of e2m1 codes 0..7.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ----------------------------------------------------------------------------- packing
def pad_k(w: torch.Tensor, multiple: int = PACK_K) -> torch.Tensor:
    """Zero-pad the last dim of ``w`` to a multiple of ``multiple``."""
    k = w.shape[-1]
    kp = -(-k // multiple) * multiple
    return w if kp == k else F.pad(w, (0, kp - k))


def pack_4bit(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, Kp]`` (values < 16, Kp % 128 == 0) -> ``[N, Kp / 2]`` (layout above)."""
    n, kp = codes.shape
    c = codes.to(torch.uint8).view(n, kp // PACK_K, 2, PACK_K // 2)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, kp // 2)


def unpack_4bit(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_4bit`: ``[N, Kp / 2]`` -> uint8 codes ``[N, Kp]``."""
    n, half = packed.shape
    p = packed.view(n, half // (PACK_K // 2), 1, PACK_K // 2)
    return torch.cat([p & 0xF, p >> 4], dim=2).reshape(n, 2 * half)


def pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, Kp]`` (values < 4) -> ``[N, Kp / 4]`` (layout above)."""
    n, kp = codes.shape
    c = codes.to(torch.uint8).view(n, kp // PACK_K, 4, PACK_K // 4)
    return (c[:, :, 0] | (c[:, :, 1] << 2) | (c[:, :, 2] << 4) | (c[:, :, 3] << 6)).reshape(n, kp // 4)


def unpack_2bit(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_2bit`: ``[N, Kp / 4]`` -> uint8 codes ``[N, Kp]``."""
    n, quarter = packed.shape
    p = packed.view(n, quarter // (PACK_K // 4), 1, PACK_K // 4)
    return torch.cat([(p >> s) & 0x3 for s in (0, 2, 4, 6)], dim=2).reshape(n, 4 * quarter)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_4bit(codes) if bits == 4 else pack_2bit(codes)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack_4bit(packed) if bits == 4 else unpack_2bit(packed)


# ------------------------------------------------------------------------ number formats
def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (ties to even mantissa, saturating at +-6) of fp32 ``v``; uint8."""
    a = v.abs()
    # Midpoints between grid values; `>` sends a tie down, `>=` up, so that each tie lands
    # on the value with an even mantissa (codes 0, 2, 4, 6).
    mag = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).to(torch.uint8)
    return mag | ((v < 0).to(torch.uint8) << 3)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of e2m1 codes (uint8): one lookup in the 16 signed values (code 8: -0.0)."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    return torch.cat([grid, -grid])[codes.long()]


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """fp32 ``2^(e - 127)`` of e8m0 bytes in [1, 254] (built from the exponent bits)."""
    return (e.to(torch.int32) << 23).view(torch.float32)


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 to e4m3 (nearest even), saturating at +-448."""
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


# ------------------------------------------------------------------------ weight quantizers
def _safe_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    # ``amax * fp32(1 / qmax)``, not ``amax / qmax``: torch on CUDA turns division by a
    # scalar into this multiply anyway, and the Triton quantizer does the same, so CPU,
    # GPU and kernel scales agree bit for bit.
    return torch.where(amax > 0, amax * (1.0 / qmax), torch.ones_like(amax))


def quantize_per_channel(w: torch.Tensor, scheme: QuantScheme) -> dict[str, torch.Tensor]:
    """int8 / e4m3 per output channel: ``qdata [N, K]``, ``scales fp32 [N]``."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1) * scheme.clip_ratio
    if scheme.weight_format == "int":
        s = _safe_scale(amax, INT8_MAX)
        q = torch.round(wf / s[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        s = _safe_scale(amax, E4M3_MAX)
        q = to_e4m3(wf / s[:, None])
    return {"qdata": q, "scales": s}


def bf16_scale(s: torch.Tensor) -> torch.Tensor:
    """Positive fp32 scales rounded to the nearest bf16 value, kept in fp32 (at least the
    smallest positive bf16, 2^-133, so that no scale becomes zero)."""
    return s.bfloat16().float().clamp_min(2.0**-133)


def quantize_int_groups(w: torch.Tensor, scheme: QuantScheme) -> dict[str, torch.Tensor]:
    """int4/int2 groups along K (layout in the module docstring): packed codes, scales, zeros."""
    b, g = scheme.weight_bits, scheme.group_size
    wf = pad_k(w.detach().float())
    n, kp = wf.shape
    wg = wf.view(n, kp // g, g)
    out: dict[str, torch.Tensor] = {}
    if scheme.symmetric:
        half = 2 ** (b - 1)
        s = bf16_scale(_safe_scale(wg.abs().amax(dim=2) * scheme.clip_ratio, half - 1))
        u = torch.round(wg / s[..., None]).clamp(-half, half - 1) + half
    else:
        top = 2**b - 1
        lo = wg.amin(dim=2).clamp(max=0) * scheme.clip_ratio
        hi = wg.amax(dim=2).clamp(min=0) * scheme.clip_ratio
        s = bf16_scale(_safe_scale(hi - lo, top))
        z = torch.round(-lo / s).clamp(0, top)
        u = (torch.round(wg / s[..., None]) + z[..., None]).clamp(0, top)
        out["zeros"] = z.to(torch.uint8)
    out["qdata"] = pack_codes(u.to(torch.uint8).view(n, kp), b)
    out["scales"] = s
    return out


def quantize_fp4(w: torch.Tensor, scheme: QuantScheme) -> dict[str, torch.Tensor]:
    """nvfp4 / mxfp4 (layout and scales in the module docstring)."""
    g = scheme.group_size
    wf = pad_k(w.detach().float())
    n, kp = wf.shape
    wg = wf.view(n, kp // g, g)
    amax = wg.abs().amax(dim=2) * scheme.clip_ratio
    out: dict[str, torch.Tensor] = {}
    if scheme.scale_format == "e4m3":
        t_amax = amax.max()
        t = torch.where(t_amax > 0, t_amax / (E4M3_MAX * E2M1_MAX), torch.ones_like(t_amax))
        gs = to_e4m3(amax / E2M1_MAX / t)
        eff = gs.float() * t
        out["scales"], out["global_scale"] = gs, t
    else:
        _, exp = torch.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1): floor(log2 amax) = exp - 1
        e = torch.where(amax > 0, exp - 1 - 2 + 127, torch.ones_like(exp)).clamp(1, 254).to(torch.uint8)
        eff = e8m0_to_float(e)
        out["scales"] = e
    v = torch.where(eff[..., None] > 0, wg / eff[..., None], torch.zeros_like(wg))
    out["qdata"] = pack_4bit(round_to_e2m1(v).view(n, kp))
    return out


def quantize_tensors(w: torch.Tensor, scheme: QuantScheme) -> dict[str, torch.Tensor]:
    """Reference quantizer: the stored tensors of ``w [N, K]`` under ``scheme``."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    if not scheme.quantizes_weights:
        return {"qdata": w.detach().clone()}
    if scheme.weight_format == "fp4":
        return quantize_fp4(w, scheme)
    if scheme.group_size is None:
        return quantize_per_channel(w, scheme)
    return quantize_int_groups(w, scheme)


def group_scales(
    scheme: QuantScheme, scales: torch.Tensor, global_scale: torch.Tensor | None
) -> torch.Tensor:
    """Effective fp32 scale of every group ``[N, Kp / G]`` (or ``[N]`` per channel)."""
    if scheme.scale_format == "e4m3":
        return scales.float() * global_scale
    if scheme.scale_format == "e8m0":
        return e8m0_to_float(scales)
    return scales


def dequantize_tensors(
    scheme: QuantScheme,
    shape: tuple[int, int],
    qdata: torch.Tensor,
    scales: torch.Tensor | None,
    zeros: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantized ``[N, K]`` in ``dtype`` (computed in fp32, or exactly in fp64 if asked)."""
    n, k = shape
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    if not scheme.quantizes_weights:
        return qdata.to(dtype)
    s = group_scales(scheme, scales, global_scale).to(cdt)
    if not scheme.packed:
        return (qdata.to(cdt) * s[:, None]).to(dtype)
    codes = unpack_codes(qdata, scheme.weight_bits)
    kp = codes.shape[1]
    g = scheme.group_size
    if scheme.weight_format == "fp4":
        vals = e2m1_to_float(codes).to(cdt)
    elif scheme.symmetric:
        vals = codes.to(cdt) - 2 ** (scheme.weight_bits - 1)
    else:
        vals = (codes.view(n, kp // g, g).to(cdt) - zeros[..., None].to(cdt)).view(n, kp)
    w = (vals.view(n, kp // g, g) * s[..., None]).view(n, kp)
    return w[:, :k].to(dtype)


# ---------------------------------------------------------------------------- activations
def quantize_activations(x: torch.Tensor, act_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic quantization of ``x [M, K]``: ``(q [M, K], scale fp32 [M])``.

    ``s = amax(|x_row|) / qmax`` (see ``_safe_scale``), codes ``round(x * fp32(1 / s))``:
    the reciprocal is rounded once per row and each element is one fp32 product, as in
    vLLM's per-token quantizers; the kernels do the same, so codes agree bit for bit (an
    IEEE division per element kept the GPU quantizer instruction-bound).
    ``q`` is int8 for ``"int8"`` and float8_e4m3fn for ``"fp8"``.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    if act_format not in ("int8", "fp8"):
        raise ValueError(f"unknown act_format {act_format!r}")
    s = _safe_scale(amax, INT8_MAX if act_format == "int8" else E4M3_MAX)
    # a division, not ``1.0 / s``: torch.compile (2.11) emits aten.reciprocal as Triton's
    # approximate ``1 / s`` even where it keeps IEEE division (learner regions quantize this way)
    inv = torch.ones_like(s) / s
    t = xf * inv[..., None]
    if act_format == "int8":
        return torch.round(t).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), s
    return to_e4m3(t), s


def fake_quantize_activations(x: torch.Tensor, act_format: str) -> torch.Tensor:
    """``x`` as the quantized GEMM sees it (quantize + dequantize), in x's dtype.

    For weight-only formats this is ``x`` itself.
    """
    if act_format == "none":
        return x
    q, s = quantize_activations(x, act_format)
    return dequantize_activations(q, s, x.dtype)


def dequantize_activations(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-token codes ``q [..., K]`` times scales ``s [...]``, rounded to ``dtype``."""
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(cdt) * s[..., None].to(cdt)).to(dtype)


def reference_linear(
    x: torch.Tensor,
    qw,
    bias: torch.Tensor | None = None,
    exact: bool = False,
    quantize_input: bool = True,
) -> torch.Tensor:
    """The GEMM the scheme implies: ``fake_quant(x) @ dequant(W).T + bias``.

    ``x [..., K]``; ``qw`` a :class:`~quarl.quant.qweight.QuantizedWeight`. Computed in fp32
    (fp64 if ``x`` is fp64 or ``exact``), returned in x's dtype; a scheme that quantizes
    activations runs :func:`codes_linear` on the codes (float64, rounded once: the same
    bits for a row at any M). ``quantize_input=False``:
    ``x`` is already what the GEMM sees (dequantized activation codes).
    """
    fmt = qw.scheme.act_format
    if quantize_input and fmt != "none" and not exact:
        q, s = quantize_activations(x, fmt)
        return codes_linear(q, s, qw, bias, x.dtype)
    cdt = torch.float64 if (exact or x.dtype == torch.float64) else torch.float32
    xs = (fake_quantize_activations(x, fmt) if quantize_input else x).to(cdt)
    y = xs @ qw.dequantize(cdt).T
    if bias is not None:
        y = y + bias.to(cdt)
    return y.to(x.dtype)


def codes_linear(q: torch.Tensor, s: torch.Tensor, qw, bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """The GEMM of a scheme that quantizes activations, on per-token codes ``q [..., K]`` and
    scales ``s [...]`` (:func:`quantize_activations`): ``y = s * (q @ deq(W).T) + bias``, summed
    in float64 and rounded to ``out_dtype`` once.

    Each row's value does not depend on how many rows the GEMM has nor on its summation order:
    every product ``q * deq(W)`` is exact in float64 (an int8 or e4m3 code times an int8 / e4m3 /
    int4 code times an fp32 scale), and so is the sum for w8a8-int8 (integers times one scale
    per row of W: at most 42 significant bits); elsewhere (fp8 codes, int4 group scales) the
    sum rounds, 2^-53 below the float32 rounding that follows (two orders then give two
    float32 values only where the sum lies within that of a float32 rounding midpoint). The
    rollout engine decodes a token with M = its batch while the learner runs M = every token
    of the batch, and an fp32 GEMM's rows change with M (the
    BLAS picks other kernels and blockings): on a model with large activations a 1-ulp change
    in one layer's output moves a code of the next layer's per-token quantizer, and the two
    sides' log-probs part by O(1) within a few layers. Summed this way they agree bit for bit."""
    sc = qw.scheme
    if sc.act_format == "int8" and sc.weight_format == "int" and sc.weight_bits == 8 and sc.group_size is None \
            and q.device.type == "cpu":
        # w8a8-int8: the integer GEMM itself (int32 sums, exact), then both scales; no float64
        # copy of the weight per call (the reference path's cost on the CPU, where it runs)
        acc = torch._int_mm(q.reshape(-1, q.shape[-1]).contiguous(), qw.qdata.T).view(*q.shape[:-1], -1)
        y = acc.to(torch.float64) * (s.to(torch.float64)[..., None] * qw.scales.to(torch.float64))
    else:
        y = (q.to(torch.float64) @ qw.dequantize(torch.float64).T) * s.to(torch.float64)[..., None]
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(out_dtype)


def lora_term_by_member(xa: torch.Tensor, b: torch.Tensor, scaling: float, starts: tuple[int, ...],
                        cols: tuple[int, ...], width: int) -> torch.Tensor:
    """A :class:`~quarl.quant.ops.LoRATerm` summed as the w4a16 wgmma kernel's epilogue sums
    it, in float64: output rows ``starts[i]`` up to the next start take columns ``cols[i] ..
    cols[i] + width`` of ``xa [M, R]`` and ``b [N, R]`` (cut at R), times ``scaling``. Equal to
    ``scaling * xa @ b.T`` when ``b`` is block-diagonal over the members and ``width`` covers
    every member's rank."""
    n, r = b.shape
    out = torch.zeros(xa.shape[0], n, dtype=torch.float64, device=xa.device)
    for lo, hi, c in zip(starts, (*starts[1:], n), cols):
        c1 = min(c + width, r)
        out[:, lo:hi] = scaling * (xa[:, c:c1].double() @ b[lo:hi, c:c1].double().T)
    return out
