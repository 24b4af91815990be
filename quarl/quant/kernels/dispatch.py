"""Which kernel and config a quantized GEMM runs: one table per format family, decided once.

``plan = pick(qw, m, device, dtype)`` returns a typed :class:`Plan` (kernel name + config);
``plan.run(...)`` launches it. Each table is a tuple of :class:`Row`: the first row whose GPU
generation (:data:`.device.GENS`), M range and shape predicate match gives the plan. The
measurements behind the rows are in bench/NOTES.md ("dispatch decisions and their
measurements") and bench/results/; the tables say what runs, the notes say why.

Sweeps replace a family's choice inside ``with overrides(family=plan_or_fn): ...``; nothing
here reads the environment.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, Iterator, NamedTuple, Union

import torch

from quarl.quant.kernels import cuda_w4, splitk, w8a8, weight_only
from quarl.quant.kernels.act_quant import act_quant_config
from quarl.quant.kernels.config import FragConfig, TileConfig, TileKConfig, WgConfig
from quarl.quant.kernels.device import GENS, gpu_gen
from quarl.quant.qweight import QuantizedWeight
from quarl.quant.scheme import QuantScheme

Config = Union[TileConfig, FragConfig, TileKConfig, WgConfig, None]

# weight-only kernels: (x, qw, bias, cfg, repacked) -> y
_WEIGHT_ONLY = {
    "frag": cuda_w4.frag_gemm,
    "tile": cuda_w4.tile_gemm,
    "wgmma": cuda_w4.wgmma_gemm,
    "swap": lambda x, qw, bias, cfg, repacked=None: weight_only.swap_gemm(x, qw, bias, cfg),
    "tiled": lambda x, qw, bias, cfg, repacked=None: weight_only.tiled_gemm(x, qw, bias, cfg),
    "dequant": lambda x, qw, bias, cfg, repacked=None: weight_only.dequant_gemm(x, qw, bias, repacked=repacked),
}
# kernels on quantized activations: (xq, sx, qw, bias, out_dtype, cfg) -> y
_QUANTIZED_INPUT = {
    "pointer": w8a8.pointer_gemm,
    "tma": w8a8.tma_gemm,
    "cublas": w8a8.cublas_gemm,
    "w4a8": w8a8.w4a8_gemm,
}


class Plan(NamedTuple):
    """A kernel (a key of the runner maps above, or ``"gated"``) and its config."""

    kernel: str
    config: Config = None

    def run(self, *args, repacked=None):
        """Weight-only: ``run(x, qw, bias, repacked=cache)``. Quantized input: ``run(xq, sx,
        qw, bias, out_dtype)``. Gated: ``run(xq, sx, qw, out_dtype)`` -> ``(y, amax)`` or None."""
        if self.kernel in _WEIGHT_ONLY:
            return _WEIGHT_ONLY[self.kernel](*args, self.config, repacked=repacked)
        if self.kernel == "gated":
            return w8a8.gated_gemm(*args, self.config)
        return _QUANTIZED_INPUT[self.kernel](*args, self.config)


Predicate = Callable[[int, int, int], bool]


class Row(NamedTuple):
    plan: Plan | None  # None: no kernel of this family (gated: run the plain GEMM)
    m_max: int | None = None  # inclusive; rows are tried in order, so the lower bound is the row before's
    when: Predicate | None = None  # on (m, n, k)
    gens: tuple[str, ...] = GENS


def short_hidden(m: int, n: int, k: int) -> bool:
    """A hidden size of at most 2048 (1.5B: K = 1536)."""
    return k <= 2048


def long_k(m: int, n: int, k: int) -> bool:
    return k > 8192


def long_k_m33(m: int, n: int, k: int) -> bool:
    """33-64 tokens and K > 8192 (down projections)."""
    return m > 32 and k > 8192


def short_k(m: int, n: int, k: int) -> bool:
    return k <= 8192


def big_weight(m: int, n: int, k: int) -> bool:
    return n * k >= 1 << 25


def big_weight_k8192(m: int, n: int, k: int) -> bool:
    return n * k >= 1 << 25 and k >= 8192


def n_below_32768(m: int, n: int, k: int) -> bool:
    return n < 32768


def small_weight(m: int, n: int, k: int) -> bool:
    return n < 2048 and k <= 4096


def small_square_m33(m: int, n: int, k: int) -> bool:
    """33-64 tokens on a weight of at most 2048 x 2048 (1.5B o, q/k/v): fewer K splits."""
    return m > 32 and n <= 2048 and k <= 2048


def n_below_16384(m: int, n: int, k: int) -> bool:
    return n < 16384


def n_below_16384_m33(m: int, n: int, k: int) -> bool:
    """33-64 tokens, fewer than 16384 output columns (7B q/k/v and o)."""
    return m > 32 and n < 16384


def wide_output(m: int, n: int, k: int) -> bool:
    """16384 output columns or more (gate/up of 1.5B and larger)."""
    return n >= 16384


def wide_hidden_m64(m: int, n: int, k: int) -> bool:
    """33-64 tokens, a hidden size of 5120 or more (14B, 32B) and no wide output: q/k/v and o
    (K = hidden), and down when its weight is as large as the 32B's (K = 27648)."""
    return m > 32 and ((k >= 5120 and n < 16384 and k <= 8192) or (k > 8192 and n * k >= 1 << 27))


