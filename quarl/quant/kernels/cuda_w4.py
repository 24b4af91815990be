"""W4A16 (int4, groups of 128, fp32 scales) GEMMs for decode-sized M, as CUDA kernels.

Why CUDA and not Triton: at small M the GEMM only has to stream the packed weight, and the
Triton kernels plateau well under the memory bandwidth (docs/kernels.md): each 64x128 chunk
goes global -> shared -> registers and is unpacked in a layout Triton picks. Here the weight
is repacked once into the order in which the ``mma.sync.m16n8k16`` B fragments sit in
registers (:mod:`.w4_layout`, kept by a :class:`~.w4_layout.RepackCache` that the owning
module holds), so each thread loads its fragments with 16-byte loads and unpacks 8 codes
with 3 shifts, 4 ``lop3`` and 4 ``fma.bf16x2`` (no shuffles). The source (``w4a16.cu``,
package data) is compiled at first use with NVRTC, so nothing is built at install time, and
the binaries are kept on disk for later processes (:mod:`.nvrtc_cache`).

Numerics are those of the Triton small-M kernel: ``(u - z)`` is exact in bf16, each group's
products are summed by the tensor cores in fp32 and scaled by the fp32 group scale, ``acc +=
s_g * sum_k x_k (u_k - z)``; the split-K partial sums are added in split order by the
last-arriving block (deterministic). The wgmma kernel's pre-scaled loop (``WgConfig.prescale``)
has the learner's numerics instead: each weight is ``bf16((u - z) s)`` (one bf16 fused
multiply, exact before its one rounding because the quantizer's scales are bf16 values:
:func:`~quarl.quant.reference.bf16_scale`), as :func:`~quarl.quant.kernels.weight_only.dequantize`
writes it in fp32, and one fp32 tile
accumulates all of K, so the result is ``x @ dequantize(W).T`` summed in another order.

Three kernels read that layout. ``w4a16_frag`` (M <= 16): every warp streams its own slab
and K range through a private cp.async ring, activation tile included. ``w4a16_tile`` (M <=
64): a block owns SW adjacent slabs and a K range; one ring slot holds a whole group (the
slabs' fragments, the activation tile of all M rows, the group's scales and zero points) and
is shared by the block's warps. On Hopper, ``w4a16_wgmma`` (M <= 128) feeds the dequantized
weights to wgmma as its register A operand; its ``w4a16_wgmma_cluster`` entry runs the K
splits of a column block as one thread-block cluster and sums them through distributed
shared memory, in the same order; its ``w4a16_wgmma_tma`` entries (``WgConfig.tma``) run the
mbarrier loop with the copies made by the bulk-copy engine (TMA: a tensor map of the
activations, :func:`x_tensor_map`), the same sums bit for bit; its ``w4a16_wgmma_tma_ws``
entry (``WgConfig.producer``) runs the pre-scaled TMA loop with one more warpgroup that only
issues the copies and hands its registers to the others, again the same sums bit for bit.
"""
from __future__ import annotations

import ctypes
import functools
import struct
from importlib import resources

import torch

from quarl.quant.kernels import nvrtc_cache, splitk
from quarl.quant.kernels.config import FragConfig, TileKConfig, WgConfig, wgmma_tokens
from quarl.quant.kernels.cuda_launch import launch
from quarl.quant.kernels.device import num_sms, nvrtc_available
from quarl.quant.kernels.w4_layout import SLAB, RepackCache
from quarl.quant.qweight import QuantizedWeight

MAX_M = 16  # rows the fragment kernel takes (one m16 tile)
TILE_MAX_M = 64  # rows the block-tiled kernel takes (MT x WM m16 tiles)


