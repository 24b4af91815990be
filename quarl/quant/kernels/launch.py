"""The fast quantized GEMMs, as ``quarl.quant.ops`` and the rollout engine call them.

Each call picks its kernel once (:func:`.dispatch.pick`: a typed plan from the format
family's table) and runs it. Imported only when a fast path runs (it imports triton).
Shapes: ``x [M, K]`` 2-D and contiguous in its last dim; the weight is a
:class:`~quarl.quant.qweight.QuantizedWeight`.
"""

from __future__ import annotations

import torch

from quarl.quant.kernels import act_quant as _aq
from quarl.quant.kernels import cuda_w4, dispatch
from quarl.quant.kernels.act_quant import act_quant_buffers, act_quant_from_partials  # noqa: F401 (engine API)
from quarl.quant.kernels.device import num_sms  # noqa: F401 (engine API)
from quarl.quant.kernels.w4_layout import RepackCache
from quarl.quant.qweight import QuantizedWeight


def act_quant(x: torch.Tensor, act_format: str, dequantized: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """Per-token dynamic quantization ``x [M, K]`` -> ``(q [M, K], scale fp32 [M])`` (and the
    dequantized codes in ``dequantized``, see :func:`.act_quant.act_quant`)."""
    cfg = None if _aq.interpreting(x) else dispatch.act_quant_plan(*x.shape)
    return _aq.act_quant(x, act_format, cfg, dequantized)


def linear_quantized_input(
    xq: torch.Tensor, sx: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """The GEMM of a W8A8 / W4A8 scheme on activations already quantized per token:
    ``act_quant``'s output, or that of a kernel that fused the quantizer into the op
    before (the engine's RMSNorm and SiLU-and-mul)."""
    if qw.scheme.act_format not in ("fp8", "int8"):
        raise ValueError(f"{qw.scheme.name} does not quantize activations")
    return dispatch.pick(qw, xq.shape[0], xq.device).run(xq, sx, qw, bias, out_dtype)


def gated_silu_gemm(
    xq: torch.Tensor, sx: torch.Tensor, qw: QuantizedWeight, out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``silu(g) * u`` of a W8A8 ``[gate; up]`` projection on quantized input, in one GEMM:
    ``(y [M, N / 2], row-max partials)`` for :func:`act_quant_from_partials`; None when no
    gated tile applies (see ``tables.GATED_*``) or TMA cannot describe the operands."""
    if qw.shape[0] % 2:
        raise ValueError(f"a [gate; up] weight has an even number of rows, got {qw.shape[0]}")
    plan = dispatch.pick_gated(qw, xq.shape[0])
    return None if plan is None else plan.run(xq, sx, qw, out_dtype)


def gated_silu_w4a16(x: torch.Tensor, qw: QuantizedWeight, repacked: RepackCache | None = None) -> torch.Tensor | None:
    """``silu(x gate^T) * (x up^T)`` ``[M, I]`` of a w4a16 ``[gate; up]`` weight in one wgmma
    launch (the SiLU-and-mul in its epilogue), or None where the plain GEMM's plan is not the
    wgmma kernel or the gated table declines: the caller then runs the GEMM and the SiLU-and-mul."""
    if qw.shape[0] % 16:
        return None
    dense = repacked is not None and repacked.dense
    plan = dispatch.pick_gated_w4(qw, x.shape[0], x.device, dense)
    if plan is None:
        return None
    return cuda_w4.wgmma_gemm(x if x.is_contiguous() else x.contiguous(), qw, None, plan.config, repacked, gated=True)


def linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
           repacked: RepackCache | None = None, lora=None) -> torch.Tensor:
    """Fast quantized ``x [M, K] @ W.T + bias`` for any quantized scheme, plus ``lora`` (a
    :class:`~quarl.quant.ops.LoRATerm`: in the wgmma w4a16 kernel's epilogue where it fits,
    else one ``addmm`` after). ``repacked``: the weight owner's cache of kernel-specific
    layouts (None: made for this call only)."""
    sc = qw.scheme
    if not x.is_contiguous():
        x = x.contiguous()
    if sc.act_format in ("fp8", "int8"):
        xq, sx = act_quant(x, sc.act_format)
        y = linear_quantized_input(xq, sx, qw, bias, x.dtype)
    else:
        dense = repacked is not None and repacked.dense
        plan = dispatch.pick(qw, x.shape[0], x.device, x.dtype, dense)
        if lora is not None and plan.kernel == "wgmma" and lora.b.shape[0] == qw.shape[0]:
            cfg = plan.config._replace(tma=False)  # (the TMA loop takes no term: the mbarrier loop's sums are its own)
            if cuda_w4.takes_lora(cfg, x, lora):
                return cuda_w4.wgmma_gemm(x, qw, bias, cfg, repacked, lora=lora)
        y = plan.run(x, qw, bias, repacked=repacked)
    return y if lora is None else lora.add_to(y)
