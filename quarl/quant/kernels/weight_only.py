"""Triton launchers of the weight-only GEMMs (bf16 / fp16 activations, sub-byte weights).

* :func:`tiled_gemm`: ``wo_gemm_kernel``, any packed format (int4 sym/asym, int2, nvfp4,
  mxfp4), dequantizing each tile in registers before a tensor-core dot, K split to fill the
  GPU at small M.
* :func:`swap_gemm`: ``w4_swap_kernel`` for int4 g128 at M <= 64: the dequantized weight
  tile is the dot's A operand, so the few activation rows waste no weight traffic.
* :func:`dequant_gemm`: the weight dequantized once (:func:`dequantize`) and the GEMM left to
  cuBLAS, which wins once the GEMM is compute-bound.
"""

from __future__ import annotations

import torch

from quarl.quant.kernels import splitk
from quarl.quant.kernels import triton_kernels as tk
from quarl.quant.kernels.act_quant import interpreting
from quarl.quant.kernels.config import TileConfig
from quarl.quant.kernels.device import num_sms
from quarl.quant.kernels.splitk import cdiv
from quarl.quant.kernels.w4_layout import RepackCache
from quarl.quant.qweight import QuantizedWeight
from quarl.quant.scheme import PACK_K

_FMT = {("int", True): tk.FMT_INT_SYM, ("int", False): tk.FMT_INT_ASYM, ("e4m3",): tk.FMT_NVFP4,
        ("e8m0",): tk.FMT_MXFP4}


def _fmt(qw: QuantizedWeight) -> int:
    sc = qw.scheme
    return _FMT[(sc.scale_format,)] if sc.weight_format == "fp4" else _FMT[("int", sc.symmetric)]


def is_w4_g128(qw: QuantizedWeight) -> bool:
    """int4 weights with one (fp32) scale per 128-column chunk: the swap and CUDA w4 kernels."""
    sc = qw.scheme
    return (sc.weight_format == "int" and sc.weight_bits == 4 and sc.group_size == PACK_K
            and not sc.quantizes_activations)


def _group_params(qw: QuantizedWeight):
    """(scales, zeros, global scale) as the kernels take them (absent ones stand in by scales)."""
    scales = qw.scales.view(torch.uint8) if qw.scales.dtype == torch.float8_e4m3fn else qw.scales
    zeros = qw.zeros if qw.zeros is not None else scales
    gs = qw.global_scale if qw.global_scale is not None else scales
    return scales, zeros, gs


def _nchunk(qw: QuantizedWeight) -> int:
    return qw.qdata.shape[1] * 8 // qw.scheme.weight_bits // PACK_K


def tiled_gemm(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, cfg: TileConfig) -> torch.Tensor:
    """``x [M, K] @ deq(W).T + bias`` with ``wo_gemm_kernel``."""
    m, k = x.shape
    n = qw.shape[0]
    nchunk = _nchunk(qw)
    tiles = cdiv(m, cfg.bm) * cdiv(n, cfg.bn)
    plan = splitk.pointer_split(tiles, nchunk, num_sms(x.device), cfg.split_k)
    scales, zeros, gs = _group_params(qw)
    out, part, cnt = splitk.outputs(m, n, plan.split, tiles, x.dtype, x.device)
    tk.wo_gemm_kernel[(tiles, plan.split)](
        x, qw.qdata, scales, zeros, gs, bias if bias is not None else scales, out, part, cnt,
        m, n, k, nchunk, plan.per, plan.split,
        x.stride(0), qw.qdata.stride(0), scales.stride(0), out.stride(0),
        FMT=_fmt(qw), BITS=qw.scheme.weight_bits, G=qw.scheme.group_size,
        BM=cfg.bm, BN=cfg.bn, IS_SPLIT=plan.split > 1, GROUP_M=cfg.group_m, HAS_BIAS=bias is not None,
        POST_SCALE=cfg.post_scale and qw.scheme.weight_format == "int" and qw.scheme.group_size % PACK_K == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def swap_gemm(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, cfg: TileConfig) -> torch.Tensor:
    """int4 g128 ``x [M, K] @ W.T + bias`` with ``w4_swap_kernel`` (``cfg.bm`` / ``cfg.bn``: the
    swapped tile's M / N sides; ``cfg.waves > 0``: K split to ~waves x SMs programs)."""
    if not is_w4_g128(qw):
        raise ValueError(f"the swap kernel needs int4 weights with group 128, got {qw.scheme.name}")
    m, k = x.shape
    n = qw.shape[0]
    nchunk = qw.qdata.shape[1] // (PACK_K // 2)
    n_tiles, m_tiles = cdiv(n, cfg.bn), cdiv(m, cfg.bm)
    tiles = n_tiles * m_tiles
    sms = num_sms(x.device)
    if cfg.waves > 0:  # ~waves x SMs programs, >= 2 chunks each
        plan = splitk.fill(tiles, nchunk, cfg.waves * sms, nchunk // 2, nearest=True)
    else:
        plan = splitk.pointer_split(tiles, nchunk, sms, cfg.split_k)
    out, part, cnt = splitk.outputs(m, n, plan.split, tiles, x.dtype, x.device)
    zeros = qw.zeros if qw.zeros is not None else qw.scales
    tk.w4_swap_kernel[(n_tiles, plan.split, m_tiles)](
        x, qw.qdata, qw.scales, zeros, bias if bias is not None else qw.scales, out, part, cnt,
        m, n, k, nchunk, plan.per, plan.split,
        x.stride(0), qw.qdata.stride(0), qw.scales.stride(0), out.stride(0),
        ASYM=qw.zeros is not None, BM=cfg.bm, BN=cfg.bn, IS_SPLIT=plan.split > 1, HAS_BIAS=bias is not None,
        INTERP=interpreting(x), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def dequantize(qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Packed sub-byte weight -> ``[N, K]`` in ``dtype`` with one Triton launch."""
    n, k = qw.shape
    if not qw.scheme.packed:
        return qw.dequantize(dtype)
    scales, zeros, gs = _group_params(qw)
    out = torch.empty(n, k, dtype=dtype, device=qw.qdata.device)
    bn = 16 if interpreting(out) else 64
    tk.dequant_kernel[(cdiv(n, bn), _nchunk(qw))](
        qw.qdata, scales, zeros, gs, out, n, k, qw.qdata.stride(0), scales.stride(0), out.stride(0),
        FMT=_fmt(qw), BITS=qw.scheme.weight_bits, G=qw.scheme.group_size, BN=bn, num_warps=4,
    )
    return out


def dequant_gemm(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, cfg: None = None,
                 repacked: RepackCache | None = None) -> torch.Tensor:
    w = dequantize(qw, x.dtype) if repacked is None else repacked.dequantized(qw, x.dtype, dequantize)
    return torch.nn.functional.linear(x, w, bias)