@functools.lru_cache(maxsize=4)
def _read(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text()


def source(kind: str = "mma") -> str:
    """The CUDA source: ``w4a16.cu``, with the wgmma wrappers spliced in for ``kind="wgmma"``."""
    src = _read("w4a16.cu")
    return src.replace("//WGMMA_WRAPPERS//", _read("wgmma_bf16.cuh")) if kind == "wgmma" else src


def _tf(v: bool) -> str:
    return "true" if v else "false"


@functools.lru_cache(maxsize=32)
def _frag_kernel(nw: int, asym: bool, stages: int):
    return nvrtc_cache.compile_kernel(source(), f"w4a16_frag<{nw}, {_tf(asym)}, {stages}>", nvcc_options=["-std=c++17"])


@functools.lru_cache(maxsize=64)
def _tile_kernel(cfg: TileKConfig, asym: bool):
    name = f"w4a16_tile<{cfg.sw}, {cfg.nt}, {cfg.mt}, {cfg.wm}, {cfg.stages}, {_tf(asym)}>"
    kern = nvrtc_cache.compile_kernel(source(), name, nvcc_options=["-std=c++17"])
    kern.set_shared_memory_config(cfg.smem_bytes())
    return kern


@functools.lru_cache(maxsize=64)
def _wgmma_kernel(nwg: int, ntok: int, stages: int, asym: bool, smem: int, single: bool = False, minb: int = 1,
                  cs: int = 0, defines: tuple[str, ...] = (), mbar: bool = False, lr: int = 0, gated: bool = False,
                  prescale: int = 0, tma: bool = False, producer: bool = False):
    """``defines``: extra ``-D`` macros (``W4_TRACE``: timing probes, see the source);
    ``lr``: 64-column atoms of the LoRA term (0: none); ``gated``: the SiLU-and-mul epilogue;
    ``prescale``: the pre-scaled loop (``WgConfig.prescale``; 2: in half-group slots, ``WgConfig.halves``);
    ``tma``: copies by the bulk-copy engine (``WgConfig.tma``: the mbarrier or the pre-scaled loop);
    ``producer``: the pre-scaled TMA loop with a producer warpgroup (``WgConfig.producer``)."""
    args = f"{nwg}, {ntok}, {stages}, {_tf(asym)}, {_tf(single)}, {minb}, {_tf(mbar)}"
    tail = f"{lr}, {_tf(gated)}, {prescale}"
    name = f"w4a16_wgmma_cluster<{args}, {cs}, {tail}>" if cs else f"w4a16_wgmma<{args}, {tail}>"
    if tma:
        head = f"{nwg}, {ntok}, {stages}, {_tf(asym)}, {minb}"
        name = (f"w4a16_wgmma_tma_cluster<{head}, {cs}, {_tf(gated)}, {prescale}>" if cs else
                f"w4a16_wgmma_tma<{head}, {_tf(gated)}, {prescale}>")
    if producer:
        name = f"w4a16_wgmma_tma_ws<{nwg}, {ntok}, {stages}, {_tf(asym)}, {_tf(gated)}, {prescale}>"
    opts = ["-std=c++17", *(f"-D{d}" for d in defines)]
    kern = nvrtc_cache.compile_kernel(source("wgmma"), name, compute_capability="90a", nvcc_options=opts)
    kern.set_shared_memory_config(smem)
    return kern


# cuda.h: CUtensorMapDataType BFLOAT16, CUtensorMapSwizzle 128B, CUtensorMapL2promotion L2_256B
_TMAP_BF16, _TMAP_SWIZZLE_128B, _TMAP_L2_256B = 9, 3, 3
_TMAPS: dict[tuple, ctypes.Array] = {}


def x_tensor_map(x: torch.Tensor, rows: int) -> ctypes.Array:
    """The ``CUtensorMap`` (128 bytes) of bf16 ``x [M, K]`` (16-byte aligned rows) that the TMA
    loop reads in boxes of 64 columns x ``rows`` rows with the 128-byte swizzle (rows past M
    and columns past K read as zeros). Encoded by the driver once per (address, shape, stride)
    and kept: a CUDA graph replays the launch with the bytes it captured."""
    m, k = x.shape
    key = (x.device.index, x.data_ptr(), m, k, x.stride(0), rows)
    tmap = _TMAPS.get(key)
    if tmap is not None:
        return tmap
    lib = torch.cuda._utils._get_gpu_runtime_library()
    if not hasattr(lib, "cuTensorMapEncodeTiled"):
        raise RuntimeError("the TMA w4 loop needs cuTensorMapEncodeTiled: a CUDA 12 or later driver")
    buf = ctypes.create_string_buffer(128 + 64)  # the driver wants a 64-byte aligned map
    tmap = (ctypes.c_uint64 * 16).from_address(ctypes.addressof(buf) + -ctypes.addressof(buf) % 64)
    tmap._buf = buf  # (keeps the storage alive with the map)
    err = lib.cuTensorMapEncodeTiled(
        tmap, _TMAP_BF16, 2, ctypes.c_void_p(x.data_ptr()), (ctypes.c_uint64 * 2)(k, m),
        (ctypes.c_uint64 * 1)(x.stride(0) * 2), (ctypes.c_uint32 * 2)(64, rows), (ctypes.c_uint32 * 2)(1, 1),
        0, _TMAP_SWIZZLE_128B, _TMAP_L2_256B, 0)
    if err != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed for x {tuple(x.shape)} stride {x.stride(0)}: "
                           f"CUDA driver error {err}")
    if len(_TMAPS) >= 256:
        _TMAPS.clear()
    _TMAPS[key] = tmap
    return tmap


