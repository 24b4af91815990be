"""Python launchers for the Triton kernels, with the tile/split-K dispatch on M.

Imported only when a fast path runs (it imports triton). Shapes: ``x [M, K]`` 2-D and
contiguous in its last dim; the weight is a :class:`~quarl.quant.qweight.QuantizedWeight`.

Dispatch on M (tile configs picked from the sweep in ``bench/gemm_sweep.py``):
small M (decode) uses 16-row tiles and splits K until the grid covers the GPU twice
(fp32 partials reduced by one ``sum``); larger M uses bigger tiles and no split. For
weight-only formats above ``WO_DEQUANT_MIN_M`` rows the weight is dequantized once and
the GEMM goes to cuBLAS, which wins once the GEMM is compute-bound.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from quarl.quant.kernels import cuda_w4
from quarl.quant.kernels import triton_kernels as tk
from quarl.quant.qweight import QuantizedWeight
from quarl.quant.scheme import PACK_K


class TileConfig(NamedTuple):
    bm: int
    bn: int
    bk: int = 128  # int8 GEMM only; sub-byte kernels always walk 128-column chunks
    split_k: int = 0  # 0 = pick to fill the GPU ("tma": 0 or 1 = no split, < 0 = tail split, see _tma_work)
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    post_scale: bool = True  # weight-only int formats with G % 128 == 0: scale partial sums
    # weight-only: "tiled" (wo_gemm_kernel), "swap" / "swap16" (RAW16) / "swapb" (SUB16) /
    # "gemv" (int4 g128 only), "frag" (CUDA fragment kernel, int4 g128, bf16, M <= 16), "tile"
    # (block-tiled CUDA kernel, int4 g128, bf16, M <= 64; block shape from w4_tile_config), "dequant"
    # (dequantize + cuBLAS); int8 / fp8: "tiled" (int8_gemm_kernel), "tma" (w8a8_tma_kernel, large M;
    # waves = resident programs per SM), fp8 also "cublas" (_scaled_mm; any other name runs Triton)
    kernel: str = "tiled"
    # > 0: split K until about waves x SMs programs, even when the tiles alone fill the GPU
    # (w4 kernels; short programs, many resident per SM, hide the per-chunk latency chain)
    waves: float = 0
    cpi: int = 1  # w4 swap kernels: 128-column chunks per (unrolled) loop iteration
    words: bool = False  # swapb: read the packed weight as int32 words (WORDS)
    ws: bool = False  # tma: Triton warp specialization of the persistent item loop


# Rows of M at or above which weight-only formats dequantize + cuBLAS (None = never).
WO_DEQUANT_MIN_M: int | None = 128

# Optional overrides {kernel_name: callable(M, N, K) -> TileConfig} (used by the sweep).
CONFIG_OVERRIDES: dict[str, object] = {}


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pick_split(tiles: int, kblocks: int, sms: int, split_k: int) -> tuple[int, int]:
    """(splits, k-blocks per split): split K until ~2 waves of programs, >= 2 blocks each
    (``split_k = -w``: until ~w waves)."""
    if split_k <= 0:
        waves = -split_k or 2
        split_k = 1 if tiles >= sms else min(_cdiv(waves * sms, tiles), max(kblocks // 2, 1))
    per = _cdiv(kblocks, max(split_k, 1))
    return _cdiv(kblocks, per), per


def wo_config(m: int, n: int, k: int) -> TileConfig:
    if "wo" in CONFIG_OVERRIDES:
        return CONFIG_OVERRIDES["wo"](m, n, k)
    # From the H200 sweeps (bench/results/sweep_h200_*.json): narrow tiles, split-K and
    # scale-before-dot win at small M; above WO_DEQUANT_MIN_M dequant + cuBLAS wins.
    if m <= 16:
        return TileConfig(16, 32, num_warps=4, num_stages=4, post_scale=False)
    if m <= 32:
        return TileConfig(32, 64, num_warps=4, num_stages=3)
    if m <= 64:
        return TileConfig(64, 64, num_warps=4, num_stages=3)
    return TileConfig(64, 128, num_warps=4, num_stages=3)


def w4_config(m: int, n: int, k: int) -> TileConfig:
    """int4 g128 weight-only (w4a16, w4a16-asym): bm/bn are the swapped tile's M / N sides."""
    if "w4" in CONFIG_OVERRIDES:
        return CONFIG_OVERRIDES["w4"](m, n, k)
    # H200 sweep run 6 (bench/results/gemm_sweep_h200_6.json): the SUB16 dequant ("swapb")
    # with BN 64 / 4 warps / 3 stages and K split to ~8 waves of programs on the big shapes
    # (gate/up, down: 1.5x at M <= 16), ~4 waves elsewhere (the split keeps >= 2 chunks per
    # program, which is what small-N k/v needs); 5 stages and BN 128 lose everywhere.
    cuda_kernels = W4_SMALL_KERNEL == "frag"
    wgmma = cuda_kernels and m <= WGMMA_MAX_M and cuda_w4.wgmma_available()
    if cuda_kernels and m <= FRAG_MAX_M and not wgmma:
        # H200 sweep run 9 (bench/results/gemm_sweep_h200_9.json, M = 1): 8-slot rings; 2 warps
        # per block on the big shapes (gate/up, down), 4 on q/o and k/v; K split towards 8
        # blocks per SM on long K (down), 4 otherwise
        big = n * k >= TILE_MIN_NK
        cfg = TileConfig(16, cuda_w4.SLAB, num_warps=2 if big else 4, num_stages=8, waves=8 if (k >= 8192 or not big) else 4, kernel="frag")
        return _env_tweak(cfg, "QUARL_W4_SMALL")
    if wgmma:
        return TileConfig(m, 0, kernel="wgmma")
    if m <= TILE_MAX_M and W4_SMALL_KERNEL == "frag" and n * k >= TILE_MIN_NK:
        return TileConfig(16 * _cdiv(m, 16), 0, kernel="tile")
    return _w4_triton_config(m, n, k, W4_SMALL_KERNEL if W4_SMALL_KERNEL != "frag" else "swapb")


