"""The dispatch tables as data: per kernel family and GPU row set, the rows :func:`.dispatch.lookup` tries.

A :class:`Row` gives a :class:`~.plan.Plan` (None in a gated family: run the plain GEMM and a
separate SiLU-and-mul) for M up to ``m_max`` when any of its :class:`When` conditions holds;
rows are tried in order, so a row's lower M bound is where the rows before it stop matching.
A condition speaks only of dimensions: bounds on M, N (output columns), K and the weight's
N x K elements, N == K, and tile counts on the GPU's SMs (:class:`Tiles`). Which model shapes
a row catches is said in its comment; why it wins is in docs/kernels.md.
"""

from __future__ import annotations

import dataclasses

from quarl.quant.kernels import splitk
from quarl.quant.kernels.config import FragConfig, TileConfig, TileKConfig, WgConfig
from quarl.quant.kernels.plan import Plan

HOPPER_SMS = 132  # an H100 / H200 SXM: the tile counts of the sm90 rows assume it
W25, W26, W27 = 1 << 25, 1 << 26, 1 << 27  # weight sizes (elements) the rows compare against
ANY = "any"  # row-set key of a family whose rows are the same on every GPU


def _within(v: int, lo: int | None, hi: int | None) -> bool:
    return (lo is None or v >= lo) and (hi is None or v <= hi)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """``per x ceil(N / cols) x ceil(M / rows)`` (``rows`` 0: no M factor) within ``[lo, hi]``."""

    cols: int
    rows: int = 0
    per: int = 1
    lo: int | None = None
    hi: int | None = None

    def holds(self, m: int, n: int) -> bool:
        count = self.per * splitk.cdiv(n, self.cols) * (splitk.cdiv(m, self.rows) if self.rows else 1)
        return _within(count, self.lo, self.hi)


def clusters_fit(n: int, k: int, max_blocks: int) -> bool:
    """The 256-row tile's K split in clusters fills one wave: the launcher's plan
    (:func:`~.splitk.tail` then :func:`~.splitk.clustered` over column blocks of 128 and K
    groups of 128 on :data:`HOPPER_SMS` SMs) puts every block in a cluster and at most
    ``max_blocks`` blocks in all."""
    cols, groups = splitk.cdiv(n, 128), splitk.cdiv(k, 128)
    plan = splitk.clustered(splitk.tail(cols, groups, HOPPER_SMS), cols, groups)
    return plan.cluster > 1 and cols * plan.split <= max_blocks


@dataclasses.dataclass(frozen=True)
class When:
    """Every given bound holds (all inclusive): M, N, K, the weight's N x K elements; N == K
    where ``square``; each of ``tiles``; :func:`clusters_fit` within ``cluster_blocks`` where set."""

    m_min: int | None = None
    m_max: int | None = None
    n_min: int | None = None
    n_max: int | None = None
    k_min: int | None = None
    k_max: int | None = None
    weight_min: int | None = None
    weight_max: int | None = None
    square: bool = False
    tiles: tuple[Tiles, ...] = ()
    cluster_blocks: int = 0

    def holds(self, m: int, n: int, k: int) -> bool:
        return (_within(m, self.m_min, self.m_max) and _within(n, self.n_min, self.n_max)
                and _within(k, self.k_min, self.k_max) and _within(n * k, self.weight_min, self.weight_max)
                and (not self.square or n == k) and all(t.holds(m, n) for t in self.tiles)
                and (not self.cluster_blocks or clusters_fit(n, k, self.cluster_blocks)))


@dataclasses.dataclass(frozen=True)
class Row:
    plan: Plan | None
    m_max: int | None = None  # inclusive; None: any M
    when: tuple[When, ...] = ()  # any of them; empty: always

    def matches(self, m: int, n: int, k: int) -> bool:
        return (self.m_max is None or m <= self.m_max) and (not self.when or any(w.holds(m, n, k) for w in self.when))