def swap_deep_split(m: int, n: int, k: int) -> bool:
    """Enough work per column that the swap kernel's K splits go to ~8 waves."""
    return splitk.cdiv(n, 64) >= 256 or k >= 8192


HOPPER_SMS = 132  # an H100 / H200 SXM: the rows that depend on the grid assume it


def few_64_tiles(m: int, n: int, k: int) -> bool:
    """64 x 64 tiles while ~2 fit per SM on :data:`HOPPER_SMS` SMs."""
    return splitk.cdiv(m, 64) * splitk.cdiv(n, 64) <= 2 * HOPPER_SMS


def narrow_long_k(m: int, n: int, k: int) -> bool:
    """K > 8192 over at most 2048 output columns (1.5B down): few tiles, so K is split."""
    return k > 8192 and n <= 2048


def small_square(m: int, n: int, k: int) -> bool:
    """Both sides at most 2048 (1.5B q/k/v and o): latency-bound at decode sizes, so narrow
    tiles put more SMs on the weight."""
    return n <= 2048 and k <= 2048


def narrow_short_k_m256(m: int, n: int, k: int) -> bool:
    """256 rows or more on a weight of fewer than 16384 output columns and K <= 4096 (7B q/k/v
    and o): the dequantized weight is small next to the GEMM, so cuBLAS on it wins."""
    return m >= 256 and n < 16384 and k <= 4096


def above_384(m: int, n: int, k: int) -> bool:
    return m > 384


def hidden_5120(m: int, n: int, k: int) -> bool:
    """Both sides 5120 or more: a hidden size of 5120 or more (14B, 32B q/k/v, o and down)."""
    return n >= 5120 and k >= 5120


def big_weight_256_tiles(m: int, n: int, k: int) -> bool:
    """A weight of 2^25 elements or more (7B gate/up and down; 14B and 32B but o) at 129-256
    or 385-512 rows: whole 256-row tiles."""
    return big_weight(m, n, k) and not 256 < m <= 384


def m257_wide_or_big(m: int, n: int, k: int) -> bool:
    """257-384 rows on 16384 output columns or more or on a weight of 2^26 elements or more
    (7B and 14B gate/up and down)."""
    return 256 < m <= 384 and (n >= 16384 or n * k >= 1 << 26)


def hidden_5120_tiles(m: int, n: int, k: int) -> bool:
    """Both sides 5120 or more at 129-256 rows, or on a weight of 2^25 elements or more (14B
    and 32B o at 129-256 rows, q/k/v at 257-384)."""
    return hidden_5120(m, n, k) and (m <= 256 or big_weight(m, n, k))


def _narrow_257(m: int, n: int, k: int) -> bool:
    """257-512 rows on a weight of fewer than 16384 output columns and K <= 4096 (7B q/k/v and o)."""
    return 256 < m <= 512 and n < 16384 and k <= 4096