def w4_tile_config(m: int, n: int, k: int) -> "cuda_w4.TileKConfig":
    """Block shape of the block-tiled CUDA w4 kernel (A/B runs: ``QUARL_W4_TILE="sw=2,blocks_per_sm=4"``)."""
    if "tile" in CONFIG_OVERRIDES:
        return CONFIG_OVERRIDES["tile"](m, n, k)
    cfg = cuda_w4.tile_config_for(m)
    spec = os.environ.get("QUARL_W4_TILE", "")
    if spec:
        fields = {f: float(v) if f == "blocks_per_sm" else int(v) for f, v in (i.split("=") for i in spec.split(","))}
        cfg = cfg._replace(**fields)
    return cfg


def _w4_triton_config(m: int, n: int, k: int, kernel: str) -> TileConfig:
    if m <= 64:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        big = m <= 16 and (_cdiv(n, 64) >= 256 or k >= 8192)
        cfg = TileConfig(bm, 64, num_warps=4, num_stages=3, waves=8 if big else 4, kernel=kernel)
        return _env_tweak(cfg, "QUARL_W4_SMALL" if m <= 16 else "QUARL_W4_MID")
    return TileConfig(0, 0, kernel="dequant")


def _env_tweak(cfg: TileConfig, var: str) -> TileConfig:
    """A/B runs on the device: ``VAR="bn=128,num_warps=8,words=1"`` replaces those fields."""
    spec = os.environ.get(var, "")
    if not spec:
        return cfg
    def conv(f: str, v: str):
        cur = getattr(cfg, f)
        if isinstance(cur, bool):
            return v in ("1", "True", "true")
        if isinstance(cur, str):
            return v
        x = float(v)
        return int(x) if x.is_integer() else x

    return cfg._replace(**{f: conv(f, v) for f, v in (item.split("=") for item in spec.split(","))})


# "frag", "swapb", "swap" or "swap16" (QUARL_W4_KERNEL overrides, for A/B runs on the device)
# (H200 sweep run 6: swapb beats swap16 / swap at every M <= 64 shape; exact, no extra dots;
# run 9: the CUDA fragment kernel beats swapb at M = 1). "frag" falls back to "swapb"
# where it cannot run (no NVRTC, pre-sm80 GPU, fp16 inputs, the Triton interpreter).
W4_SMALL_KERNEL = os.environ.get("QUARL_W4_KERNEL", "frag")
# Rows up to which "frag" is used: every warp re-reads the activation tile from L2, which at
# M = 16 costs as much traffic as the weights (run 9: 0.6-0.9x of swapb there; 1.1-1.3x at M = 1).
FRAG_MAX_M = int(os.environ.get("QUARL_FRAG_MAX_M", "4"))
# Rows up to which the block-tiled CUDA kernel ("tile": the block's warps share one
# activation tile) is used above FRAG_MAX_M, on weights of at least TILE_MIN_NK elements; the
# Triton swapb kernel elsewhere. H200 sweep run 11 (bench/results/w4_tile_sweep_h200.json):
# at M = 8 tile beats swapb on fused gate_up and down (2.14x / 1.98x of bf16 vs 1.93x / 1.71x),
# ties on gate/up (1.70x vs 1.73x) and loses on q/o, qkv and k/v; from M = 16 on swapb wins.
TILE_MAX_M = min(int(os.environ.get("QUARL_W4_TILE_MAX_M", "8")), cuda_w4.TILE_MAX_M)
TILE_MIN_NK = 1 << 25
# On Hopper, the wgmma kernel ("wgmma": dequantized weights as the register A operand of
# wgmma, the activation tile read from shared memory) takes every M <= WGMMA_MAX_M. Since its
# K splits are summed inside a thread-block cluster (run 19), it also beats the fragment
# kernel at M <= 4 (q/o 7.1 vs 7.8 us, qkv 8.5 vs 9.0, k/v 4.8 vs 5.6 at M = 1) and swapb on
# k/v (N = 512: 6.6 vs 10.4 us at M = 64). Block shapes: see wgmma_config.
WGMMA_MAX_M = int(os.environ.get("QUARL_W4_WGMMA_MAX_M", "64"))