def first_match(rows: tuple[Row, ...], m: int, n: int, k: int) -> Row | None:
    """The matcher: the first row of ``rows`` that matches (m, n, k), or None."""
    return next((row for row in rows if row.matches(m, n, k)), None)


def _when(*alternatives: When | dict) -> tuple[When, ...]:
    return tuple(a if isinstance(a, When) else When(**a) for a in alternatives)


LONG_K = _when(dict(k_min=8193))
SHORT_K = _when(dict(k_max=8192))
SHORT_HIDDEN = _when(dict(k_max=2048))
WIDE_OUTPUT = _when(dict(n_min=16384))
BIG_WEIGHT = _when(dict(weight_min=W25))
SMALL_SQUARE = _when(dict(n_max=2048, k_max=2048))
HIDDEN_5120 = dict(n_min=5120, k_min=5120)

DEQUANT = Plan("dequant")
# the TMA loop, one warpgroup, two blocks per SM, K split in clusters
_TMA_ONE_WG = Plan("wgmma", WgConfig(1, 4, 2.0, single=True, minb=2, tail=True, cluster=True, mbar=True, tma=True))
_SINGLE_TMA = WgConfig(1, 4, 1.0, single=True, tail=True, cluster=True, mbar=True, tma=True)
# the pre-scaled loop fed by TMA copies: three warpgroups, two (each with a producer warpgroup
# issuing the copies), three with K split in clusters, four without a producer
_PRESCALED_TMA = Plan("wgmma", WgConfig(3, 4, 1.0, tail=True, prescale=True, tma=True, producer=True))
_PRESCALED_TMA_2WG = Plan("wgmma", WgConfig(2, 4, 1.0, tail=True, prescale=True, tma=True, producer=True))
_PRESCALED_TMA_CLUSTER = Plan("wgmma", WgConfig(3, 4, 1.0, tail=True, cluster=True, prescale=True, tma=True))
_PRESCALED_TMA_4WG = Plan("wgmma", WgConfig(4, 4, 1.0, tail=True, prescale=True, tma=True))
# ... in 256-row tiles, two warpgroups and a producer, or with K split in clusters
_PRESCALED_TMA_256 = Plan("wgmma", WgConfig(2, 3, 1.0, tail=True, prescale=True, tile=256, tma=True, producer=True))
_PRESCALED_TMA_256_CLUSTER = Plan("wgmma",
                                  WgConfig(2, 3, 1.0, tail=True, cluster=True, prescale=True, tile=256, tma=True))
# ... in 192-row tiles with a producer
_PRESCALED_TMA_192 = Plan("wgmma", WgConfig(2, 4, 1.0, tail=True, prescale=True, tile=192, tma=True, producer=True))

# 257-512 rows on fewer than 16384 output columns and K <= 4096 (7B q/k/v and o)
_NARROW_257 = dict(m_min=257, n_max=16383, k_max=4096)