def _bf16_rows(x: torch.Tensor) -> torch.Tensor:
    """x with 16-byte aligned rows (the kernels copy activations 16 bytes at a time)."""
    k = x.shape[1]
    if k % 8 or x.stride(0) % 8 or x.data_ptr() % 16 or x.stride(1) != 1:
        x = torch.nn.functional.pad(x, (0, -k % 8)).contiguous()
    return x


def _args(x, fw, bias, out, part, cnt, n, plan: splitk.SplitPlan) -> list:
    m, k = x.shape
    groups, np_ = fw.scales.shape
    return [
        x, fw.qdata, fw.scales, fw.negz if fw.negz is not None else fw.scales,
        bias if bias is not None else out, out, part, cnt,
        m, n, k, x.stride(0), out.stride(0), np_, groups, plan.per, plan.split, int(bias is not None),
    ]


def _prepare(x, qw, bias, layout: str, repacked: RepackCache | None):
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the CUDA w4 kernels take bf16 x, got {x.dtype}")
    if bias is not None and bias.dtype != torch.bfloat16:
        bias = bias.to(torch.bfloat16)
    return _bf16_rows(x), bias, (repacked or RepackCache()).get(qw, layout)


def frag_gemm(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, cfg: FragConfig = FragConfig(),
              repacked: RepackCache | None = None) -> torch.Tensor:
    """``x [M, K] (bf16, M <= 16) @ W.T + bias`` with the fragment kernel. ``repacked``: the
    owner's cache of the fragment layout (None: repacked for this call only)."""
    m, n = x.shape[0], qw.shape[0]
    if m > MAX_M:
        raise ValueError(f"fragment kernel takes M <= {MAX_M}, got M={m}")
    cfg.check()
    x, bias, fw = _prepare(x, qw, bias, "frag", repacked)
    groups, slabs = fw.scales.shape[0], fw.scales.shape[1] // SLAB
    plan = splitk.fill(slabs, groups, cfg.blocks_per_sm * num_sms(x.device), splitk.cdiv(groups, cfg.nw))
    out, part, cnt = splitk.outputs(m, n, plan.split, slabs, torch.bfloat16, x.device)
    launch(_frag_kernel(cfg.nw, fw.negz is not None, cfg.stages), (slabs, plan.split, 1), (cfg.nw * 32, 1, 1),
           _args(x, fw, bias, out, part, cnt, n, plan))
    return out


