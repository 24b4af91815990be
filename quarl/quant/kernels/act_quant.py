"""Per-token activation quantizers (int8 / e4m3): the step before every W8A8 / W4A8 GEMM."""

from __future__ import annotations

import torch

from quarl.quant.kernels import triton_kernels as tk
from quarl.quant.kernels.device import pdl
from quarl.quant.kernels.splitk import cdiv


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def interpreting(t: torch.Tensor) -> bool:
    """A CPU tensor: the Triton interpreter runs the kernel (small blocks keep it fast)."""
    return t.device.type != "cuda"


def act_quant_config(k: int) -> tuple[int, int]:
    """(columns per block, warps) of ``act_quant_kernel``: one pass (the row in registers) up
    to 8192 columns; longer rows take two passes over 4096-column blocks (a register row that
    wide spills)."""
    full = next_pow2(k)
    block = full if full <= 8192 else 4096
    return block, (4 if block <= 2048 else 8)


def act_quant_buffers(rows: int, k: int, act_format: str, device: torch.device):
    """``(q, q_arg, s)``: codes ``[rows, k]`` (int8 / e4m3), the view a kernel writes them
    through (e4m3 as uint8 bytes) and fp32 scales ``[rows]``."""
    fp8 = act_format == "fp8"
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn if fp8 else torch.int8, device=device)
    s = torch.empty(rows, dtype=torch.float32, device=device)
    return q, (q.view(torch.uint8) if fp8 else q), s


def act_quant(x: torch.Tensor, act_format: str, cfg: tuple[int, int] | None = None,
              dequantized: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """Per-token dynamic quantization ``x [M, K]`` -> ``(q [M, K], scale fp32 [M])``, and with
    ``dequantized=dtype`` also ``codes * scale`` in that dtype (:func:`act_dequant`'s values,
    written by the same pass). ``cfg``: (block, warps) instead of :func:`act_quant_config`'s."""
    m, k = x.shape
    q, q_arg, s = act_quant_buffers(m, k, act_format, x.device)
    # The interpreter's float -> bf16 cast truncates: there it writes fp32 and torch rounds.
    dq = None if dequantized is None else torch.empty(
        m, k, dtype=torch.float32 if interpreting(x) else dequantized, device=x.device)
    if m:
        if interpreting(x):
            block, warps = min(next_pow2(k), 64), 4
        else:
            block, warps = cfg or act_quant_config(k)
        tk.act_quant_kernel[(m,)](
            x, q_arg, s, q if dq is None else dq, k, x.stride(0), q.stride(0), 0 if dq is None else dq.stride(0),
            IS_FP8=act_format == "fp8", BLOCK=block, ONE_PASS=block >= k, WRITE_DQ=dq is not None, num_warps=warps,
            enable_fp_fusion=False,  # int8: x * r must round before the rounding add (no FMA), as in torch
            **pdl(x.device),
        )
    return (q, s) if dq is None else (q, s, dq.to(dequantized))


def act_dequant(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(q [M, K] int8 / e4m3 codes) * (s [M] fp32)`` rounded to ``dtype``, in one pass
    (the values of ``reference.dequantize_activations``)."""
    m, k = q.shape
    # The interpreter's float -> bf16 cast truncates: there it writes fp32 and torch rounds.
    out = torch.empty(m, k, dtype=torch.float32 if interpreting(q) else dtype, device=q.device)
    if m:
        fp8 = q.dtype == torch.float8_e4m3fn
        block = min(next_pow2(k), 64 if interpreting(q) else 1024)
        tk.act_dequant_kernel[(m, cdiv(k, block))](
            q.view(torch.uint8) if fp8 else q, s, out, k, q.stride(0), out.stride(0), IS_FP8=fp8, BLOCK=block,
            num_warps=4,
        )
    return out.to(dtype)


def act_quant_from_partials(y: torch.Tensor, amax: torch.Tensor, act_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``act_quant(y)`` when the kernel that wrote ``y [M, K]`` also wrote its row maxima
    as partials ``amax [M, P]``: one parallel pass over y (no per-row reduction over K)."""
    m, k = y.shape
    q, q_arg, s = act_quant_buffers(m, k, act_format, y.device)
    if m == 0:
        return q, s
    block = 64 if interpreting(y) else 2048
    p = amax.shape[1]
    tk.act_quant_partials_kernel[(m, cdiv(k, block))](
        y, amax, q_arg, s, k, p, y.stride(0), q.stride(0), IS_FP8=act_format == "fp8", BLOCK=block,
        PBLOCK=min(next_pow2(p), 512), num_warps=4, enable_fp_fusion=False, **pdl(y.device),
    )
    return q, s