# int4, group 128, weight-only (w4a16, w4a16-asym), Hopper: the wgmma kernel to 128 rows
W4A16_HOPPER: tuple[Row, ...] = (
    # 33-64 rows, hidden >= 5120 (14B, 32B): q/k/v and o, and down on weights of 2^27+ elements
    Row(Plan("wgmma", WgConfig(3, 4, 1.0, single=True, minb=1, tail=True, cluster=True)), 64,
        _when(dict(m_min=33, n_max=16383, k_min=5120, k_max=8192), dict(m_min=33, k_min=8193, weight_min=W27))),
    Row(_TMA_ONE_WG, 64, _when(dict(m_min=33, k_min=8193))),  # down projections
    Row(Plan("wgmma", WgConfig(2, 3, 2.0, single=True, minb=2, tail=True, cluster=True)), 64, LONG_K),
    Row(Plan("wgmma", WgConfig(1, 4, 2.0, tail=True, cluster=True)), 16, _when(dict(n_max=32767))),
    Row(Plan("wgmma", _SINGLE_TMA), 64, _when(dict(m_min=33, n_max=2048, k_max=2048))),  # 1.5B q/k/v, o
    Row(_TMA_ONE_WG, 64, _when(dict(m_min=33, n_max=16383))),  # 7B q/k/v and o
    Row(Plan("wgmma", WgConfig(1, 4, 2.0, tail=True, cluster=True)), 64, _when(dict(n_max=16383))),
    Row(Plan("wgmma", WgConfig(1, 3, 4.0, single=True, minb=4, tail=True)), 32),
    Row(Plan("wgmma", WgConfig(3, 5, 1.0, single=True, minb=1, tail=True, mbar=True, tma=True)), 64),
    # wide outputs whose 256-column blocks fill one wave where 192-column blocks take two (14B gate/up)
    Row(_PRESCALED_TMA_4WG, 128,
        _when(When(n_min=16384, tiles=(Tiles(256, hi=HOPPER_SMS), Tiles(192, lo=HOPPER_SMS + 1))))),
    Row(_PRESCALED_TMA, 128, WIDE_OUTPUT),
    Row(Plan("wgmma", _SINGLE_TMA), 128, _when(dict(n_max=2047, k_max=4096))),
    Row(_PRESCALED_TMA_CLUSTER, 128, _when(HIDDEN_5120)),
    Row(Plan("wgmma", _SINGLE_TMA._replace(nwg=2)), 128),
    Row(DEQUANT, 512, SMALL_SQUARE),  # 1.5B q/k/v and o: latency-bound, cuBLAS on the dequantized weight
    Row(_PRESCALED_TMA_256_CLUSTER, 256, _when(When(cluster_blocks=112))),
    # the 7B's q/k/v and o at 257-512 rows: the loop whose tiles fill one wave
    Row(_PRESCALED_TMA_CLUSTER, 512, _when(When(**_NARROW_257, tiles=(Tiles(192, 128, per=2, hi=HOPPER_SMS),)))),
    Row(_PRESCALED_TMA_2WG, 512, _when(When(**_NARROW_257, tiles=(Tiles(128, 128, hi=HOPPER_SMS),)))),
    Row(_PRESCALED_TMA_192, 512, _when(When(**_NARROW_257, tiles=(Tiles(128, 192, hi=HOPPER_SMS),)))),
    Row(DEQUANT, 512, _when(dict(m_min=256, n_max=16383, k_max=4096))),
    # 385-512 rows, hidden >= 5120, K <= 13824 (14B and 32B o, 14B down): 192-row tiles in one wave
    Row(_PRESCALED_TMA_192, 512,
        _when(When(m_min=385, n_min=5120, k_min=5120, k_max=13824, tiles=(Tiles(128, 192, hi=HOPPER_SMS),)))),
    Row(_PRESCALED_TMA_256, 512, _when(dict(m_max=256, weight_min=W25), dict(m_min=385, weight_min=W25))),
    Row(DEQUANT, 512, _when(dict(m_min=385))),
    Row(_PRESCALED_TMA_4WG, 512, _when(dict(m_min=257, m_max=384, n_min=16384),
                                       dict(m_min=257, m_max=384, weight_min=W26))),
    Row(_PRESCALED_TMA_CLUSTER, 512, _when(dict(HIDDEN_5120, m_max=256), dict(HIDDEN_5120, weight_min=W25))),
    Row(_PRESCALED_TMA, 512, WIDE_OUTPUT),
    Row(_PRESCALED_TMA_2WG, 512),
    Row(_PRESCALED_TMA_256_CLUSTER, 768, _when(dict(HIDDEN_5120, m_min=513, weight_max=W25 - 1))),  # 14B, 32B o
    Row(_PRESCALED_TMA_256, 1024, _when(dict(m_min=769, square=True, n_min=2049, n_max=5119))),  # 7B o
    Row(DEQUANT, 1024, _when(dict(m_min=769, n_min=5120, k_min=8193))),  # 14B and 32B down
    Row(_PRESCALED_TMA_256, 1024, BIG_WEIGHT),
    Row(DEQUANT),
)