def _blocked_split(cols: int, groups: int, sms: int, blocks_per_sm: float, tail: bool,
                   cluster: bool) -> splitk.SplitPlan:
    """The tile and wgmma kernels' K split over ``cols`` column blocks (see :mod:`.splitk`)."""
    if tail:
        plan = splitk.tail(cols, groups, max(1, round(blocks_per_sm * sms)))
    else:
        plan = splitk.fill(cols, groups, blocks_per_sm * sms, groups)
    return splitk.clustered(plan, cols, groups) if cluster else plan


def _launch_blocked(kernel_for, x, fw, bias, n: int, slabs_per_block: int, plan_args: tuple, threads: int,
                    smem: int, one_d: bool, extra: tuple = (), out_cols: int | None = None,
                    token_tiles: int = 1, tile_rows: int = 0, extra_tail: tuple = (),
                    trace: list | None = None) -> torch.Tensor:
    """Launch a kernel whose blocks own ``slabs_per_block`` slabs and a K range (the tile and
    wgmma kernels). ``kernel_for(asym, cluster_size)`` -> the kernel. ``one_d`` (wgmma): a
    1-D grid, the ``whole`` column blocks first, and a ``whole`` argument, then ``extra``.
    ``out_cols``: the output's width when it is not ``n`` (the gated epilogue: ``n / 2``).
    ``token_tiles`` > 1 (the wgmma kernel's pre-scaled loop): grid y over ``tile_rows``-row tiles
    of x, each with the same column blocks and K split (planned for that many times the blocks).
    ``trace`` (a list; the kernel built with ``W4_TRACE``): a zeroed int64 buffer of 12 words a
    block is passed after ``extra`` and before ``extra_tail``, and appended to the list with the
    grid."""
    m = x.shape[0]
    groups, np_ = fw.scales.shape
    cols = splitk.cdiv(np_ // SLAB, slabs_per_block)
    plan = _blocked_split(cols, groups, num_sms(x.device), plan_args[0] / token_tiles, *plan_args[1:])
    out = torch.empty(m, n if out_cols is None else out_cols, dtype=torch.bfloat16, device=x.device)
    part = cnt = out
    if plan.split > 1 and not plan.cluster:
        rows = m if token_tiles == 1 else token_tiles * tile_rows  # a stretch of tile_rows rows per tile
        part = torch.empty(plan.split, rows, n, dtype=torch.float32, device=x.device)
        cnt = splitk.COUNTERS.get(x.device, cols * token_tiles)
    args = _args(x, fw, bias, out, part, cnt, n, plan)
    grid = (cols, plan.split, 1)
    if one_d:
        grid = (plan.programs(cols), token_tiles, 1)
        args.append(plan.whole)
    args.extend(extra)
    if trace is not None:
        buf = torch.zeros(grid[0] * grid[1], 12, dtype=torch.int64, device=x.device)
        args.append(buf)
        trace.extend((buf, grid))
    args.extend(extra_tail)
    launch(kernel_for(fw.negz is not None, plan.cluster), grid, (threads, 1, 1), args, smem)
    return out


def tile_gemm(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, cfg: TileKConfig,
              repacked: RepackCache | None = None) -> torch.Tensor:
    """``x [M, K] (bf16, M <= 64) @ W.T + bias`` with the block-tiled kernel: same fragment
    layout and numerics as :func:`frag_gemm`, the activation tile shared by the block's warps."""
    cfg.check(x.shape[0])
    x, bias, fw = _prepare(x, qw, bias, "frag", repacked)
    kern = _tile_kernel(cfg._replace(blocks_per_sm=0.0), fw.negz is not None)
    return _launch_blocked(lambda asym, cs: kern, x, fw, bias, qw.shape[0], cfg.sw, (cfg.blocks_per_sm, False, False),
                           cfg.warps * 32, cfg.smem_bytes(), one_d=False)


def wgmma_available() -> bool:
    """NVRTC through torch and a Hopper GPU (sm_90a: wgmma)."""
    return nvrtc_available() and torch.cuda.get_device_capability() == (9, 0)


SMEM_PER_SM = 228 * 1024  # Hopper: shared memory of an SM (a block takes at most 227 KB of it, + 1 KB reserved)


def _lora_atoms(rank: int) -> int:
    return 1 if rank <= 64 else 2


def lora_smem_bytes(cfg: WgConfig, ntok: int, rank: int) -> int:
    """Shared memory the LoRA term adds to a wgmma block: per warpgroup, the t tile (64-column
    atoms of ``ntok`` rows) and the slab's B rows (row pitch 64 atoms + 8 bf16)."""
    lr = _lora_atoms(rank)
    return cfg.nwg * (lr * ntok * 128 + 64 * (lr * 64 + 8) * 2)


def takes_lora(cfg: WgConfig, x: torch.Tensor, lora) -> bool:
    """Whether the wgmma kernel with ``cfg`` adds ``lora`` (a :class:`~quarl.quant.ops.LoRATerm`)
    in its epilogue: rank <= 128, at most 3 members whose row starts (but the first) are
    64-row aligned, bf16 operands in 16-byte aligned rows, no gradient wanted, and shared
    memory for it without losing a block per SM; not the pre-scaled or the TMA loop."""
    xa, b = lora.xa, lora.b
    if cfg.prescale or cfg.tma:
        return False
    if lora.rank > 128 or len(lora.starts) > 3 or any(s % 64 for s in lora.starts[1:]):
        return False
    if xa.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or xa.shape[1] != b.shape[1] or b.shape[1] % 8:
        return False
    if xa.shape[0] != x.shape[0] or xa.stride(1) != 1 or b.stride(1) != 1:
        return False
    if xa.stride(0) % 8 or b.stride(0) % 8 or xa.data_ptr() % 16 or b.data_ptr() % 16:
        return False
    if torch.is_grad_enabled() and (xa.requires_grad or b.requires_grad):
        return False
    ntok = wgmma_tokens(x.shape[0])
    base = cfg.smem_bytes(ntok)
    smem = base + lora_smem_bytes(cfg, ntok, lora.rank)
    want = max(1, round(cfg.blocks_per_sm))

    def resident(nbytes: int) -> int:
        return min(want, SMEM_PER_SM // (nbytes + 1024))

    return smem <= 227 * 1024 and resident(smem) >= resident(base)


def _lora_args(lora, x: torch.Tensor) -> tuple:
    """The kernel's LoRA arguments (``lt, lb, ldt, ldb, lw, lscale_bits, lr1, lr2, lc0..lc2``;
    without a term, ``x`` stands in for the operands the kernel then never reads)."""
    if lora is None:
        return (x, x, 0, 0, 0, 0, 1 << 30, 1 << 30, 0, 0, 0)
    starts = (*lora.starts[1:], 1 << 30, 1 << 30)[:2]  # members 1 and 2 (none: past every row)
    cols = (*lora.cols, 0, 0)[:3]
    bits = struct.unpack("<i", struct.pack("<f", float(lora.scaling)))[0]
    return (lora.xa, lora.b, lora.xa.stride(0), lora.b.stride(0), lora.b.shape[1], bits, *starts, *cols)


def wgmma_gemm(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, cfg: WgConfig = WgConfig(),
               repacked: RepackCache | None = None, defines: tuple[str, ...] = (), lora=None,
               gated: bool = False, trace: list | None = None) -> torch.Tensor:
    """``x [M, K] (bf16, M <= 128) @ W.T + bias`` with the wgmma kernel (Hopper): same fragment
    words (reordered, :func:`~.w4_layout.wgmma_words`) and numerics as :func:`frag_gemm`; with
    ``cfg.prescale`` the learner's numerics (module docstring) and any M, in 128-row tiles.
    ``lora``: a :class:`~quarl.quant.ops.LoRATerm` the kernel adds to its fp32 tile before the
    one rounding to bf16 (check :func:`takes_lora` first). ``gated`` (``W = [gate; up]``, 2 I
    rows, I % 8 == 0, no bias, no LoRA term): ``silu(x gate^T) * (x up^T)`` ``[M, I]``, the
    engine's SiLU-and-mul in the epilogue: bit for bit the plain GEMM over the rows in the
    gated order (:func:`~.w4_layout.gated_rows`) then :func:`quarl.rollout.fused.silu_mul`; the
    same as over the weight as it is wherever the plan splits all column blocks alike (a tail
    plan splits only the last wave's, which then hold other rows: the same sums in another order).
    ``trace`` (a list): build the kernel with its timing probes (``W4_TRACE``) and append to the
    list the probes' buffer ``[blocks, 12]`` int64 and the grid (see :func:`wgmma_trace`)."""
    m = x.shape[0]
    if trace is not None and "W4_TRACE" not in defines:
        defines = (*defines, "W4_TRACE")
    cfg.check(m)
    if gated and (qw.shape[0] % 16 or bias is not None or lora is not None):
        raise ValueError(f"the gated w4 epilogue takes a [gate; up] weight of 2 I rows with I % 8 == 0, "
                         f"no bias and no LoRA term (got {qw.shape[0]} rows, bias {bias is not None}, "
                         f"LoRA {lora is not None})")
    if qw.shape[0] * qw.shape[1] // 2 >= 1 << 32 or m * x.stride(0) * 2 >= 1 << 32:  # the kernel's 32-bit byte offsets
        raise ValueError(f"wgmma w4 kernel: weight {tuple(qw.shape)} or activation rows past 4 GiB; split the layer")
    if lora is not None and lora.b.shape[0] != qw.shape[0]:
        raise ValueError(f"wgmma w4 kernel: the LoRA term's B has {lora.b.shape[0]} rows, the weight {qw.shape[0]}")
    if lora is not None and not takes_lora(cfg, x, lora):
        raise ValueError(f"wgmma w4 kernel: this LoRA term does not fit {cfg} (rank {lora.rank}, starts {lora.starts})")
    x, bias, fw = _prepare(x, qw, bias, "wgmma-gated" if gated else "wgmma", repacked)
    ntok = cfg.tile_tokens(m)
    lr = 0 if lora is None else _lora_atoms(lora.rank)
    smem = cfg.smem_bytes(ntok) + (0 if lora is None else lora_smem_bytes(cfg, ntok, lora.rank))

    def kernel_for(asym: bool, cs: int):
        return _wgmma_kernel(cfg.nwg, ntok, cfg.stages, asym, smem, cfg.single, cfg.minb, cs, defines, cfg.mbar, lr,
                             gated, 2 if cfg.halves else int(cfg.prescale), cfg.tma, cfg.producer)

    return _launch_blocked(kernel_for, x, fw, bias, qw.shape[0], cfg.nwg, (cfg.blocks_per_sm, cfg.tail, cfg.cluster),
                           cfg.threads, smem, one_d=True, extra=_lora_args(lora, x),
                           out_cols=qw.shape[0] // 2 if gated else None,
                           token_tiles=splitk.cdiv(m, ntok) if cfg.prescale else 1, tile_rows=ntok,
                           extra_tail=(x_tensor_map(x, ntok),) if cfg.tma else (), trace=trace)


# the probes of the wgmma kernel's W4_TRACE build (w4a16.cu): words 0-4 %globaltimer (ns) at
# entry, first group landed, main loop done, partials stored or output stores begun, output
# written; 5-9 %clock64 at the same points; 10 the SM
TRACE_POINTS = ("entry", "landed", "loop_done", "stores_begin", "written")


def wgmma_trace(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, cfg: WgConfig,
                repacked: RepackCache | None = None, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """One launch of the wgmma kernel built with its timing probes: ``(out, trace, grid)``, trace
    ``[blocks, 12]`` int64 (block ``y * grid[0] + x``; :data:`TRACE_POINTS`, a point a block does
    not pass left 0). The probes change the schedule a little; time with the plain build."""
    got: list = []
    out = wgmma_gemm(x, qw, bias, cfg, repacked, gated=gated, trace=got)
    return out, got[0], got[1]
