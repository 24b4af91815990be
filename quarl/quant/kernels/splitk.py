"""Split-K: the one planner every GEMM launcher asks, and the arrival counters.

A GEMM over few output tiles leaves most SMs idle; splitting K gives each tile several
programs whose fp32 partial sums the last-arriving program adds in split order (one
launch, deterministic). Three rules, all returning a :class:`SplitPlan`:

* :func:`fill`: every tile split alike until the grid has about ``target`` programs;
* :func:`tail`: the tiles of the full waves whole, those of the last, partial wave split to
  fill it (``slots // rest`` ways), so that wave runs as one short full wave instead of
  ``rest`` programs with the rest of the GPU idle;
* :func:`clustered`: splits capped at the portable cluster size, for kernels that sum
  them through distributed shared memory instead of global partials.

:func:`stream_k` is the other kind of plan: every block an equal share of all (tile, K block)
units, whatever the tile count (:class:`StreamK`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

MAX_CLUSTER = 8  # portable thread-block cluster size: the most K splits one cluster sums


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SplitPlan(NamedTuple):
    whole: int  # tiles (column blocks) computed over all of K, first in the grid
    split: int  # K splits of every other tile
    per: int  # K blocks (chunks, groups) per split
    cluster: int = 0  # > 0: the splits of a tile form one cluster of this size

    def programs(self, tiles: int) -> int:
        return self.whole + (tiles - self.whole) * self.split


def even(tiles: int, kblocks: int, split: int) -> SplitPlan:
    """Every tile split about ``split`` ways (no split part empty)."""
    if split <= 1:
        return SplitPlan(tiles, 1, kblocks)
    per = cdiv(kblocks, split)
    return SplitPlan(0, cdiv(kblocks, per), per)


def fill(tiles: int, kblocks: int, target: float, cap: int, nearest: bool = False) -> SplitPlan:
    """Every tile split until ``tiles x split`` is about ``target`` programs (rounded up, or to
    the nearest), at most ``cap`` ways."""
    want = round(target / tiles) if nearest else cdiv(int(target), tiles)
    return even(tiles, kblocks, max(1, min(want, cap)))


def tail(tiles: int, kblocks: int, slots: int) -> SplitPlan:
    """Only the ``r`` tiles of the last wave of ``slots`` split, ``slots // r`` ways (>= 2 K
    blocks each); ``whole == tiles``: no split."""
    whole = tiles - tiles % slots
    split = min(slots // (tiles - whole), kblocks // 2) if tiles > whole else 1
    if split <= 1:
        return SplitPlan(tiles, 1, kblocks)
    per = cdiv(kblocks, split)
    return SplitPlan(whole, cdiv(kblocks, per), per)


def clustered(plan: SplitPlan, tiles: int, kblocks: int) -> SplitPlan:
    """``plan`` summed inside thread-block clusters where every tile is split (at most
    :data:`MAX_CLUSTER` splits, none empty); else unchanged."""
    if plan.split <= 1 or plan.whole != 0:
        return plan
    per = cdiv(kblocks, min(plan.split, MAX_CLUSTER))
    split = cdiv(kblocks, per)
    return SplitPlan(0, split, per, split) if split > 1 else SplitPlan(tiles, 1, kblocks)


class StreamK(NamedTuple):
    """The stream-K partition (the wgmma kernel's ``WgConfig.streamk``): ``units = tiles x
    kblocks``, block b of ``blocks`` takes units ``[b units // blocks, (b + 1) units // blocks)``
    (tile ``u // kblocks``, K block ``u % kblocks``); a tile is cut into at most ``pieces``."""

    blocks: int
    units: int
    pieces: int

    def block_of(self, u: int) -> int:
        """The block that holds unit ``u`` (the largest b with ``b units // blocks <= u``)."""
        return ((u + 1) * self.blocks + self.units - 1) // self.units - 1

    def items(self, b: int, kblocks: int) -> list[tuple[int, int, int, int, int]]:
        """Block ``b``'s work in order, as the kernel walks it: ``(tile, first K block, K blocks,
        piece, pieces of the tile)``."""
        u, u1, out = b * self.units // self.blocks, (b + 1) * self.units // self.blocks, []
        while u < u1:
            t = u // kblocks
            t0 = t * kblocks
            g1 = min(kblocks, u1 - t0)
            first, last = self.block_of(t0), self.block_of(t0 + kblocks - 1)
            out.append((t, u - t0, g1 - (u - t0), b - first, last - first + 1))
            u = t0 + g1
        return out


@functools.lru_cache(maxsize=256)
def stream_k(tiles: int, kblocks: int, blocks: int) -> StreamK:
    """The stream-K partition of ``tiles x kblocks`` units over at most ``blocks`` blocks (one a
    unit at least). The kernel does its index arithmetic in 32 bits: ``units x blocks`` must
    stay under 2^31."""
    units = tiles * kblocks
    blocks = max(1, min(blocks, units))
    if units * blocks >= 1 << 31:
        raise ValueError(f"stream-K: {tiles} tiles x {kblocks} K blocks on {blocks} blocks overflows the kernel's "
                         f"32-bit unit arithmetic; use a plan without streamk")
    plan = StreamK(blocks, units, 1)
    pieces = max(plan.block_of(t * kblocks + kblocks - 1) - plan.block_of(t * kblocks) + 1 for t in range(tiles))
    return plan._replace(pieces=pieces)


def pointer_split(tiles: int, kblocks: int, sms: int, split_k: int) -> SplitPlan:
    """The Triton pointer kernels' rule: ``split_k > 0`` fixed; else split only while the
    tiles do not fill the GPU, until ~``-split_k`` (default 2) waves, >= 2 K blocks each."""
    if split_k > 0:
        return even(tiles, kblocks, split_k)
    if tiles >= sms:
        return SplitPlan(tiles, 1, kblocks)
    return fill(tiles, kblocks, (-split_k or 2) * sms, max(kblocks // 2, 1))


class SplitCounters:
    """Zeroed int32 arrival counters of split-K launches, one buffer per device.

    Kernels leave them at zero, so a buffer is allocated once and reused. It must be
    allocated (and zeroed) eagerly: a buffer made during CUDA-graph capture would only be
    zeroed when that particular graph replays, and another graph could read it first. Run
    one eager forward before capturing (warm-up does this)."""

    def __init__(self) -> None:
        self._bufs: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, n: int) -> torch.Tensor:
        buf = self._bufs.get(device)
        if buf is None or buf.numel() < n:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("split-K counters are first needed inside CUDA-graph capture; run the same "
                                   "forward eagerly once before capturing")
            buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
            self._bufs[device] = buf
        return buf


COUNTERS = SplitCounters()


def outputs(m: int, n: int, split: int, tiles: int, dtype: torch.dtype, device: torch.device):
    """``(out [m, n], fp32 partials [split, m, n], counters)`` of a split launch (out stands
    in for the two when ``split == 1``)."""
    out = torch.empty(m, n, dtype=dtype, device=device)
    if split == 1:
        return out, out, out
    return out, torch.empty(split, m, n, dtype=torch.float32, device=device), COUNTERS.get(device, tiles)