def wgmma_config(m: int, n: int, k: int) -> "cuda_w4.WgConfig":
    """Block shape of the wgmma w4 kernel for ``m`` rows (H100 sweeps of runs 18 and 19,
    bench/results/w4_wgmma_sweep_h100_run19_{c1,c2}.json, us of the 7B engine shapes).

    Where every column block is split along K (all but the widest weights), the splits of a
    column block form one thread-block cluster and are summed through distributed shared
    memory (``cluster``): no fp32 partials through L2, no arrival counter. That took q/o at
    M = 64 from 12.4-12.8 to 10.4 us, qkv from 14.7-15.0 to 13.0 and down from 32.8 to 31.1;
    at M = 16 q/o 8.8 -> 7.6, qkv 9.5 -> 9.0. The splits are the last-wave ones (``tail``:
    ``blocks_per_sm`` = resident blocks per SM, never a second wave).

    * K > 8192 (down): 2 warpgroups sharing the activation tile, single-tile loop, 2 blocks
      per SM (M = 1 / 16 / 32 / 64: 19.2 / 20.1 / 24.3 / 31.1 us).
    * Wide weights (N >= 32768 at M <= 16, N >= 16384 above): column blocks enough to fill
      the GPU without a split, the last wave's split through global partials: single-tile,
      1 warpgroup, 4 blocks per SM up to M = 32 (fused gate_up 32.8 / 35.2 / 40.1 us at
      M = 1 / 16 / 32, gate/up 25.1 at M = 32); 3 warpgroups, one block per SM at M = 64
      (fused gate_up 52.9-53.5, gate/up 31.5).
    * Else (q/o, qkv, k/v, gate/up up to M = 16): 1 double-buffered warpgroup, 2 blocks per
      SM (q/o 7.1 / 7.6 / 8.8 / 10.4 us at M = 1 / 16 / 32 / 64; qkv 8.5 / 9.0 / 11.0 / 13.0)."""
    if "wgmma" in CONFIG_OVERRIDES:
        return CONFIG_OVERRIDES["wgmma"](m, n, k)
    if k > 8192:
        return cuda_w4.WgConfig(2, 3, 2.0, single=True, minb=2, tail=True, cluster=True)
    if n < (32768 if m <= 16 else 16384):
        return cuda_w4.WgConfig(1, 4, 2.0, tail=True, cluster=True)
    if m <= 32:
        return cuda_w4.WgConfig(1, 3, 4.0, single=True, minb=4, tail=True)
    return cuda_w4.WgConfig(3, 4, 1.0, single=True, minb=1, tail=True)


# The TMA kernel's tile for 16 < M <= 64 (and int8 at M <= 512): 64 x 64 x 128, 5 stages, 3
# programs per SM. H200 run 12 (bench/results/w8a8_sweep_h200.json, GEMM on quantized input):
# M = 64 q/o 10.4 us and qkv 10.9 us where the pointer kernel's split-K took 13.7 (bf16 10.5 /
# 11.4); int8 M = 256 q/o 11.5 vs 13.7 and down 44.2 vs 54.1. With K > 8192 (down) and
# M <= 64 the tiles alone are too few and the pointer kernel's split-K wins (30 vs 40 us).
_TMA_64 = TileConfig(64, 64, 128, num_warps=4, num_stages=5, waves=3, kernel="tma")
_TMA_64x128 = TileConfig(64, 128, 128, num_warps=4, num_stages=4, waves=2, kernel="tma")
_TMA_64_MAX_TILES = 264  # 64 x 64 tiles while ~2 fit per SM (80 KB of stages each) on 132 SMs
# K > 8192 (down_proj) at 64 < M <= 256: K split in 2 over 64 x 128 tiles. H200 run 13
# (bench/results/w8a8_split_sweep_h200.json), 7B down_proj: fp8 M = 128 37.3 us and M = 256
# 42.7 where cuBLAS took 47.6 / 47.6 (bf16 45.0 / 55.8); int8 38.4 / 42.5 vs 40.8 / 44.4.
_TMA_SPLIT = TileConfig(64, 128, 128, split_k=2, num_warps=4, num_stages=4, waves=2, kernel="tma")


def _w8a8_small_m(m: int, n: int, k: int) -> TileConfig:
    if m <= 16:
        return TileConfig(16, 64, 256, num_warps=4, num_stages=3)
    if k <= 8192:
        return _TMA_64
    return TileConfig(64, 64, 128, num_warps=4, num_stages=4)


def fp8_config(m: int, n: int, k: int) -> TileConfig:
    """M <= 64: Triton (see ``_w8a8_small_m``; run 10: the pointer kernel beats row-wise
    ``_scaled_mm`` 1.3-1.5x on gate/up and down, gate_up M = 64 45 vs 61 us). Up to M = 256:
    the TMA kernel with K split in 2 for K > 8192 (``_TMA_SPLIT``), 64 x 64 tiles while they
    are few (q/o M = 256: 12.1 vs 13.0 us, qkv M = 128: 12.0 vs 13.2; run 13); else cuBLAS:
    no Triton tile beat it by more than 5% in runs 10, 12 and 13 (the TMA kernel is 1.3-2x
    slower than cuBLAS at M >= 1024)."""
    if "fp8" in CONFIG_OVERRIDES:
        return CONFIG_OVERRIDES["fp8"](m, n, k)
    if m <= 64:
        return _w8a8_small_m(m, n, k)
    if m <= 256 and k > 8192:
        return _TMA_SPLIT
    if m <= 256 and _cdiv(m, 64) * _cdiv(n, 64) <= _TMA_64_MAX_TILES:
        return _TMA_64
    return TileConfig(0, 0, kernel="cublas")