def narrow_3wg_split(m: int, n: int, k: int) -> bool:
    """:func:`_narrow_257` where three warpgroups' tiles (192 columns x 128 rows) split K two
    ways or more within one wave on :data:`HOPPER_SMS` SMs (7B o at 257-384 rows: 23.2 us
    against 26.0 for two warpgroups and 26.4-29.7 for cuBLAS on the dequantized weight; NOTES
    session 48)."""
    return _narrow_257(m, n, k) and 2 * splitk.cdiv(n, 192) * splitk.cdiv(m, 128) <= HOPPER_SMS


def narrow_2wg_wave(m: int, n: int, k: int) -> bool:
    """:func:`_narrow_257` where two warpgroups' tiles (128 columns x 128 rows) fill at most one
    wave (7B q/k/v at 257-384 rows, 26.3 us against 32.9-34.8 for cuBLAS on the dequantized
    weight; 7B o at 385-512, 26.3-26.5 against 28.8-30.2; NOTES session 48)."""
    return _narrow_257(m, n, k) and splitk.cdiv(n, 128) * splitk.cdiv(m, 128) <= HOPPER_SMS


def narrow_192_wave(m: int, n: int, k: int) -> bool:
    """:func:`_narrow_257` where two warpgroups' 192-row tiles (128 columns x 192 rows) fill at
    most one wave (7B q/k/v at 385-512 rows, 31.9-32.7 us against 35.4-36.6 for cuBLAS on the
    dequantized weight; NOTES session 48)."""
    return _narrow_257(m, n, k) and splitk.cdiv(n, 128) * splitk.cdiv(m, 192) <= HOPPER_SMS


def hidden_5120_192_wave(m: int, n: int, k: int) -> bool:
    """385-512 rows, both sides 5120 or more and K <= 13824, where two warpgroups' 192-row tiles
    fill at most one wave on :data:`HOPPER_SMS` SMs (14B and 32B o, 14B down: 14B o at 512 rows
    44.5 us against 57.6 for cuBLAS on the dequantized weight, down 109.5 against 138 for the
    256-row tile; NOTES session 49; the 32B's down, K = 27648, was not swept)."""
    return (384 < m <= 512 and hidden_5120(m, n, k) and k <= 13824
            and splitk.cdiv(n, 128) * splitk.cdiv(m, 192) <= HOPPER_SMS)


def square_5120_m513(m: int, n: int, k: int) -> bool:
    """513-768 rows, both sides 5120 or more on a weight under 2^25 elements (14B and 32B o): the
    256-row tile with K split in clusters (58.9 us at 768 rows against 73.3 for cuBLAS on the
    dequantized weight; NOTES session 49)."""
    return 512 < m <= 768 and hidden_5120(m, n, k) and n * k < 1 << 25


def wide_256_wave(m: int, n: int, k: int) -> bool:
    """A wide output (16384 columns or more) whose 256-column blocks (four warpgroups) fill one
    wave on :data:`HOPPER_SMS` SMs where three warpgroups' 192-column blocks take two (14B
    gate/up at 65-128 rows: 64.8 us against 73.5 for three; on the 7B's gate/up, 148 blocks, four
    lost; NOTES sessions 47 and 48)."""
    return n >= 16384 and splitk.cdiv(n, 256) <= HOPPER_SMS < splitk.cdiv(n, 192)


def clusters_fit(m: int, n: int, k: int) -> bool:
    """The 256-row tile's K split in clusters fills one wave: the launcher's plan
    (:func:`~.splitk.tail` then :func:`~.splitk.clustered`, as ``cuda_w4`` makes it for two
    warpgroups' column blocks of 128 on :data:`HOPPER_SMS` SMs) puts every block in a cluster
    and at most 112 blocks in all (7B q/k/v, o and down, 14B q/k/v, the 1.5B's down; not the
    14B's o and down, 40 column blocks split 3 ways, which ran two waves: NOTES session 47)."""
    cols, groups = splitk.cdiv(n, 128), splitk.cdiv(k, 128)
    plan = splitk.clustered(splitk.tail(cols, groups, HOPPER_SMS), cols, groups)
    return plan.cluster > 1 and cols * plan.split <= 112


def square_3584_m769(m: int, n: int, k: int) -> bool:
    """769-1024 rows on a square weight of 2049-5119 a side (the 7B's o): the 256-row tile with a
    producer (28 x 4 tiles, one wave) beats cuBLAS on the dequantized weight, 40.4 against 45.3 us
    at 1024 rows, timed in the burst power state (NOTES session 50)."""
    return m > 768 and n == k and 2048 < n < 5120