# the swap kernel (Triton) to 64 rows on every GPU without wgmma, then cuBLAS on the dequantized weight
_SWAP: tuple[Row, ...] = (
    Row(Plan("swap", TileConfig(16, 64, waves=8)), 16, _when(When(tiles=(Tiles(64, lo=256),)), dict(k_min=8192))),
    Row(Plan("swap", TileConfig(16, 64, waves=4)), 16),
    Row(Plan("swap", TileConfig(32, 64, waves=4)), 32),
    Row(Plan("swap", TileConfig(64, 64, waves=4)), 64),
    Row(DEQUANT),
)
# mma.sync GPUs without wgmma (sm80, sm89): the fragment and block-tiled CUDA kernels at few rows
W4A16_MMA: tuple[Row, ...] = (
    Row(Plan("frag", FragConfig(nw=2, blocks_per_sm=8, stages=8)), 4, _when(dict(weight_min=W25, k_min=8192))),
    Row(Plan("frag", FragConfig(nw=2, blocks_per_sm=4, stages=8)), 4, BIG_WEIGHT),
    Row(Plan("frag", FragConfig(nw=4, blocks_per_sm=8, stages=8)), 4),
    Row(Plan("tile", TileKConfig(sw=4, nt=4, mt=1, wm=1, stages=4, blocks_per_sm=2.0)), 8, BIG_WEIGHT),
) + _SWAP

# every other weight-only format (int4 of other groups, int2, nvfp4, mxfp4)
WEIGHT_ONLY: tuple[Row, ...] = (
    Row(Plan("tiled", TileConfig(16, 32, num_stages=4, post_scale=False)), 16),
    Row(Plan("tiled", TileConfig(32, 64)), 32),
    Row(Plan("tiled", TileConfig(64, 64)), 64),
    Row(Plan("tiled", TileConfig(64, 128)), 127),
    Row(DEQUANT),
)

_TMA_64 = Plan("tma", TileConfig(64, 64, 128, num_stages=5, waves=3))
_TMA_SPLIT = Plan("tma", TileConfig(64, 128, 128, split_k=2, num_stages=4, waves=2))
_FEW_64_TILES = Tiles(64, 64, hi=2 * HOPPER_SMS)  # 64 x 64 tiles while ~2 fit per SM
_NARROW_LONG_K = _when(dict(n_max=2048, k_min=8193))  # 1.5B down: few tiles, so K is split
_W8A8_SMALL_M: tuple[Row, ...] = (
    Row(Plan("pointer", TileConfig(16, 64, 256)), 16),
    Row(_TMA_64, 64, SHORT_K),
    Row(Plan("pointer", TileConfig(64, 64, 128, num_stages=4)), 64),
    Row(_TMA_SPLIT, 256, LONG_K),
)
FP8: tuple[Row, ...] = _W8A8_SMALL_M[:1] + (
    Row(Plan("tma", TileConfig(64, 32, 256, split_k=4, num_stages=4, waves=2)), 64, _NARROW_LONG_K),
    Row(Plan("tma", TileConfig(64, 64, 256, split_k=2, num_stages=5, waves=2)), 128, _NARROW_LONG_K),
    Row(Plan("pointer", TileConfig(64, 32, 256, split_k=1, num_stages=4)), 128, SMALL_SQUARE),
) + _W8A8_SMALL_M[1:] + (
    Row(_TMA_64, 256, _when(When(tiles=(_FEW_64_TILES,)))),
    Row(Plan("cublas")),
)
INT8: tuple[Row, ...] = _W8A8_SMALL_M + (
    Row(_TMA_64, 512, _when(When(tiles=(_FEW_64_TILES,)))),
    Row(Plan("tma", TileConfig(64, 128, 128, num_stages=4, waves=2)), 512),
    Row(Plan("tma", TileConfig(128, 256, 128, split_k=-1, num_warps=8, num_stages=3, waves=1)), None,
        _when(dict(m_min=2048, k_min=8193))),
    Row(Plan("tma", TileConfig(256, 128, 128, num_warps=8, num_stages=3, waves=1)), None,
        _when(dict(m_min=2048, n_min=16384))),
    Row(Plan("pointer", TileConfig(128, 128, 128, split_k=1, num_warps=8))),
)
W4A8: tuple[Row, ...] = (
    Row(Plan("w4a8", TileConfig(16, 128)), 16),
    Row(Plan("w4a8", TileConfig(64, 64)), 64),
    Row(Plan("w4a8", TileConfig(128, 128, split_k=1, num_warps=8))),
)
# The gated [gate; up] GEMM (SiLU-and-mul in its epilogue, N = 2 I rows); None: the engine
# runs the plain GEMM and a separate SiLU-and-mul (at M <= 16 the plain GEMM splits K,
# which a non-linear epilogue cannot).
_GATED_64 = Plan("gated", TileConfig(64, 64, 128, num_stages=3, waves=3))
GATED_FP8: tuple[Row, ...] = (
    Row(None, 16),
    Row(None, None, LONG_K),
    Row(Plan("gated", TileConfig(64, 32, 128, num_stages=4, waves=3)), 64, SHORT_HIDDEN),
    Row(_GATED_64, 64),
    Row(_GATED_64, 128, SHORT_HIDDEN),
    Row(None),
)
GATED_INT8: tuple[Row, ...] = (
    Row(None, 16),
    Row(None, None, LONG_K),
    Row(Plan("gated", TileConfig(64, 32, 128, num_stages=4, waves=3)), 128),
    Row(None),
)

