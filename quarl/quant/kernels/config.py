"""Typed configs of the GEMM kernels: what a dispatch row hands its kernel.

Pure data (no torch, no triton): the dispatch tables (:mod:`.dispatch`) are built from
these, and sweeps pass them to the kernels directly or through ``dispatch.overrides``.
"""

from __future__ import annotations

from typing import NamedTuple


class TileConfig(NamedTuple):
    """Tile of a Triton GEMM (weight-only ``wo_gemm_kernel``, the int4 swap kernel, the W8A8
    pointer and TMA kernels, the W4A8 kernel)."""

    bm: int
    bn: int
    bk: int = 128  # W8A8 kernels only; sub-byte kernels always walk 128-column chunks
    # pointer kernels: 0 = split K until ~2 waves of programs, > 0 = that many splits,
    # -w = until ~w waves. TMA kernel: 0 / 1 = no split, > 1 = every tile about that many
    # ways, < 0 = split only the tiles of the last, partial wave (splitk.tail).
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    post_scale: bool = True  # weight-only int formats with G % 128 == 0: scale partial sums
    # swap kernel: > 0 splits K until about waves x SMs programs even when the tiles alone
    # fill the GPU (short programs, many resident per SM, hide the per-chunk latency chain).
    # TMA kernel: resident programs per SM of its persistent grid.
    waves: float = 0


class FragConfig(NamedTuple):
    """The CUDA fragment kernel (``w4a16_frag``, M <= 16)."""

    nw: int = 4  # warps per block (they split the block's groups)
    blocks_per_sm: float = 4.0  # split K until about this many blocks per SM
    stages: int = 4  # cp.async ring slots per warp (2, 4 or 8; nw x stages <= 32: static smem)

    def check(self) -> None:
        if self.stages not in (2, 4, 8) or self.nw not in (1, 2, 4, 8) or self.nw * self.stages > 32:
            raise ValueError(f"fragment kernel: nw in 1/2/4/8, stages in 2/4/8 and nw x stages <= 32 "
                             f"(48 KB of static shared memory); got {self}")