def long_k_m769(m: int, n: int, k: int) -> bool:
    """769 rows or more, K > 8192 and 5120 output columns or more (14B and 32B down): cuBLAS on
    the dequantized weight beats the 256-row tiles (NOTES sessions 46 and 47)."""
    return m > 768 and k > 8192 and n >= 5120


def m2048_long_k(m: int, n: int, k: int) -> bool:
    return m >= 2048 and k > 8192


def m2048_wide(m: int, n: int, k: int) -> bool:
    return m >= 2048 and n >= 16384


SM90 = ("sm90",)
MMA = ("sm80", "sm89")  # mma.sync GPUs without wgmma
DEQUANT = Plan("dequant")
# the TMA loop, one warpgroup, two blocks per SM, K split in clusters (33-64 rows: down; 7B q/k/v and o)
_TMA_ONE_WG = Plan("wgmma", WgConfig(1, 4, 2.0, single=True, minb=2, tail=True, cluster=True, mbar=True, tma=True))
# the pre-scaled loop fed by TMA copies: three warpgroups, two (each with a producer warpgroup
# issuing the copies, NOTES session 46), and three with K split in clusters (65-512 rows)
_PRESCALED_TMA = Plan("wgmma", WgConfig(3, 4, 1.0, tail=True, prescale=True, tma=True, producer=True))
_PRESCALED_TMA_2WG = Plan("wgmma", WgConfig(2, 4, 1.0, tail=True, prescale=True, tma=True, producer=True))
_PRESCALED_TMA_CLUSTER = Plan("wgmma", WgConfig(3, 4, 1.0, tail=True, cluster=True, prescale=True, tma=True))
# four warpgroups, no producer (65-128 rows on wide outputs whose 256-column blocks fill one wave)
_PRESCALED_TMA_4WG = Plan("wgmma", WgConfig(4, 4, 1.0, tail=True, prescale=True, tma=True))
# ... in 256-row tiles, two warpgroups and a producer (129-256 and 385-1024 rows on large weights),
# or with K split in clusters (129-256 rows on narrow weights, NOTES session 47)
_PRESCALED_TMA_256 = Plan("wgmma", WgConfig(2, 3, 1.0, tail=True, prescale=True, tile=256, tma=True, producer=True))
_PRESCALED_TMA_256_CLUSTER = Plan("wgmma", WgConfig(2, 3, 1.0, tail=True, cluster=True, prescale=True, tile=256, tma=True))
# ... in 192-row tiles with a producer (385-512 rows on the 7B's q/k/v, NOTES session 48; the 14B's o and down, s49)
_PRESCALED_TMA_192 = Plan("wgmma", WgConfig(2, 4, 1.0, tail=True, prescale=True, tile=192, tma=True, producer=True))

