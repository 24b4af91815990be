"""The straight-through backward of an aligned W8A8-fp8 linear with both GEMMs in fp8
(``quant.backward=fp8``).

The forward of an aligned ``w8a8-fp8`` linear runs the engine's GEMM on e4m3 codes:
``y = (xq * sx) @ (Wq * sw).T`` with per-token input scales ``sx [M]`` and per-output-channel
weight scales ``sw [N]``. Its straight-through backward is ``grad_x = gy @ W_deq`` and
``grad_W = gy.T @ x_seen`` (``x_seen = xq * sx``). Both reduce over a dimension that one of
the scales runs along, so that scale moves onto the gradient and the other operand is the
forward's own codes, exactly:

* ``grad_x[m, k] = sum_n (gy[m, n] * sw[n]) * Wq[n, k]``: the gradient times ``sw`` is
  quantized per row ``m`` (e4m3, one fp32 scale a row), the weight's codes are used as they are;
* ``grad_W[n, k] = sum_m (gy[m, n] * sx[m]) * xq[m, k]``: the gradient times ``sx`` is
  quantized per column ``n`` (a row of its transpose), the input's codes as the forward made them.

The only rounding the bf16 backward does not have is that of the gradient to e4m3 (3
mantissa bits, per-row scales: the fine-grained recipe of FP8 training, not per-tensor). The
forward, and so the mismatch with the engine, is unchanged. Each GEMM is a row-wise scaled
``torch._scaled_mm`` (cuBLASLt on Hopper, the same op on CPU): its second operand must be
column-major, so the codes are transposed once per call (one byte an element), and the
tokens, the reduction dimension of ``grad_W``, are zero-padded to a multiple of 16 (cuBLASLt's
fp8 rule; zeros add nothing). Both are written as torch ops around the GEMM, so that in a
compiled region they fuse into the gradient's quantizer and the codes' one copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quarl.quant import reference as ref

# cuBLASLt's fp8 GEMMs want every dimension but the first operand's rows a multiple of 16
_ALIGN = 16


def _scaled_rows_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    r, k = a.shape[1], b.shape[0]
    # the same values through a float32 matmul where cuBLASLt cannot write them: a width it
    # does not take, or an output other than bf16 (its row-scaled fp8 GEMM writes bf16 only)
    if k % _ALIGN or (a.is_cuda and out_dtype != torch.bfloat16):
        return ((a.float() * sa[:, None]) @ b.float().T).to(out_dtype)
    pad = -r % _ALIGN
    if pad:
        a, b = F.pad(a.view(torch.uint8), (0, pad)).view(a.dtype), F.pad(b.view(torch.uint8), (0, pad)).view(b.dtype)
    ones = torch.ones(1, k, dtype=torch.float32, device=a.device)
    return torch._scaled_mm(a.contiguous(), b.contiguous().t(), scale_a=sa[:, None].float(), scale_b=ones,
                            out_dtype=out_dtype)


def _scaled_rows_gemm_fake(a, sa, b, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


# One op for the compiled regions: inside them the rows are an unbacked size, on which the
# meta function of ``aten._scaled_mm`` guards (it asks whether a scale has one element); as an
# opaque op the GEMM and its padding run as written, the gradient's quantizer still fuses.
_LIB = torch.library.Library("quarl", "FRAGMENT")
_LIB.define("fp8_rows_gemm(Tensor a, Tensor sa, Tensor b, ScalarType out_dtype) -> Tensor")
_LIB.impl("fp8_rows_gemm", _scaled_rows_gemm, "CompositeExplicitAutograd")
torch.library.register_fake("quarl::fp8_rows_gemm", _scaled_rows_gemm_fake, lib=_LIB)


def scaled_rows_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * sa[:, None]) @ b.T`` for e4m3 codes ``a [M, R]`` with row scales ``sa [M]`` and
    e4m3 codes ``b [K, R]`` (unscaled): ``[M, K]`` in ``out_dtype``, summed in float32."""
    return torch.ops.quarl.fp8_rows_gemm.default(a, sa, b, out_dtype)


def grad_input(gy: torch.Tensor, w_codes: torch.Tensor, w_scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``gy [M, N] @ (w_codes * w_scales[:, None])`` with ``gy * w_scales`` rounded to e4m3 per
    row: ``grad_x [M, K]`` (``w_codes [N, K]`` e4m3, ``w_scales [N]``)."""
    gq, sg = ref.quantize_activations(gy.float() * w_scales.float()[None, :], "fp8")
    wt = w_codes.view(torch.uint8).t().contiguous().view(w_codes.dtype)  # (the GEMM reads it column-major)
    return scaled_rows_gemm(gq, sg, wt, out_dtype)


def grad_weight(gy: torch.Tensor, x_codes: torch.Tensor, x_scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``gy.T [N, M] @ (x_codes * x_scales[:, None])`` with ``gy * x_scales`` rounded to e4m3 per
    column of ``gy``: ``grad_W [N, K]`` (``x_codes [M, K]`` e4m3, ``x_scales [M]``)."""
    m = gy.shape[0]
    pad = (m + _ALIGN - 1) // _ALIGN * _ALIGN - m  # (tokens padded with zero rows here, where the compiler
    # fuses the padding and the transposes into the quantizer's and the copy's writes)
    g = F.pad(gy.float() * x_scales.float()[:, None], (0, 0, 0, pad))
    gq, sg = ref.quantize_activations(g.t(), "fp8")
    xt = F.pad(x_codes.view(torch.uint8).t(), (0, pad)).contiguous().view(x_codes.dtype)
    return scaled_rows_gemm(gq.contiguous(), sg, xt, out_dtype)