# Tried first where the engine keeps a dense copy of each weight (``rollout.dense_weights``,
# ``RepackCache.dense``): the ``dequant`` plan then is a plain GEMM on that copy, which beats
# the w4 kernel on Hopper on weights of at most 2^25 elements at 65-128 rows, and is bf16's own
# GEMM above 128 rows, where the GEMM is compute-bound.
_DENSE_ABOVE_128 = Row(DEQUANT, None, _when(dict(m_min=129)))
W4A16_DENSE_HOPPER: tuple[Row, ...] = (Row(DEQUANT, 128, _when(dict(m_min=65, weight_max=W25))), _DENSE_ABOVE_128)

# The w4a16 [gate; up] GEMM with the SiLU-and-mul in its epilogue: where a row gives a plan,
# the wgmma kernel of the plain GEMM's own plan runs gated (same config; the same sums except
# under a tail plan, whose split blocks then hold other rows); None: the plain GEMM and a
# separate SiLU-and-mul.
_GATED_W4 = (Row(Plan("wgmma")),)
_NO_GATED = (Row(None),)

# family -> GPU row set (device.GENS, or ANY) -> rows
TABLES: dict[str, dict[str, tuple[Row, ...]]] = {
    "w4a16": {"sm90": W4A16_HOPPER, "sm89": W4A16_MMA, "sm80": W4A16_MMA, "none": _SWAP},
    "weight_only": {ANY: WEIGHT_ONLY},
    "fp8": {ANY: FP8},
    "int8": {ANY: INT8},
    "w4a8": {ANY: W4A8},
    "gated_fp8": {ANY: GATED_FP8},
    "gated_int8": {ANY: GATED_INT8},
    "gated_w4a16": {"sm90": _GATED_W4, ANY: _NO_GATED},
}
# rows tried before the family's own where the weight's owner keeps a dense copy of it
DENSE_FIRST: dict[str, dict[str, tuple[Row, ...]]] = {
    "w4a16": {"sm90": W4A16_DENSE_HOPPER, ANY: (_DENSE_ABOVE_128,)},
}


def rows_for(tables: dict[str, dict[str, tuple[Row, ...]]], fam: str, gen: str) -> tuple[Row, ...]:
    """The rows of ``fam`` for GPU row set ``gen`` (its own, else the family's ANY rows, else none)."""
    by_gen = tables.get(fam, {})
    return by_gen.get(gen, by_gen.get(ANY, ()))