# int4, group 128, weight-only (w4a16, w4a16-asym)
W4A16: tuple[Row, ...] = (
    Row(Plan("wgmma", WgConfig(3, 4, 1.0, single=True, minb=1, tail=True, cluster=True)), 64, wide_hidden_m64, SM90),
    Row(_TMA_ONE_WG, 64, long_k_m33, SM90),
    Row(Plan("wgmma", WgConfig(2, 3, 2.0, single=True, minb=2, tail=True, cluster=True)), 64, long_k, SM90),
    Row(Plan("wgmma", WgConfig(1, 4, 2.0, tail=True, cluster=True)), 16, n_below_32768, SM90),
    Row(Plan("wgmma", WgConfig(1, 4, 1.0, single=True, tail=True, cluster=True, mbar=True, tma=True)), 64,
        small_square_m33, SM90),
    Row(_TMA_ONE_WG, 64, n_below_16384_m33, SM90),
    Row(Plan("wgmma", WgConfig(1, 4, 2.0, tail=True, cluster=True)), 64, n_below_16384, SM90),
    Row(Plan("wgmma", WgConfig(1, 3, 4.0, single=True, minb=4, tail=True)), 32, None, SM90),
    Row(Plan("wgmma", WgConfig(3, 5, 1.0, single=True, minb=1, tail=True, mbar=True, tma=True)), 64, None, SM90),
    Row(_PRESCALED_TMA_4WG, 128, wide_256_wave, SM90),
    Row(_PRESCALED_TMA, 128, wide_output, SM90),
    Row(Plan("wgmma", WgConfig(1, 4, 1.0, single=True, tail=True, cluster=True, mbar=True, tma=True)), 128,
        small_weight, SM90),
    Row(_PRESCALED_TMA_CLUSTER, 128, hidden_5120, SM90),
    Row(Plan("wgmma", WgConfig(2, 4, 1.0, single=True, tail=True, cluster=True, mbar=True, tma=True)), 128, None, SM90),
    Row(Plan("frag", FragConfig(nw=2, blocks_per_sm=8, stages=8)), 4, big_weight_k8192, MMA),
    Row(Plan("frag", FragConfig(nw=2, blocks_per_sm=4, stages=8)), 4, big_weight, MMA),
    Row(Plan("frag", FragConfig(nw=4, blocks_per_sm=8, stages=8)), 4, None, MMA),
    Row(Plan("tile", TileKConfig(sw=4, nt=4, mt=1, wm=1, stages=4, blocks_per_sm=2.0)), 8, big_weight, MMA),
    Row(Plan("swap", TileConfig(16, 64, waves=8)), 16, swap_deep_split),
    Row(Plan("swap", TileConfig(16, 64, waves=4)), 16),
    Row(Plan("swap", TileConfig(32, 64, waves=4)), 32),
    Row(Plan("swap", TileConfig(64, 64, waves=4)), 64),
    Row(DEQUANT, 512, small_square, SM90),
    Row(_PRESCALED_TMA_256_CLUSTER, 256, clusters_fit, SM90),
    Row(_PRESCALED_TMA_CLUSTER, 512, narrow_3wg_split, SM90),
    Row(_PRESCALED_TMA_2WG, 512, narrow_2wg_wave, SM90),
    Row(_PRESCALED_TMA_192, 512, narrow_192_wave, SM90),
    Row(DEQUANT, 512, narrow_short_k_m256, SM90),
    Row(_PRESCALED_TMA_192, 512, hidden_5120_192_wave, SM90),
    Row(_PRESCALED_TMA_256, 512, big_weight_256_tiles, SM90),
    Row(DEQUANT, 512, above_384, SM90),
    Row(_PRESCALED_TMA_4WG, 512, m257_wide_or_big, SM90),
    Row(_PRESCALED_TMA_CLUSTER, 512, hidden_5120_tiles, SM90),
    Row(_PRESCALED_TMA, 512, wide_output, SM90),
    Row(_PRESCALED_TMA_2WG, 512, None, SM90),
    Row(_PRESCALED_TMA_256_CLUSTER, 768, square_5120_m513, SM90),
    Row(_PRESCALED_TMA_256, 1024, square_3584_m769, SM90),
    Row(DEQUANT, 1024, long_k_m769, SM90),
    Row(_PRESCALED_TMA_256, 1024, big_weight, SM90),  # 513-1024 rows: the largest weights (NOTES sessions 44, 47)
    Row(DEQUANT),
)

# every other weight-only format (int4 of other groups, int2, nvfp4, mxfp4)
WEIGHT_ONLY: tuple[Row, ...] = (
    Row(Plan("tiled", TileConfig(16, 32, num_stages=4, post_scale=False)), 16),
    Row(Plan("tiled", TileConfig(32, 64)), 32),
    Row(Plan("tiled", TileConfig(64, 64)), 64),
    Row(Plan("tiled", TileConfig(64, 128)), 127),
    Row(DEQUANT),
)

