"""Launchers of the GEMMs on per-token quantized activations (W8A8 int8 / fp8, W4A8).

* :func:`pointer_gemm`: ``int8_gemm_kernel`` (int8 x int8 -> int32, or e4m3 x e4m3 -> fp32),
  both scales and the bias in its epilogue, K split to fill the GPU at small M;
* :func:`tma_gemm`: ``w8a8_tma_kernel``, TMA operand loads and a persistent grid of ``waves``
  programs per SM, optional split-K (:mod:`.splitk`); :func:`gated_gemm` is its ``[gate;
  up]`` form with SiLU-and-mul and per-tile row maxima in the epilogue;
* :func:`cublas_gemm`: fp8 through row-wise scaled ``torch._scaled_mm``;
* :func:`w4a8_gemm`: int4 g64 / g128 weights unpacked to int8 (``w4a8_gemm_kernel``).
"""

from __future__ import annotations

import torch

from quarl.quant.kernels import splitk
from quarl.quant.kernels import triton_kernels as tk
from quarl.quant.kernels.config import TileConfig
from quarl.quant.kernels.device import num_sms, pdl
from quarl.quant.kernels.splitk import cdiv
from quarl.quant.qweight import QuantizedWeight
from quarl.quant.scheme import PACK_K


def pointer_gemm(xq: torch.Tensor, sx: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
                 out_dtype: torch.dtype, cfg: TileConfig) -> torch.Tensor:
    """``(xq [M, K] @ W.T) * sx * sw`` (+ bias): int8 (int32 accumulation) or e4m3 (fp32)."""
    m, k = xq.shape
    n = qw.shape[0]
    kblocks = cdiv(k, cfg.bk)
    tiles = cdiv(m, cfg.bm) * cdiv(n, cfg.bn)
    plan = splitk.pointer_split(tiles, kblocks, num_sms(xq.device), cfg.split_k)
    out, part, cnt = splitk.outputs(m, n, plan.split, tiles, out_dtype, xq.device)
    tk.int8_gemm_kernel[(tiles, plan.split)](
        xq, qw.qdata, sx, qw.scales, bias if bias is not None else sx, out, part, cnt,
        m, n, k, plan.per, plan.split, xq.stride(0), qw.qdata.stride(0), out.stride(0),
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, IS_SPLIT=plan.split > 1, GROUP_M=cfg.group_m, HAS_BIAS=bias is not None,
        ACC_INT=xq.dtype == torch.int8, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl(xq.device),
    )
    return out


def tma_ok(t: torch.Tensor) -> bool:
    """A TMA descriptor needs a 16-byte aligned base and row stride (K % 16 == 0 for 8-bit)."""
    return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def tma_split(tiles: int, kblocks: int, slots: int, split_k: int) -> splitk.SplitPlan:
    """Work items of ``w8a8_tma_kernel`` on ``slots`` resident programs: ``split_k > 1`` every
    tile about that many ways, ``< 0`` the last wave's tiles only (:func:`.splitk.tail`), else
    none."""
    if split_k < 0:
        return splitk.tail(tiles, kblocks, slots)
    return splitk.even(tiles, kblocks, split_k)


def _tma_launch(xq, sx, qw, bias, out_dtype, cfg: TileConfig, gated: bool):
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = xq.shape
    n = qw.shape[0] // 2 if gated else qw.shape[0]
    n_tiles = cdiv(n, cfg.bn)
    tiles = cdiv(m, cfg.bm) * n_tiles
    slots = int(num_sms(xq.device) * max(cfg.waves, 1))
    plan = tma_split(tiles, cdiv(k, cfg.bk), slots, cfg.split_k)
    if gated and plan.split > 1:
        raise ValueError("the gated W8A8 GEMM cannot split K (its SiLU-and-mul epilogue needs whole sums)")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    part = cnt = out
    if plan.split > 1:  # compact partials of the split tiles (see w8a8_tma_kernel)
        part = torch.empty(plan.split * (tiles - plan.whole) * cfg.bm * cfg.bn, dtype=torch.float32, device=xq.device)
        cnt = splitk.COUNTERS.get(xq.device, tiles)
    amax = torch.empty(m, n_tiles, dtype=torch.float32, device=xq.device) if gated else out
    progs = min(plan.programs(tiles), slots)
    tk.w8a8_tma_kernel[(progs,)](
        TensorDescriptor.from_tensor(xq, [cfg.bm, cfg.bk]), TensorDescriptor.from_tensor(qw.qdata, [cfg.bn, cfg.bk]),
        sx, qw.scales, bias if bias is not None else sx, out, amax, part, cnt,
        m, n, k, out.stride(0), progs, plan.per, plan.split, plan.whole,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, HAS_BIAS=bias is not None,
        ACC_INT=xq.dtype == torch.int8, GATED=gated, IS_SPLIT=plan.split > 1, WS=False, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        # gated: silu(g) * u must round as the engine's SiLU-and-mul kernel does (no FMA contraction)
        **({"enable_fp_fusion": False} if gated else {}), **pdl(xq.device),
    )
    return (out, amax) if gated else out


