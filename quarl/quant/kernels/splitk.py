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
"""

from __future__ import annotations

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