_TMA_64 = Plan("tma", TileConfig(64, 64, 128, num_stages=5, waves=3))
_TMA_64x128 = Plan("tma", TileConfig(64, 128, 128, num_stages=4, waves=2))
_TMA_SPLIT = Plan("tma", TileConfig(64, 128, 128, split_k=2, num_stages=4, waves=2))
_W8A8_SMALL_M: tuple[Row, ...] = (
    Row(Plan("pointer", TileConfig(16, 64, 256)), 16),
    Row(_TMA_64, 64, short_k),
    Row(Plan("pointer", TileConfig(64, 64, 128, num_stages=4)), 64),
    Row(_TMA_SPLIT, 256, long_k),
)
FP8: tuple[Row, ...] = _W8A8_SMALL_M[:1] + (
    Row(Plan("tma", TileConfig(64, 32, 256, split_k=4, num_stages=4, waves=2)), 64, narrow_long_k),
    Row(Plan("tma", TileConfig(64, 64, 256, split_k=2, num_stages=5, waves=2)), 128, narrow_long_k),
    Row(Plan("pointer", TileConfig(64, 32, 256, split_k=1, num_stages=4)), 128, small_square),
) + _W8A8_SMALL_M[1:] + (
    Row(_TMA_64, 256, few_64_tiles),
    Row(Plan("cublas")),
)
INT8: tuple[Row, ...] = _W8A8_SMALL_M + (
    Row(_TMA_64, 512, few_64_tiles),
    Row(_TMA_64x128, 512),
    Row(Plan("tma", TileConfig(128, 256, 128, split_k=-1, num_warps=8, num_stages=3, waves=1)), None, m2048_long_k),
    Row(Plan("tma", TileConfig(256, 128, 128, num_warps=8, num_stages=3, waves=1)), None, m2048_wide),
    Row(Plan("pointer", TileConfig(128, 128, 128, split_k=1, num_warps=8))),
)
W4A8: tuple[Row, ...] = (
    Row(Plan("w4a8", TileConfig(16, 128)), 16),
    Row(Plan("w4a8", TileConfig(64, 64)), 64),
    Row(Plan("w4a8", TileConfig(128, 128, split_k=1, num_warps=8))),
)
# The gated [gate; up] GEMM (SiLU-and-mul in its epilogue, n = 2 I rows); None: the engine
# runs the plain GEMM and a separate SiLU-and-mul (at M <= 16 the plain GEMM splits K,
# which a non-linear epilogue cannot).
_GATED_64 = Plan("gated", TileConfig(64, 64, 128, num_stages=3, waves=3))
GATED_FP8: tuple[Row, ...] = (
    Row(None, 16),
    Row(None, None, long_k),
    Row(Plan("gated", TileConfig(64, 32, 128, num_stages=4, waves=3)), 64, short_hidden),
    Row(_GATED_64, 64),
    Row(_GATED_64, 128, short_hidden),
    Row(None),
)
GATED_INT8: tuple[Row, ...] = (
    Row(None, 16),
    Row(None, None, long_k),
    Row(Plan("gated", TileConfig(64, 32, 128, num_stages=4, waves=3)), 128),
    Row(None),
)


def above_128(m: int, n: int, k: int) -> bool:
    return m > 128


def small_weight_m65(m: int, n: int, k: int) -> bool:
    return m > 64 and n * k <= 2**25


# Tried first where the engine keeps a dense copy of each weight (``rollout.dense_weights``,
# ``RepackCache.dense``): the ``dequant`` plan then is a plain GEMM on that copy, which beats
# the w4 kernel on small weights at 65 <= M <= 128 (bench/NOTES.md, "dense weights"), and is
# bf16's own GEMM above 128 rows, where the GEMM is compute-bound.
W4A16_DENSE: tuple[Row, ...] = (
    Row(DEQUANT, 128, small_weight_m65, SM90),
    Row(DEQUANT, None, above_128),
)

# The w4a16 [gate; up] GEMM with the SiLU-and-mul in its epilogue: where a row gives a plan,
# the wgmma kernel of the plain GEMM's own plan runs gated (same config; the same sums except
# under a tail plan, whose split blocks then hold other rows); None: the plain GEMM and a
# separate SiLU-and-mul.
GATED_W4A16: tuple[Row, ...] = (
    Row(Plan("wgmma"), None, None, SM90),
    Row(None),
)

TABLES: dict[str, tuple[Row, ...]] = {
    "w4a16": W4A16, "weight_only": WEIGHT_ONLY, "fp8": FP8, "int8": INT8, "w4a8": W4A8,
    "gated_fp8": GATED_FP8, "gated_int8": GATED_INT8, "gated_w4a16": GATED_W4A16,
}