# int8 at M >= 2048 (run 17, H100, bench/results/w8a8_sweep_h100_run17.json, GEMM on quantized
# input, M = 4096; H200 run 12 in brackets): wide layers (gate_up) 256 x 128 tiles 961 vs 1114 us
# for the pointer kernel (968 vs 1032); K > 8192 (down) 128 x 256 tiles with the tail split 444
# vs 498 (no tail split 484; H200 no tail split 488 vs 485). Measured at M = 1024 and 4096 only:
# at 1024 the pointer kernel stays ahead (down 110 vs 121 us).
_TMA_WIDE = TileConfig(256, 128, 128, num_warps=8, num_stages=3, waves=1, kernel="tma")
_TMA_LONG_K = TileConfig(128, 256, 128, split_k=-1, num_warps=8, num_stages=3, waves=1, kernel="tma")


def int8_config(m: int, n: int, k: int) -> TileConfig:
    """M <= 64 as fp8; K > 8192 up to M = 256 ``_TMA_SPLIT``; M <= 512: the TMA kernel, 64 x 64 tiles while they fit in ~2 per SM
    (q/o, down), else 64 x 128 (qkv 14.5 vs 15.7 us, gate_up 75 vs 78 at M = 256); M >= 2048
    with N >= 16384 or K > 8192: the TMA kernel's ``_TMA_WIDE`` / ``_TMA_LONG_K``; else the
    pointer kernel, 128 x 128 x 128, 8 warps, 3 stages (sweep_h200_1.json; run 12: no TMA
    tile beat it by more than 6% at M = 1024)."""
    if "int8" in CONFIG_OVERRIDES:
        return CONFIG_OVERRIDES["int8"](m, n, k)
    if m <= 64:
        return _w8a8_small_m(m, n, k)
    if m <= 256 and k > 8192:
        return _TMA_SPLIT
    if m <= 512:
        return _TMA_64 if _cdiv(m, 64) * _cdiv(n, 64) <= _TMA_64_MAX_TILES else _TMA_64x128
    if m >= 2048 and k > 8192:
        return _TMA_LONG_K
    if m >= 2048 and n >= 16384:
        return _TMA_WIDE
    return TileConfig(128, 128, 128, split_k=1, num_warps=8, num_stages=3)


def w4a8_config(m: int, n: int, k: int) -> TileConfig:
    if "w4a8" in CONFIG_OVERRIDES:
        return CONFIG_OVERRIDES["w4a8"](m, n, k)
    if m <= 16:
        return TileConfig(16, 128, num_warps=4, num_stages=3)
    if m <= 64:
        return TileConfig(64, 64, num_warps=4, num_stages=3)
    return TileConfig(128, 128, split_k=1, num_warps=8, num_stages=3)


def _interpreting(x: torch.Tensor) -> bool:
    return x.device.type != "cuda"


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 tile counters of split-K launches, one buffer per device.

    Kernels leave them at zero, so the buffer is allocated once and reused. It must be
    allocated (and zeroed) eagerly: a buffer made during CUDA-graph capture would only
    be zeroed when that particular graph replays, and another graph could read it
    first. Run one eager forward before capturing (warm-up does this).
    """
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "split-K counters are first needed inside CUDA-graph capture; run the same forward "
                "eagerly once before capturing"
            )
        buf = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def _outputs(m: int, n: int, split: int, tiles: int, dtype: torch.dtype, device: torch.device):
    out = torch.empty(m, n, dtype=dtype, device=device)
    if split == 1:
        return out, out, out
    part = torch.empty(split, m, n, dtype=torch.float32, device=device)
    return out, part, _counters(device, tiles)


def act_quant(x: torch.Tensor, act_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic quantization ``x [M, K]`` -> ``(q [M, K], scale fp32 [M])``."""
    m, k = x.shape
    fp8 = act_format == "fp8"
    q, q_arg, s = act_quant_buffers(m, k, act_format, x.device)
    if m == 0:
        return q, s
    block, warps = (min(triton_next_pow2(k), 64), 4) if _interpreting(x) else act_quant_config(m, k)
    tk.act_quant_kernel[(m,)](
        x, q_arg, s, k, x.stride(0), q.stride(0), IS_FP8=fp8, BLOCK=block, ONE_PASS=block >= k, num_warps=warps,
        enable_fp_fusion=False,  # int8: x * r must round before the rounding add (no FMA), as in torch
    )
    return q, s


def act_quant_config(m: int, k: int) -> tuple[int, int]:
    """(columns per block, warps) of ``act_quant_kernel``: one pass (row in registers) up to
    8192 columns; longer rows (down_proj, K = 18944) take two passes over 4096-column blocks
    (a 32768-wide register row spilled: 350 us for 4096 x 18944, H200 sweep 47a5360)."""
    if "act_quant" in CONFIG_OVERRIDES:
        return CONFIG_OVERRIDES["act_quant"](m, k)
    full = triton_next_pow2(k)
    block = full if full <= 8192 else 4096
    return block, (4 if block <= 2048 else 8)