def tma_gemm(xq: torch.Tensor, sx: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
             out_dtype: torch.dtype, cfg: TileConfig) -> torch.Tensor:
    """:func:`pointer_gemm` through the TMA kernel; operands TMA cannot describe (unaligned
    base or row stride) run the pointer kernel on the same tile."""
    if not (tma_ok(xq) and tma_ok(qw.qdata)):
        return pointer_gemm(xq, sx, qw, bias, out_dtype, cfg)
    return _tma_launch(xq, sx, qw, bias, out_dtype, cfg, gated=False)


def gated_gemm(xq: torch.Tensor, sx: torch.Tensor, qw: QuantizedWeight, out_dtype: torch.dtype,
               cfg: TileConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``silu(g) * u`` of a W8A8 ``[gate; up]`` projection on quantized input, in one GEMM:
    ``(y [M, N / 2], row-max partials fp32 [M, tiles along N / 2])``; None where TMA cannot
    describe the operands."""
    if qw.shape[0] % 2:
        raise ValueError(f"a [gate; up] weight has an even number of rows, got {qw.shape[0]}")
    if not (tma_ok(xq) and tma_ok(qw.qdata)):
        return None
    return _tma_launch(xq, sx, qw, None, out_dtype, cfg, gated=True)


def cublas_gemm(xq: torch.Tensor, sx: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
                out_dtype: torch.dtype, cfg: None = None) -> torch.Tensor:
    """e4m3 ``(xq @ W.T) * sx * sw + bias`` by row-wise scaled ``torch._scaled_mm`` (a
    dequantized matmul where cuBLASLt cannot run it)."""
    n, k = qw.shape
    if not cublas_fits(xq, n, k):
        y = (xq.float() * sx[:, None]) @ qw.dequantize(torch.float32).T
        return (y + bias.float() if bias is not None else y).to(out_dtype)
    return scaled_rows_mm(xq, sx, qw.qdata, qw.scales, bias, out_dtype)


def cublas_fits(xq: torch.Tensor, n: int, k: int) -> bool:
    """cuBLASLt runs the e4m3 GEMM: on a GPU, N and K multiples of 16."""
    return xq.device.type == "cuda" and n % 16 == 0 and k % 16 == 0


def scaled_rows_mm(xq: torch.Tensor, sx: torch.Tensor, qdata: torch.Tensor, scales: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``(xq @ qdata.T) * sx[:, None] * scales[None, :] + bias``: e4m3 codes with per-token and
    per-channel scales, one row-scaled ``torch._scaled_mm``."""
    return torch._scaled_mm(
        xq, qdata.t(), scale_a=sx[:, None], scale_b=scales[None, :], out_dtype=out_dtype,
        bias=bias.to(out_dtype) if bias is not None else None,
    )


def w4a8_gemm(xq: torch.Tensor, sx: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
              out_dtype: torch.dtype, cfg: TileConfig) -> torch.Tensor:
    """int4 g64 / g128 symmetric weights on int8 codes: ``(xq @ deq(W).T) * sx + bias``."""
    m, k = xq.shape
    n = qw.shape[0]
    if qw.scheme.group_size not in (64, 128) or not qw.scheme.symmetric:
        raise ValueError("w4a8 kernel needs symmetric int4 with group 64 or 128")
    nchunk = qw.qdata.shape[1] * 2 // PACK_K
    tiles = cdiv(m, cfg.bm) * cdiv(n, cfg.bn)
    plan = splitk.pointer_split(tiles, nchunk, num_sms(xq.device), cfg.split_k)
    out, part, cnt = splitk.outputs(m, n, plan.split, tiles, out_dtype, xq.device)
    tk.w4a8_gemm_kernel[(tiles, plan.split)](
        xq, qw.qdata, sx, qw.scales, bias if bias is not None else sx, out, part, cnt,
        m, n, k, nchunk, plan.per, plan.split,
        xq.stride(0), qw.qdata.stride(0), qw.scales.stride(0), out.stride(0),
        G=qw.scheme.group_size, BM=cfg.bm, BN=cfg.bn, IS_SPLIT=plan.split > 1, GROUP_M=cfg.group_m,
        HAS_BIAS=bias is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