_OVERRIDES: contextvars.ContextVar[dict] = contextvars.ContextVar("quarl_kernel_overrides", default={})


@contextlib.contextmanager
def overrides(**by_family) -> Iterator[None]:
    """Inside the block, :func:`pick` gives these instead of the tables' rows (sweeps, A/B
    runs): ``family=Plan`` (None for a gated family: no gated GEMM), or ``family=fn`` with
    ``fn(m, n, k) -> Plan | None``. ``act_quant=(block, warps)`` or ``fn(m, k)``."""
    unknown = set(by_family) - set(TABLES) - {"act_quant"}
    if unknown:
        raise ValueError(f"unknown kernel families {sorted(unknown)}; valid: {sorted(TABLES)} and act_quant")
    token = _OVERRIDES.set({**_OVERRIDES.get(), **by_family})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def family(scheme: QuantScheme) -> str:
    """The table a scheme's GEMM is picked from."""
    if scheme.act_format == "fp8":
        return "fp8"
    if scheme.act_format == "int8":
        return "w4a8" if scheme.packed else "int8"
    if scheme.weight_format == "int" and scheme.weight_bits == 4 and scheme.group_size == 128:
        return "w4a16"
    return "weight_only"


DENSE_FIRST: dict[str, tuple[Row, ...]] = {"w4a16": W4A16_DENSE}


@functools.lru_cache(maxsize=4096)
def lookup(fam: str, gen: str, m: int, n: int, k: int, dense: bool = False) -> Plan | None:
    """The plan of the first row of table ``fam`` that matches (``dense``: the weight has a
    dense copy, whose rows of :data:`DENSE_FIRST` come first)."""
    for row in (DENSE_FIRST.get(fam, ()) if dense else ()) + TABLES[fam]:
        if gen in row.gens and (row.m_max is None or m <= row.m_max) and (row.when is None or row.when(m, n, k)):
            return row.plan
    raise LookupError(f"no row of {fam} matches gen={gen} m={m} n={n} k={k}")  # (tables end in a catch-all)


def _choose(fam: str, gen: str, m: int, n: int, k: int, dense: bool = False) -> Plan | None:
    ov = _OVERRIDES.get().get(fam, lookup)
    if ov is lookup:
        return lookup(fam, gen, m, n, k, dense)
    return ov(m, n, k) if callable(ov) else ov


def pick(qw: QuantizedWeight, m: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
         dense: bool = False) -> Plan:
    """The GEMM plan for ``m`` rows of activations of ``dtype`` on ``device`` (for schemes that
    quantize activations: the GEMM on their codes). ``dense``: the weight's owner keeps a
    dense copy of it (the ``dequant`` plan is then a plain GEMM on that copy)."""
    n, k = qw.shape
    fam = family(qw.scheme)
    return _choose(fam, gpu_gen(device, dtype) if fam == "w4a16" else "none", m, n, k, dense)


def gated_plan(act_format: str, m: int, n: int, k: int) -> Plan | None:
    """The gated GEMM plan for a W8A8 ``[gate; up]`` weight of ``n`` rows, or None (the plain
    GEMM and a separate SiLU-and-mul)."""
    return _choose("gated_" + act_format, "none", m, n, k)


def pick_gated(qw: QuantizedWeight, m: int) -> Plan | None:
    return gated_plan(qw.scheme.act_format, m, *qw.shape)


def pick_gated_w4(qw: QuantizedWeight, m: int, device: torch.device, dense: bool = False) -> Plan | None:
    """The plain w4a16 plan for ``m`` rows when the gated epilogue may run it (table
    ``gated_w4a16`` allows and the plan is the wgmma kernel), else None."""
    n, k = qw.shape
    if family(qw.scheme) != "w4a16" or _choose("gated_w4a16", gpu_gen(device, torch.bfloat16), m, n, k) is None:
        return None
    plan = pick(qw, m, device, torch.bfloat16, dense)
    return plan if plan.kernel == "wgmma" else None


def act_quant_plan(m: int, k: int) -> tuple[int, int]:
    """(columns per block, warps) of the activation quantizer."""
    ov = _OVERRIDES.get().get("act_quant")
    if ov is None:
        return act_quant_config(k)
    return ov(m, k) if callable(ov) else ov
