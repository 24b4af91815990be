"""Aligned linears as data for the learner's compiled regions: the engine's W8A8 / W4A8 GEMM as
one op (``quarl::quantized_input_gemm``), its straight-through autograd function, and
:func:`traced_linear`, which runs the forms :func:`quarl.quant.linear.traced_qat` and
:func:`quarl.quant.linear.traceable` describe."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quarl.model.lora import add_adapter
from quarl.quant import ops
from quarl.quant import reference as ref
from quarl.quant.qweight import QuantizedWeight
from quarl.quant.scheme import get_scheme

# Defined through torch.library.Library rather than ``torch.library.custom_op``: the latter
# wraps each call in output checks that cost the host ~0.1 ms, per linear and micro-batch.
# The op has no autograd formula of its own: a registered one runs as a Python kernel at every
# call of the compiled forward (~0.1 ms of host each); the straight-through gradient is the
# autograd function below, which the compiler traces into the region's backward instead.
_LIB = torch.library.Library("quarl", "FRAGMENT")
_LIB.define("quantized_input_gemm(Tensor xq, Tensor sx, Tensor? bias, Tensor qdata, Tensor? scales, Tensor? zeros, "
            "str scheme, SymInt n, ScalarType dtype) -> Tensor")


def _quantized_input_gemm_impl(xq: torch.Tensor, sx: torch.Tensor, bias: torch.Tensor | None, qdata: torch.Tensor,
                               scales: torch.Tensor | None, zeros: torch.Tensor | None, scheme: str, n: int,
                               dtype: torch.dtype) -> torch.Tensor:
    """The engine's GEMM of a scheme that quantizes activations (W8A8 / W4A8) on per-token
    codes ``xq [M, K]`` and scales ``sx [M]`` (quantized in the region, :func:`traced_linear`),
    as one op a compiled region can hold: ``[M, n]`` in ``dtype``; ``qdata`` / ``scales`` /
    ``zeros`` are the packed weight."""
    qw = QuantizedWeight(get_scheme(scheme), (n, xq.shape[-1]), qdata, scales, zeros)
    return ops.quant_linear_quantized_input(xq, sx, qw, bias, dtype)


def _quantized_input_gemm_fake(xq, sx, bias, qdata, scales, zeros, scheme, n, dtype):
    return xq.new_empty((xq.shape[0], n), dtype=dtype)


_LIB.impl("quantized_input_gemm", _quantized_input_gemm_impl, "CompositeExplicitAutograd")
torch.library.register_fake("quarl::quantized_input_gemm", _quantized_input_gemm_fake, lib=_LIB)
_quantized_input_gemm = torch.ops.quarl.quantized_input_gemm.default


def _region_gemm(xq: torch.Tensor, sx: torch.Tensor, bias: torch.Tensor | None, qdata: torch.Tensor,
                 scales: torch.Tensor | None, zeros: torch.Tensor | None, scheme: str, n: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """:data:`_quantized_input_gemm`; in a compiled region on a GPU, an fp8 scheme's GEMM is
    called by the region's own code instead: cuBLASLt's row-scaled ``_scaled_mm``, which the
    engine runs from 257 rows on (``tables.FP8``; the learner's micro-batches), with no
    custom-op dispatch on the host. Its shape check needs the row count known not to be 1
    (:class:`~quarl.learner.compiled_ops.CompiledOps` runs one-row batches step by step)."""
    if torch.compiler.is_compiling() and get_scheme(scheme).act_format == "fp8":
        from quarl.quant.kernels.w8a8 import cublas_fits, scaled_rows_mm

        if cublas_fits(xq, n, xq.shape[-1]):
            torch._check(xq.shape[0] != 1)
            return scaled_rows_mm(xq, sx, qdata, scales, bias, dtype)
    return _quantized_input_gemm(xq, sx, bias, qdata, scales, zeros, scheme, n, dtype)


class _QuantizedInputSTE(torch.autograd.Function):
    """The aligned W8A8 / W4A8 linear on ``x [M, K]``: the engine's GEMM on ``x``'s codes
    (:data:`_quantized_input_gemm`), with the straight-through gradient ``grad_x = grad_y @
    W_deq``, ``grad_W = grad_y^T @ x_seen`` (``weight``: the dequantized weight; ``seen``:
    ``x`` as the GEMM sees it)."""

    @staticmethod
    def forward(ctx, x, weight, bias, xq, sx, seen, qdata, scales, zeros, scheme):
        ctx.save_for_backward(weight, seen)
        ctx.has_bias = bias is not None
        return _region_gemm(xq, sx, bias, qdata, scales, zeros, scheme, weight.shape[0], x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        weight, seen = ctx.saved_tensors
        grad_b = grad_y.sum(0) if ctx.has_bias else None
        return grad_y @ weight, grad_y.t() @ seen, grad_b, None, None, None, None, None, None, None


def _straight_through(qw: QuantizedWeight, dtype: torch.dtype, masters: list[torch.Tensor]) -> torch.Tensor:
    """The dequantized weight ``W_deq`` made now, plus zero times the stacked master weights:
    the values of ``W_deq`` exactly (``m - m`` is 0), and a gradient that autograd carries to
    the masters (straight-through), with no hook and no leaf kept between forwards: what a
    sharded learner needs, whose masters are gathered per forward and reduce their gradients
    when the backward reaches them (:func:`~quarl.quant.linear.set_straight_through`)."""
    with torch.no_grad():
        deq = ops.dequantize(qw, dtype)
    stacked = masters[0] if len(masters) == 1 else torch.cat(masters)
    return deq + (stacked - stacked.detach()).to(dtype)


def traced_linear(x: torch.Tensor, lin: tuple, codes: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Run a linear described by :func:`~quarl.quant.linear.traced_qat` or
    :func:`~quarl.quant.linear.traceable` (inside or outside a compiled region). A tuple of
    biases (a group's) is concatenated. ``("dense", W, bias, (A, B, scaling))``: a frozen base
    plus a LoRA adapter, summed as the adapter's ``add_to`` sums them (one ``addmm``).
    ``codes``: a quantized-input linear's per-token codes and scales of ``x``'s rows, made by
    the caller (the values the quantizer below gives)."""
    bias = torch.cat(lin[2]) if isinstance(lin[2], tuple) else lin[2]
    if lin[0] == "dense":
        y = F.linear(x, lin[1], bias)
        return y if len(lin) < 4 else add_adapter(y, x, *lin[3])
    # the engine's per-token quantizer as torch ops (quarl.quant.reference, whose values its
    # kernels give bit for bit): in a compiled region it fuses into the kernel that wrote x
    rows = x.reshape(-1, x.shape[-1])
    xq, sx = codes if codes is not None else ref.quantize_activations(rows.detach(), get_scheme(lin[-1]).act_format)
    seen = ref.dequantize_activations(xq, sx, x.dtype)
    y = _QuantizedInputSTE.apply(rows, lin[1], bias, xq, sx, seen, *lin[3:])
    return y.view(*x.shape[:-1], y.shape[-1])
