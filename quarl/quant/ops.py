"""``quant_linear``: the one GEMM entry point that QuantLinear and QATLinear both call.

Backend choice (``set_backend`` / ``use_backend`` / env ``QUARL_QUANT_BACKEND``):
``"auto"`` (default) runs the Triton/cuBLAS fast paths for bf16/fp16 inputs on CUDA and
the pure-torch reference otherwise; ``"triton"`` forces the kernels (on CPU tensors this
needs ``TRITON_INTERPRET=1``: that is how the CPU tests check them); ``"reference"``
forces the reference everywhere.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, NamedTuple

import torch
import torch.nn.functional as F

from quarl.quant import reference as ref
from quarl.quant.kernels import triton_available
from quarl.quant.kernels.w4_layout import RepackCache
from quarl.quant.qweight import QuantizedWeight

BACKENDS = ("auto", "triton", "reference")
# A plain global, not a ContextVar: the learner's compiled regions call the fast-path check
# while being traced, where a module global reads as a constant. None until first asked: then
# set from env QUARL_QUANT_BACKEND (read at first use, not at import) unless set_backend ran.
_backend: str | None = None


def set_backend(name: str) -> None:
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}")
    _backend = name


def get_backend() -> str:
    if _backend is None:
        set_backend(os.environ.get("QUARL_QUANT_BACKEND", "auto"))
    return _backend


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    old = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(old)


def uses_fast_path(x: torch.Tensor) -> bool:
    return _fast(x.device, x.dtype)


def _fast(device: torch.device, dtype: torch.dtype) -> bool:
    backend = get_backend()
    if backend == "reference" or not triton_available():
        return False
    if backend == "triton":
        return True
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


class LoRATerm(NamedTuple):
    """What LoRA adapters add to a base GEMM's output ``y [M, N]``: ``scaling * xa @ b.T``.

    ``xa = x @ A.T`` (``[M, R]``, the shrink, already computed) and ``b [N, R]``; for a fused
    group's adapters ``b`` is block-diagonal: member i owns the output rows from ``starts[i]``
    (``starts[0] == 0``) and the columns ``cols[i] .. cols[i] + rank`` of ``xa`` and ``b``, its
    rows zero elsewhere. ``rank``: the widest member's. The Hopper w4a16 kernel adds the term
    in its epilogue (one launch instead of two, the sum rounded once); elsewhere it is one
    ``addmm`` after the GEMM, as :func:`quarl.model.lora.add_adapter` sums."""

    xa: torch.Tensor
    b: torch.Tensor
    scaling: float
    rank: int
    starts: tuple[int, ...] = (0,)
    cols: tuple[int, ...] = (0,)

    def add_to(self, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus the term, as one ``addmm`` over rows (the sum ``quarl.model.lora.add_expand``
        makes; not imported from there: that module imports this one)."""
        rows = torch.addmm(y.reshape(-1, y.shape[-1]), self.xa, self.b.t(), alpha=self.scaling)
        return rows.view(y.shape)


def quant_linear(
    x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, repacked: RepackCache | None = None,
    lora: LoRATerm | None = None,
) -> torch.Tensor:
    """``y [..., N] = Q_act(x) [..., K] @ deq(W).T + bias`` with the scheme's kernel, plus the
    LoRA term ``lora`` (rows of ``x``) if given. ``repacked``: the cache of kernel-specific
    weight layouts kept by the weight's owner (``QuantLinear`` and ``QATLinear`` pass theirs;
    None: made for this call only)."""
    if not qw.scheme.quantizes_weights:
        y = F.linear(x, qw.qdata.to(x.dtype), None if bias is None else bias.to(x.dtype))
    elif not uses_fast_path(x):
        y = ref.reference_linear(x, qw, bias)
    else:
        from quarl.quant.kernels import launch

        lead = x.shape[:-1]
        y = launch.linear(x.reshape(-1, x.shape[-1]), qw, bias, repacked, lora)
        return y.view(*lead, y.shape[-1])
    return y if lora is None else lora.add_to(y)


def _fast_quantized_input(xq: torch.Tensor) -> bool:
    backend = get_backend()
    return backend != "reference" and triton_available() and (backend == "triton" or xq.is_cuda)