def act_quant_buffers(rows: int, k: int, act_format: str, device: torch.device):
    """``(q, q_arg, s)``: codes ``[rows, k]`` (int8 / e4m3), the view a kernel writes them
    through (e4m3 as uint8 bytes) and fp32 scales ``[rows]``."""
    fp8 = act_format == "fp8"
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn if fp8 else torch.int8, device=device)
    s = torch.empty(rows, dtype=torch.float32, device=device)
    return q, (q.view(torch.uint8) if fp8 else q), s


def triton_next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


_FMT = {("int", True): tk.FMT_INT_SYM, ("int", False): tk.FMT_INT_ASYM, ("e4m3",): tk.FMT_NVFP4, ("e8m0",): tk.FMT_MXFP4}


def _wo_fmt(qw: QuantizedWeight) -> int:
    sc = qw.scheme
    if sc.weight_format == "fp4":
        return _FMT[(sc.scale_format,)]
    return _FMT[("int", sc.symmetric)]


def is_w4_g128(qw: QuantizedWeight) -> bool:
    """int4 weights with one (fp32) scale per 128-column chunk: the swap / GEMV kernels."""
    sc = qw.scheme
    return sc.weight_format == "int" and sc.weight_bits == 4 and sc.group_size == PACK_K and not sc.quantizes_activations