class TileKConfig(NamedTuple):
    """Block shape of the block-tiled CUDA kernel (``w4a16_tile``): SW slabs x (8 / NT) warps
    along N, WM warps along M, each warp MT m16 tiles x NT n8 tiles; ST ring slots (one
    group each) in dynamic shared memory."""

    sw: int = 4
    nt: int = 4
    mt: int = 4
    wm: int = 1
    stages: int = 3
    blocks_per_sm: float = 2.0  # split K until about this many blocks per SM

    @property
    def warps(self) -> int:
        return self.sw * (8 // self.nt) * self.wm

    @property
    def rows(self) -> int:
        return 16 * self.mt * self.wm

    def smem_bytes(self) -> int:
        return self.stages * (4096 * (self.sw + self.mt * self.wm) + 512 * self.sw)  # (+ zero points)

    def check(self, m: int) -> None:
        if self.nt not in (2, 4, 8) or self.stages < 2 or self.warps * 32 > 1024 or min(self.sw, self.mt, self.wm) < 1:
            raise ValueError(f"block-tiled w4 kernel: NT in 2/4/8, >= 2 stages, <= 32 warps; got {self}")
        if m > self.rows:
            raise ValueError(f"block-tiled w4 kernel: {self} covers {self.rows} rows, got M={m}")
        if self.smem_bytes() > 227 * 1024:
            raise ValueError(f"block-tiled w4 kernel: {self} needs {self.smem_bytes()} bytes of shared memory "
                             "(> 227 KB)")


WGMMA_TOKENS = (8, 16, 32, 64, 128)  # wgmma N sides compiled: M is padded up to the next one


def wgmma_tokens(m: int) -> int:
    for n in WGMMA_TOKENS:
        if m <= n:
            return n
    raise ValueError(f"wgmma w4 kernel takes M <= {WGMMA_TOKENS[-1]}, got M={m}")


class WgConfig(NamedTuple):
    """Block shape of the wgmma kernel (``w4a16_wgmma``, Hopper): NWG warpgroups (one 64-row
    slab each) sharing the activation tile; ``stages`` ring slots of one group each."""

    nwg: int = 2
    stages: int = 4
    blocks_per_sm: float = 1.0  # split K until about this many blocks per SM
    single: bool = False  # one fp32 tile: each group's wgmmas waited for before its fold
    minb: int = 1  # __launch_bounds__ blocks per SM (caps registers at 64K / (minb x threads))
    tail: bool = False  # blocks_per_sm = resident slots per SM; split K of the last wave only
    cluster: bool = False  # sum the K splits through distributed shared memory (all column blocks split)
    mbar: bool = False  # single-tile loop with per-slot mbarriers instead of a block barrier per group
    # weights scaled before the MMA, bf16((u - z) s) as the learner dequantizes them: one fp32
    # tile over all of K, the wgmmas streamed back to back (half a group in flight)
    prescale: bool = False
    # the pre-scaled loop in tiles of this many tokens (192: m64n192k16, 96 fp32 accumulators a
    # thread, 4 slots of 56 KB; 256: m64n256k16, 128 accumulators, 3 slots of 72 KB; 1-2
    # warpgroups): each dequantized weight feeds 1.5-2x the tokens; 0: 128-token tiles
    tile: int = 0
    # with tile 192 / 256: ring slots of half a group (64 columns of K), each refilled after its
    # own block barrier, so 6-8 slots keep copies 2-3 groups ahead
    halves: bool = False
    # the mbarrier loop (mbar=True) or the pre-scaled loop (prescale=True) with its copies made
    # by the bulk-copy engine (TMA): one thread issues each slot's activation tile (a tensor
    # map) and weight words, the others only compute; that loop's output bit for bit, no LoRA
    tma: bool = False
    # the pre-scaled TMA loop (prescale=True, tma=True, 2-3 warpgroups, no cluster) with one more
    # warpgroup that only issues the copies, every slot in flight; the computing warpgroups take
    # its registers (setmaxnreg): that loop's output bit for bit
    producer: bool = False

    @property
    def threads(self) -> int:
        return (self.nwg + self.producer) * 128

    def producer_fits(self) -> bool:
        """Whether this loop can take a producer warpgroup (``producer``): the pre-scaled TMA loop
        of 2-3 computing warpgroups, one block a SM (their registers), no cluster."""
        return self.prescale and self.tma and not self.cluster and self.nwg in (2, 3) and self.minb == 1

    def smem_bytes(self, ntok: int) -> int:
        if self.halves:
            return self.stages * (ntok * 128 + self.nwg * 2048) + 1024
        return self.stages * (ntok * 256 + self.nwg * 4096) + 1024  # (+ 1024: alignment of the ring)

    def tile_tokens(self, m: int) -> int:
        """Token rows of one block's activation tile (the wgmma N side) for M = ``m``."""
        return self.tile or wgmma_tokens(min(m, WGMMA_TOKENS[-1]))

    def check(self, m: int) -> None:
        if (self.nwg not in (1, 2, 3, 4) or self.stages < 3 or self.blocks_per_sm <= 0
                or not 1 <= self.minb * self.nwg <= 16):
            raise ValueError(f"wgmma w4 kernel: 1-4 warpgroups, >= 3 stages, blocks_per_sm > 0, "
                             f"1 <= minb x nwg <= 16; got {self}")
        if self.mbar and not (self.single and self.stages >= 4):
            raise ValueError(f"wgmma w4 kernel: mbar=True runs the single-tile loop with >= 4 stages; got {self}")
        if self.prescale and (self.single or self.mbar):
            raise ValueError(f"wgmma w4 kernel: prescale=True runs its own loop (single=False, mbar=False); got {self}")
        if m > WGMMA_TOKENS[-1] and not self.prescale:
            raise ValueError(f"wgmma w4 kernel takes M <= {WGMMA_TOKENS[-1]} (the pre-scaled loop, prescale=True, "
                             f"any M in {WGMMA_TOKENS[-1]}-token tiles), got M={m}")
        if self.tile and not (self.tile in (192, 256) and self.prescale and self.nwg <= 2 and self.minb == 1):
            raise ValueError(f"wgmma w4 kernel: tile=192 or 256 runs the pre-scaled loop (prescale=True) with 1-2 "
                             f"warpgroups and minb=1 (its 96-128 accumulators take most of 255 registers); got {self}")
        if self.tma and not (self.mbar or self.prescale):
            raise ValueError(f"wgmma w4 kernel: tma=True feeds the mbarrier loop (single=True, mbar=True) or the "
                             f"pre-scaled loop (prescale=True); got {self}")
        if self.producer and not self.producer_fits():
            raise ValueError(f"wgmma w4 kernel: producer=True feeds the pre-scaled TMA loop (prescale=True, tma=True) "
                             f"of 2-3 warpgroups, minb=1, no cluster; got {self}")
        if self.halves and not (self.tile and self.stages >= 4):
            raise ValueError(f"wgmma w4 kernel: halves=True runs 192- or 256-token tiles (tile=192 / 256) with "
                             f">= 4 half-group slots; got {self}")
        ntok = self.tile_tokens(m)
        m = min(m, WGMMA_TOKENS[-1])
        if wgmma_tokens(m) > 64 and not (self.single or self.prescale):
            raise ValueError(f"wgmma w4 kernel: M={m} (128 tokens) needs single=True or prescale=True (a second "
                             f"fp32 tile of 64 registers a thread would spill); got {self}")
        smem = self.smem_bytes(ntok)
        if smem > 227 * 1024:
            raise ValueError(f"wgmma w4 kernel: {self} needs {smem} bytes of shared memory at M={m} (> 227 KB)")