def dequantize_activations(xq: torch.Tensor, sx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-token codes ``xq [M, K]`` times scales ``sx [M]`` in ``dtype``: one Triton pass
    where the quantized-input GEMM runs its kernels and ``dtype`` is 16-bit, the reference
    otherwise (the same values)."""
    if dtype in (torch.bfloat16, torch.float16) and _fast_quantized_input(xq) and xq.is_contiguous():
        from quarl.quant.kernels.act_quant import act_dequant

        return act_dequant(xq, sx, dtype)
    return ref.dequantize_activations(xq, sx, dtype)


def quant_linear_quantized_input(
    xq: torch.Tensor, sx: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`quant_linear` for activations already quantized per token (``xq [M, K]``
    int8 / e4m3 codes, ``sx [M]`` fp32 scales, as ``quantize_activations`` makes them):
    the same kernel, minus its quantizer. The reference path is
    :func:`~quarl.quant.reference.codes_linear` (the value :func:`quant_linear` gives off the
    fast path, bit for bit)."""
    if qw.scheme.act_format not in ("int8", "fp8"):
        raise ValueError(f"{qw.scheme.name} does not quantize activations; call quant_linear")
    if _fast_quantized_input(xq):
        from quarl.quant.kernels import launch

        return launch.linear_quantized_input(xq, sx, qw, bias, out_dtype)
    return ref.codes_linear(xq, sx, qw, bias, out_dtype)


def gated_silu_weight_only(x: torch.Tensor, qw: QuantizedWeight,
                           repacked: RepackCache | None = None) -> torch.Tensor | None:
    """``silu(gate) * up`` ``[..., I]`` of a w4a16 ``[gate; up]`` projection on ``x``, the
    SiLU-and-mul in the GEMM's epilogue (Hopper's wgmma kernel: the GEMM then the engine's
    SiLU-and-mul, see :func:`~quarl.quant.kernels.cuda_w4.wgmma_gemm`), or None where it does
    not apply (another scheme or GPU, a batch size whose plain GEMM is not that kernel): the
    caller runs the two apart."""
    if qw.scheme.act_format != "none" or not x.is_cuda or x.dtype != torch.bfloat16 or not uses_fast_path(x):
        return None
    from quarl.quant.kernels import cuda_w4, launch

    if not cuda_w4.wgmma_available():  # (the int4 g128 check: the dispatch's family)
        return None
    lead = x.shape[:-1]
    y = launch.gated_silu_w4a16(x.reshape(-1, x.shape[-1]), qw, repacked)
    return None if y is None else y.view(*lead, y.shape[-1])


def gated_silu_quantized_input(
    xq: torch.Tensor, sx: torch.Tensor, qw: QuantizedWeight, out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``silu(g) * u`` of a W8A8 ``[gate; up]`` projection on per-token codes, the SiLU-and-mul
    fused into the GEMM's epilogue: ``(y [M, N / 2], per-tile row maxima)``, or None where
    no such kernel applies (reference backend, or a batch size the gated GEMM does not
    cover): the caller then runs the GEMM and the SiLU-and-mul apart."""
    if qw.scheme.act_format not in ("int8", "fp8") or qw.scheme.packed or not _fast_quantized_input(xq):
        return None
    from quarl.quant.kernels import launch

    return launch.gated_silu_gemm(xq, sx, qw, out_dtype)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """``qw``'s weight ``[N, K]`` in ``dtype``: the Triton kernel where :func:`quant_linear` runs
    its fast path, the reference otherwise (the same values)."""
    if dtype in (torch.bfloat16, torch.float16) and _fast(qw.qdata.device, dtype):  # the kernel writes 16-bit
        from quarl.quant.kernels import weight_only

        return weight_only.dequantize(qw, dtype)
    return qw.dequantize(dtype)


def quantize_input(x: torch.Tensor, act_format: str,
                   dequantized: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """Per-token codes and scales of ``x [M, K]`` with the quantizer :func:`quant_linear` runs;
    with ``dequantized=dtype`` also ``x`` as the GEMM sees it (:func:`dequantize_activations`
    of the codes), made in the same pass on the fast path."""
    if not uses_fast_path(x):
        q, s = ref.quantize_activations(x, act_format)
        return (q, s) if dequantized is None else (q, s, ref.dequantize_activations(q, s, dequantized))
    from quarl.quant.kernels import launch

    if dequantized is None or dequantized in (torch.bfloat16, torch.float16):  # (the kernel writes 16-bit)
        return launch.act_quant(x.contiguous(), act_format, dequantized)
    q, s = launch.act_quant(x.contiguous(), act_format)
    return q, s, dequantize_activations(q, s, dequantized)


def fake_quantize_input(x: torch.Tensor, act_format: str) -> torch.Tensor:
    """``x`` as the GEMM of :func:`quant_linear` sees it, with the same quantizer it uses."""
    if act_format == "none":
        return x
    if not uses_fast_path(x):
        return ref.fake_quantize_activations(x, act_format)
    from quarl.quant.kernels import launch

    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    q, s = launch.act_quant(x2, act_format)
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (q.to(cdt) * s[:, None].to(cdt)).to(x.dtype).view(x.shape)