def w4_gemm(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, cfg: TileConfig) -> torch.Tensor:
    """int4 g128 ``x [M, K] @ W.T`` with ``w4_swap_kernel`` or ``w4_gemv_kernel`` (cfg.kernel)."""
    m, k = x.shape
    n = qw.shape[0]
    nchunk = qw.qdata.shape[1] // (PACK_K // 2)
    bm = cfg.bm
    if cfg.kernel == "gemv":
        bm = min(bm, triton_next_pow2(m))
    n_tiles, m_tiles = _cdiv(n, cfg.bn), _cdiv(m, bm)
    tiles = n_tiles * m_tiles
    if cfg.waves > 0:  # ~waves x SMs programs, >= 2 chunks each
        split = max(1, min(round(cfg.waves * num_sms(x.device) / tiles), nchunk // 2))
        per = _cdiv(nchunk, split)
        split = _cdiv(nchunk, per)
    else:
        split, per = _pick_split(tiles, nchunk, num_sms(x.device), cfg.split_k)
    if cfg.cpi > 1:  # whole unrolled iterations per split
        per = _cdiv(per, cfg.cpi) * cfg.cpi
        split = _cdiv(nchunk, per)
    out, part, cnt = _outputs(m, n, split, tiles, x.dtype, x.device)
    kern = tk.w4_gemv_kernel if cfg.kernel == "gemv" else tk.w4_swap_kernel
    zeros = qw.zeros if qw.zeros is not None else qw.scales
    wdata, wstride = qw.qdata, qw.qdata.stride(0)
    if cfg.words:
        if cfg.kernel != "swapb":
            raise ValueError("words=True needs the swapb kernel")
        wdata, wstride = qw.qdata.view(torch.int32), qw.qdata.stride(0) // 4
    kern[(n_tiles, split, m_tiles)](
        x, wdata, qw.scales, zeros, bias if bias is not None else qw.scales, out, part, cnt,
        m, n, k, nchunk, per, split,
        x.stride(0), wstride, qw.scales.stride(0), out.stride(0),
        ASYM=qw.zeros is not None, BM=bm, BN=cfg.bn, IS_SPLIT=split > 1, HAS_BIAS=bias is not None,
        **({"RAW16": True} if cfg.kernel == "swap16" else {"SUB16": True, "INTERP": _interpreting(x)} if cfg.kernel == "swapb" else {}),
        **({"CPI": cfg.cpi} if cfg.cpi > 1 and cfg.kernel != "gemv" else {}), **({"WORDS": True} if cfg.words else {}), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def wo_gemm(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, cfg: TileConfig | None = None) -> torch.Tensor:
    """Weight-only dequant GEMM ``x [M, K] @ W.T`` for int4/int2/nvfp4/mxfp4 weights."""
    m, k = x.shape
    n = qw.shape[0]
    if cfg is None and is_w4_g128(qw):
        cfg = w4_config(m, n, k)
    if cfg is not None and cfg.kernel == "frag":
        if x.is_cuda and x.dtype == torch.bfloat16 and m <= cuda_w4.MAX_M and cuda_w4.available():
            fc = cuda_w4.FragConfig(nw=cfg.num_warps, blocks_per_sm=cfg.waves or 4.0, stages=cfg.num_stages)
            return cuda_w4.w4a16_frag_gemm(x, qw, bias, fc, counters=_counters)
        cfg = _w4_triton_config(m, n, k, "swapb")
    if cfg is not None and cfg.kernel == "wgmma":
        if x.is_cuda and x.dtype == torch.bfloat16 and m <= cuda_w4.WGMMA_TOKENS[-1] and cuda_w4.wgmma_available():
            return cuda_w4.w4a16_wgmma_gemm(x, qw, bias, wgmma_config(m, n, k), counters=_counters)
        cfg = _w4_triton_config(m, n, k, "swapb")
    if cfg is not None and cfg.kernel == "tile":
        if x.is_cuda and x.dtype == torch.bfloat16 and m <= cuda_w4.TILE_MAX_M and cuda_w4.available():
            return cuda_w4.w4a16_tile_gemm(x, qw, bias, w4_tile_config(m, n, k), counters=_counters)
        cfg = _w4_triton_config(m, n, k, "swapb")
    if cfg is not None and cfg.kernel in ("swap", "swap16", "swapb", "gemv"):
        if not is_w4_g128(qw):
            raise ValueError(f"{cfg.kernel} kernel needs int4 weights with group 128, got {qw.scheme.name}")
        return w4_gemm(x, qw, bias, cfg)
    if (cfg is not None and cfg.kernel == "dequant") or (
        cfg is None and WO_DEQUANT_MIN_M is not None and m >= WO_DEQUANT_MIN_M
    ):
        return torch.nn.functional.linear(x, dequantize(qw, x.dtype), bias)
    cfg = cfg or wo_config(m, n, k)
    nchunk = qw.qdata.shape[1] * 8 // qw.scheme.weight_bits // PACK_K
    tiles = _cdiv(m, cfg.bm) * _cdiv(n, cfg.bn)
    split, per = _pick_split(tiles, nchunk, num_sms(x.device), cfg.split_k)
    scales = qw.scales.view(torch.uint8) if qw.scales.dtype == torch.float8_e4m3fn else qw.scales
    zeros = qw.zeros if qw.zeros is not None else scales
    gs = qw.global_scale if qw.global_scale is not None else scales
    out, part, cnt = _outputs(m, n, split, tiles, x.dtype, x.device)
    tk.wo_gemm_kernel[(tiles, split)](
        x, qw.qdata, scales, zeros, gs, bias if bias is not None else scales, out, part, cnt,
        m, n, k, nchunk, per, split,
        x.stride(0), qw.qdata.stride(0), scales.stride(0), out.stride(0),
        FMT=_wo_fmt(qw), BITS=qw.scheme.weight_bits, G=qw.scheme.group_size,
        BM=cfg.bm, BN=cfg.bn, IS_SPLIT=split > 1, GROUP_M=cfg.group_m, HAS_BIAS=bias is not None,
        POST_SCALE=cfg.post_scale and qw.scheme.weight_format == "int" and qw.scheme.group_size % PACK_K == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def dequantize(qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Packed sub-byte weight -> ``[N, K]`` in ``dtype`` with one Triton launch."""
    n, k = qw.shape
    if not qw.scheme.packed:
        return qw.dequantize(dtype)
    nchunk = qw.qdata.shape[1] * 8 // qw.scheme.weight_bits // PACK_K
    scales = qw.scales.view(torch.uint8) if qw.scales.dtype == torch.float8_e4m3fn else qw.scales
    zeros = qw.zeros if qw.zeros is not None else scales
    gs = qw.global_scale if qw.global_scale is not None else scales
    out = torch.empty(n, k, dtype=dtype, device=qw.qdata.device)
    bn = 16 if _interpreting(out) else 64
    tk.dequant_kernel[(_cdiv(n, bn), nchunk)](
        qw.qdata, scales, zeros, gs, out, n, k, qw.qdata.stride(0), scales.stride(0), out.stride(0),
        FMT=_wo_fmt(qw), BITS=qw.scheme.weight_bits, G=qw.scheme.group_size, BN=bn, num_warps=4,
    )
    return out


def int8_gemm(
    xq: torch.Tensor, sx: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
    out_dtype: torch.dtype, cfg: TileConfig | None = None,
) -> torch.Tensor:
    """``(xq [M, K] @ W.T) * sx * sw`` (+ bias): int8 (int32 accumulation) or e4m3 (fp32)."""
    m, k = xq.shape
    n = qw.shape[0]
    cfg = cfg or int8_config(m, n, k)
    if cfg.kernel == "tma" and _tma_ok(xq) and _tma_ok(qw.qdata):
        return _w8a8_tma_gemm(xq, sx, qw, bias, out_dtype, cfg)
    kblocks = _cdiv(k, cfg.bk)
    tiles = _cdiv(m, cfg.bm) * _cdiv(n, cfg.bn)
    split, per = _pick_split(tiles, kblocks, num_sms(xq.device), cfg.split_k)
    out, part, cnt = _outputs(m, n, split, tiles, out_dtype, xq.device)
    tk.int8_gemm_kernel[(tiles, split)](
        xq, qw.qdata, sx, qw.scales, bias if bias is not None else sx, out, part, cnt,
        m, n, k, per, split, xq.stride(0), qw.qdata.stride(0), out.stride(0),
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, IS_SPLIT=split > 1, GROUP_M=cfg.group_m, HAS_BIAS=bias is not None,
        ACC_INT=xq.dtype == torch.int8, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _tma_work(tiles: int, kblocks: int, slots: int, split_k: int) -> tuple[int, int, int]:
    """Work items of ``w8a8_tma_kernel`` on ``slots`` resident programs: (tiles done whole,
    K splits of each other tile, K blocks per split).

    ``split_k > 1``: every tile split in about that many parts. ``split_k < 0`` (tail split):
    the tiles of the full waves whole, the ``r`` tiles of the last, partial wave split in
    ``slots // r`` parts (>= 2 K blocks each), so that wave runs as one short full wave
    instead of ``r`` programs with the rest of the GPU idle (7B qkv at M = 1024: 288 tiles of
    128 x 128, 132 SMs: 264 whole, 24 split in 5). Else every tile whole."""
    if split_k < 0:
        whole = tiles - tiles % slots
        split = min(slots // (tiles - whole), kblocks // 2) if tiles > whole else 1
    else:
        whole, split = (0, split_k) if split_k > 1 else (tiles, 1)
    if split <= 1:
        return tiles, 1, kblocks
    per = _cdiv(kblocks, split)
    return whole, _cdiv(kblocks, per), per


def _tma_ok(t: torch.Tensor) -> bool:
    """A TMA descriptor needs a 16-byte aligned base and row stride (K % 16 == 0 for 8-bit)."""
    return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def _w8a8_tma_gemm(xq, sx, qw, bias, out_dtype, cfg: TileConfig, gated: bool = False):
    """The TMA kernel; ``gated``: ``qw`` is a ``[gate; up]`` projection and the result is
    ``(silu(g) * u [M, N / 2], row-max partials fp32 [M, tiles along N / 2])``. ``cfg.split_k
    > 1`` splits K (plain GEMM only: the gated epilogue is not linear)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = xq.shape
    n = qw.shape[0] // 2 if gated else qw.shape[0]
    n_tiles = _cdiv(n, cfg.bn)
    tiles = _cdiv(m, cfg.bm) * n_tiles
    kblocks = _cdiv(k, cfg.bk)
    slots = int(num_sms(xq.device) * max(cfg.waves, 1))
    whole, split, per = _tma_work(tiles, kblocks, slots, cfg.split_k)
    if gated and split > 1:
        raise ValueError("the gated W8A8 GEMM cannot split K (its SiLU-and-mul epilogue needs whole sums)")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    part = cnt = out
    if split > 1:  # compact partials of the split tiles (see w8a8_tma_kernel)
        part = torch.empty(split * (tiles - whole) * cfg.bm * cfg.bn, dtype=torch.float32, device=xq.device)
        cnt = _counters(xq.device, tiles)
    amax = torch.empty(m, n_tiles, dtype=torch.float32, device=xq.device) if gated else out
    progs = min(whole + (tiles - whole) * split, slots)
    a_desc = TensorDescriptor.from_tensor(xq, [cfg.bm, cfg.bk])
    b_desc = TensorDescriptor.from_tensor(qw.qdata, [cfg.bn, cfg.bk])
    tk.w8a8_tma_kernel[(progs,)](
        a_desc, b_desc, sx, qw.scales, bias if bias is not None else sx, out, amax, part, cnt,
        m, n, k, out.stride(0), progs, per, split, whole,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, HAS_BIAS=bias is not None,
        ACC_INT=xq.dtype == torch.int8, GATED=gated, IS_SPLIT=split > 1, WS=cfg.ws, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        # gated: silu(g) * u must round as the engine's SiLU-and-mul kernel does (no FMA contraction)
        **({"enable_fp_fusion": False} if gated else {}),
    )
    return (out, amax) if gated else out


# Gated kernel tiles (two weight tiles per stage). H200 run 13 (bench/gated_sweep.py,
# bench/results/gated_sweep_h200.json): 7B gate_up + SiLU-and-mul + down's quantizer, against
# the plain GEMM + SiLU-and-mul + quantizer and bf16's GEMM + SiLU-and-mul (76 us at M = 64):
# fp8 M = 64: 64 x 64 x 128, 3 stages, 3 programs per SM 41.9 us (4 stages x 2: 51.3, 64 x 32:
# 47-52, BM 128: 74-76; plain 50.9); M = 32: 43.2 (plain 57.2).
# int8 M = 64: 64 x 32 x 128, 4 stages, 3 per SM 45.8 (64 x 64: 51-52; plain 49.9); M = 128:
# 56.2 (plain 60.8); from M = 256 no gated tile beat the plain path (90.6 vs 90.2 at best).
_GATED_FP8 = TileConfig(64, 64, 128, num_warps=4, num_stages=3, waves=3, kernel="tma")
_GATED_INT8 = TileConfig(64, 32, 128, num_warps=4, num_stages=4, waves=3, kernel="tma")
GATED_INT8_MAX_M = 128


def gated_config(m: int, n: int, k: int, act_format: str) -> TileConfig | None:
    """Tile of the gated W8A8 GEMM (``[gate; up]`` of ``n`` rows, SiLU-and-mul in the
    epilogue) at M rows, or None where the engine runs the plain GEMM and a separate
    SiLU-and-mul: M <= 16 (the plain GEMM splits K, which a non-linear epilogue cannot), K >
    8192, and where the plain path measured as fast or faster (fp8 from M = 65, int8 from
    129; at M = 1024 / 4096 the int8 gated GEMM was 0.98x / 1.04x of it, run 14)."""
    if "gated" in CONFIG_OVERRIDES:
        return CONFIG_OVERRIDES["gated"](m, n, k)
    if m <= 16 or k > 8192:
        return None
    if act_format == "fp8":
        return _GATED_FP8 if m <= 64 else None
    return _GATED_INT8 if m <= GATED_INT8_MAX_M else None


def gated_silu_gemm(
    xq: torch.Tensor, sx: torch.Tensor, qw: QuantizedWeight, out_dtype: torch.dtype, cfg: TileConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``silu(g) * u`` of a W8A8 ``[gate; up]`` projection on quantized input, in one GEMM:
    ``(y [M, N / 2], row-max partials)`` for :func:`act_quant_from_partials`; None when no
    gated tile applies (see :func:`gated_config`) or TMA cannot describe the operands."""
    m, k = xq.shape
    n = qw.shape[0]
    if n % 2:
        raise ValueError(f"a [gate; up] weight has an even number of rows, got {n}")
    cfg = cfg or gated_config(m, n, k, qw.scheme.act_format)
    if cfg is None or not (_tma_ok(xq) and _tma_ok(qw.qdata)):
        return None
    return _w8a8_tma_gemm(xq, sx, qw, None, out_dtype, cfg, gated=True)


def act_quant_from_partials(y: torch.Tensor, amax: torch.Tensor, act_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``act_quant(y)`` when the kernel that wrote ``y [M, K]`` also wrote its row maxima
    as partials ``amax [M, P]``: one parallel pass over y (no per-row reduction over K)."""
    m, k = y.shape
    q, q_arg, s = act_quant_buffers(m, k, act_format, y.device)
    if m == 0:
        return q, s
    block = 64 if _interpreting(y) else 2048
    p = amax.shape[1]
    tk.act_quant_partials_kernel[(m, _cdiv(k, block))](
        y, amax, q_arg, s, k, p, y.stride(0), q.stride(0), IS_FP8=act_format == "fp8", BLOCK=block,
        PBLOCK=min(triton_next_pow2(p), 512), num_warps=4, enable_fp_fusion=False,
    )
    return q, s


def w4a8_gemm(
    xq: torch.Tensor, sx: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
    out_dtype: torch.dtype, cfg: TileConfig | None = None,
) -> torch.Tensor:
    m, k = xq.shape
    n = qw.shape[0]
    if qw.scheme.group_size not in (64, 128) or not qw.scheme.symmetric:
        raise ValueError("w4a8 kernel needs symmetric int4 with group 64 or 128")
    cfg = cfg or w4a8_config(m, n, k)
    nchunk = qw.qdata.shape[1] * 2 // PACK_K
    tiles = _cdiv(m, cfg.bm) * _cdiv(n, cfg.bn)
    split, per = _pick_split(tiles, nchunk, num_sms(xq.device), cfg.split_k)
    out, part, cnt = _outputs(m, n, split, tiles, out_dtype, xq.device)
    tk.w4a8_gemm_kernel[(tiles, split)](
        xq, qw.qdata, sx, qw.scales, bias if bias is not None else sx, out, part, cnt,
        m, n, k, nchunk, per, split,
        xq.stride(0), qw.qdata.stride(0), qw.scales.stride(0), out.stride(0),
        G=qw.scheme.group_size, BM=cfg.bm, BN=cfg.bn, IS_SPLIT=split > 1, GROUP_M=cfg.group_m,
        HAS_BIAS=bias is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def fp8_gemm_quantized(
    xq: torch.Tensor, sx: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None,
    out_dtype: torch.dtype, cfg: TileConfig | None = None,
) -> torch.Tensor:
    """``(xq @ W.T) * sx * sw + bias`` for e4m3 ``xq [M, K]``: either the Triton GEMM
    (``int8_gemm_kernel`` on e4m3, scales + bias in its epilogue) or row-wise scaled
    ``torch._scaled_mm`` on CUDA (dequantized matmul where that cannot run)."""
    n, k = qw.shape
    m = xq.shape[0]
    cfg = cfg or fp8_config(m, n, k)
    if cfg.kernel != "cublas":
        return int8_gemm(xq, sx, qw, bias, out_dtype, cfg)
    if xq.device.type != "cuda" or n % 16 or k % 16:  # cuBLASLt fp8 needs N, K % 16 == 0
        y = (xq.float() * sx[:, None]) @ qw.dequantize(torch.float32).T
        return (y + bias.float() if bias is not None else y).to(out_dtype)
    return torch._scaled_mm(
        xq, qw.qdata.t(), scale_a=sx[:, None], scale_b=qw.scales[None, :], out_dtype=out_dtype,
        bias=bias.to(out_dtype) if bias is not None else None,
    )


def linear_quantized_input(
    xq: torch.Tensor, sx: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """The GEMM of a W8A8 / W4A8 scheme on activations already quantized per token:
    ``act_quant``'s output, or that of a kernel that fused the quantizer into the op
    before (the engine's RMSNorm and SiLU-and-mul)."""
    sc = qw.scheme
    if sc.act_format == "fp8":
        return fp8_gemm_quantized(xq, sx, qw, bias, out_dtype)
    if sc.act_format != "int8":
        raise ValueError(f"{sc.name} does not quantize activations")
    if sc.packed:
        return w4a8_gemm(xq, sx, qw, bias, out_dtype)
    return int8_gemm(xq, sx, qw, bias, out_dtype)


def linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """Fast quantized ``x [M, K] @ W.T + bias`` for any quantized scheme."""
    sc = qw.scheme
    if not x.is_contiguous():
        x = x.contiguous()
    if sc.act_format in ("fp8", "int8"):
        xq, sx = act_quant(x, sc.act_format)
        return linear_quantized_input(xq, sx, qw, bias, x.dtype)
    return wo_gemm(x, qw, bias)
