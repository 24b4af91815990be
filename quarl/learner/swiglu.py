"""SwiGLU on a stacked ``[gate; up]`` projection, with a backward that writes the stacked
gradient in one pass.

An aligned learner runs gate and up as one GEMM (:func:`quarl.quant.linear.qat_group`), so
the gradient of the SwiGLU is wanted as one ``[M, 2 I]`` tensor. Differentiated by the
compiler, the split of the GEMM's output becomes a concatenation, and the fused kernel that
writes it runs far below its memory bandwidth (docs/kernels.md, "Learner kernels").
:class:`StackedSwiGLU` keeps the forward as torch ops (so the compiler still fuses what
follows, such as the next linear's quantizer) and runs its backward as the op
``quarl::swiglu_stacked_backward``: on CUDA a Triton kernel that reads ``gate``, ``up`` and
the output gradient once and writes both halves of the stacked gradient; elsewhere the
same formula in torch ops.

Rounding follows eager autograd on 16-bit tensors: ``silu(gate)`` and ``grad * up`` are
rounded to the input dtype before they are used, as the eager ``silu`` and ``mul``
backward steps round them.

Where the next linear quantizes its input per token (W8A8), :func:`swiglu_codes` makes those
codes from the stacked ``[gate; up]`` rows in one pass on the GPU, instead of the compiler's
row-maximum and code passes over a recomputed SwiGLU.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

_LIB = torch.library.Library("quarl", "FRAGMENT")
_LIB.define("swiglu_stacked_backward(Tensor gate_up, Tensor grad) -> Tensor")


def backward_reference(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The stacked gradient ``[M, 2 I]`` of ``silu(gate) * up`` for ``gate_up [M, 2 I]`` and
    ``grad [M, I]``, in torch ops, rounded as eager autograd rounds it."""
    gate, up = gate_up.chunk(2, dim=-1)
    math = torch.promote_types(gate.dtype, torch.float32)  # 16-bit inputs: float32 math
    g = gate.to(math)
    sig = torch.sigmoid(g)
    silu = (g * sig).to(gate.dtype)
    d_up = grad * silu
    d_silu = (grad * up).to(math)
    d_gate = (d_silu * sig * (1 + g * (1 - sig))).to(gate.dtype)
    return torch.cat([d_gate, d_up.to(gate.dtype)], dim=-1)


def _backward_impl(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    if gate_up.device.type != "cuda":
        return backward_reference(gate_up, grad)
    return backward_triton(gate_up, grad)


def _backward_fake(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty(gate_up.shape)


_LIB.impl("swiglu_stacked_backward", _backward_impl, "CompositeExplicitAutograd")
torch.library.register_fake("quarl::swiglu_stacked_backward", _backward_fake, lib=_LIB)
swiglu_stacked_backward = torch.ops.quarl.swiglu_stacked_backward.default

_BLOCK = 1024


@functools.cache
def _kernel():
    """The Triton kernel, defined at first use (``TRITON_INTERPRET`` is read at definition)."""
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_stacked_backward_kernel(gu_ptr, g_ptr, out_ptr, inter, gu_stride, g_stride, out_stride,
                                       BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0)
        up = tl.load(gu_ptr + row * gu_stride + inter + cols, mask=mask, other=0.0)
        grad = tl.load(g_ptr + row * g_stride + cols, mask=mask, other=0.0)
        dt = gate.dtype
        g = gate.to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        silu = (g * sig).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
        d_up = grad.to(tl.float32) * silu
        d_silu = (grad.to(tl.float32) * up.to(tl.float32)).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
        d_gate = d_silu * sig * (1.0 + g * (1.0 - sig))
        out = out_ptr + row * out_stride + cols
        tl.store(out, d_gate.to(dt, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(out + inter, d_up.to(dt, fp_downcast_rounding="rtne"), mask=mask)

    return swiglu_stacked_backward_kernel


def backward_triton(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """:func:`backward_reference` as one Triton kernel (rows with unit column stride)."""
    import triton

    m, two_i = gate_up.shape
    inter = two_i // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    if grad.stride(-1) != 1:
        grad = grad.contiguous()
    out = torch.empty(m, two_i, dtype=gate_up.dtype, device=gate_up.device)
    if m:
        _kernel()[(m, triton.cdiv(inter, _BLOCK))](gate_up, grad, out, inter, gate_up.stride(0), grad.stride(0),
                                                   out.stride(0), BLOCK=_BLOCK, num_warps=4)
    return out


class StackedSwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of rows ``gate_up [M, 2 I]`` (forward as torch ops), whose
    backward is :data:`swiglu_stacked_backward`."""

    @staticmethod
    def forward(ctx, gate_up):  # type: ignore[override]
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (gate_up,) = ctx.saved_tensors
        return swiglu_stacked_backward(gate_up, grad)


def codes_reference(gate_up: torch.Tensor, act_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token codes and scales (``act_format`` int8 / fp8) of ``silu(gate) * up`` for
    rows ``gate_up [M, 2 I]``, in torch ops (:func:`quarl.quant.reference.quantize_activations`)."""
    from quarl.quant import reference as ref

    gate, up = gate_up.chunk(2, dim=-1)
    return ref.quantize_activations(F.silu(gate) * up, act_format)


def swiglu_codes(gate_up: torch.Tensor, act_format: str, sms: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The next linear's per-token codes and scales (W8A8) of ``silu(gate) * up``, made on a
    GPU by the engine's persistent SiLU-and-mul quantizer in one pass over the stacked rows
    (:func:`quarl.rollout.fused.silu_mul_quant_rows`, ``sms`` its GPU's SM count), so the
    learner quantizes as the engine does; a compiled region traces that launch into its own
    code. ``sms`` None: :func:`codes_reference` (eager CUDA torch gives the kernel's scales, and
    its codes but for an int8 code off by one where the SiLU's last fp32 bit differs)."""
    if sms is None:
        return codes_reference(gate_up, act_format)
    from quarl.rollout.fused import silu_mul_quant_rows

    return silu_mul_quant_rows(gate_up, act_format, sms)


def swiglu_stacked(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of stacked rows ``[M, 2 I]`` -> ``[M, I]`` (:class:`StackedSwiGLU`)."""
    return StackedSwiGLU.apply(gate_up)
