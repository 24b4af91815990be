"""The dispatch tables pick exactly what the branching config functions of c62667c picked.

``data/dispatch_c62667c.json`` holds, for a grid of (M, N, K) and each GPU generation, the
kernel and config the old dispatch ran (``data/capture_dispatch_c62667c.py``). Rows were
added on purpose (w4a16 on sm90 at M = 65-128: 128-token wgmma tiles instead of dequantize +
cuBLAS; fp8 at M = 17-128 with K > 8192 over N <= 2048: the TMA kernel with K split; fp8 at
M = 17-128 with N, K <= 2048: the pointer kernel on 64 x 32 tiles; the gated fp8 GEMM at
M = 17-128 for hidden sizes up to 2048; w4a16 on sm90 at M = 129-512 on all but the smallest
weights and at 65-128 on wide outputs: the wgmma kernel's pre-scaled loop instead of dequantize +
cuBLAS or the single-tile loop; w4a16 on sm90 at M = 33-64 on weights up to
2048 x 2048: fewer K splits); every other case must match.
"""

import json
from pathlib import Path

import pytest

from quarl.quant.kernels import dispatch
from quarl.quant.kernels.dispatch import Plan

DATA = json.loads((Path(__file__).parent / "data" / "dispatch_c62667c.json").read_text())
OLD_TILE = DATA["fields"]["TileConfig"]
# the old TileConfig's kernel name for each new plan kernel
OLD_KERNEL = {"swap": "swapb", "dequant": "dequant", "tiled": "tiled", "pointer": "tiled", "w4a8": "tiled",
              "tma": "tma", "cublas": "cublas", "gated": "tma"}


def old_form(plan: Plan | None, fam: str):
    """``plan`` as the capture wrote the old choice: [type, *fields]."""
    if plan is None:
        return None
    cfg = plan.config
    if plan.kernel in ("frag", "tile", "wgmma"):
        fields = list(cfg)
        if plan.kernel == "wgmma":  # fields added after the capture, at their defaults
            assert not cfg.prescale and not cfg.tile and not cfg.halves
            fields = fields[:8] if cfg.mbar else fields[:7]  # (nwg .. cluster, and mbar where set)
        return [type(cfg).__name__, *fields]
    if plan.kernel == "dequant" and fam == "wo":
        return ["dequant"]
    if cfg is None:
        cfg = dispatch.TileConfig(0, 0)
    fields = dict(cfg._asdict(), kernel=OLD_KERNEL[plan.kernel], cpi=1, words=False, ws=False)
    return ["TileConfig", *(fields[f] for f in OLD_TILE)]


FAMILY = {"w4": "w4a16", "wo": "weight_only", "fp8": "fp8", "int8": "int8", "w4a8": "w4a8",
          "gated_fp8": "gated_fp8", "gated_int8": "gated_int8"}


def _wide_hidden_m33(m: int, n: int, k: int) -> bool:
    """33-64 tokens, hidden >= 5120, no wide output: q/k/v and o, and down on weights of 2^27+ elements."""
    return m > 32 and ((5120 <= k <= 8192 and n < 16384) or (k > 8192 and n * k >= 1 << 27))


def _cases():
    for gen, m, n, k, *idx in DATA["rows"]:
        for fam, i in zip(DATA["families"], idx):
            if i != -1:
                yield gen, m, n, k, fam, None if i is None else DATA["configs"][i]


def test_tables_match_the_old_dispatch():
    bad, count = [], 0
    for gen, m, n, k, fam, want in _cases():
        count += 1
        if fam == "w4" and gen == "sm90" and 64 < m <= 128:  # the added rows: 128-token wgmma tiles
            assert want == ["dequant"] or want[0] == "TileConfig", want
            got = dispatch.lookup("w4a16", gen, m, n, k)
            # since s43 every row here feeds its loop with TMA copies: wide outputs and the 14B / 32B
            # weights (both sides >= 5120, K split in clusters) the pre-scaled loop, the rest the
            # single-tile loop
            if n >= 16384 and -(-n // 256) <= 132 < -(-n // 192):  # (s48: four warpgroups fill one wave)
                assert got.config == dispatch.WgConfig(4, 4, 1.0, tail=True, prescale=True, tma=True), (m, n, k)
            elif n >= 16384:  # (with a producer warpgroup since s46)
                assert got.config == dispatch.WgConfig(3, 4, 1.0, tail=True, prescale=True, tma=True,
                                                       producer=True), (m, n, k)
            elif n >= 5120 and k >= 5120:
                assert got.config == dispatch.WgConfig(3, 4, 1.0, tail=True, cluster=True, prescale=True,
                                                       tma=True), (m, n, k)
            else:
                nwg = 1 if n < 2048 and k <= 4096 else 2
                assert got.config == dispatch.WgConfig(nwg, 4, 1.0, single=True, tail=True, cluster=True, mbar=True,
                                                       tma=True), (m, n, k)
            continue
        if fam == "w4" and gen == "sm90" and 128 < m <= 512:  # added: the pre-scaled wgmma loop
            assert want == old_form(dispatch.DEQUANT, fam), want
            got = dispatch.lookup("w4a16", gen, m, n, k)
            # cuBLAS on the dequantized weight on the 1.5B's squares, from 256 rows on weights of
            # K <= 4096 and N < 16384, and past 384 rows on weights under 2^25 elements; since s43
            # the pre-scaled loop with TMA copies elsewhere: 256-row tiles on weights of 2^25+
            # elements (but at 257-384 rows); at 257-384 rows four warpgroups on wide outputs and
            # weights of 2^26+ elements; three with K split in clusters where both sides are
            # >= 5120 (up to 256 rows, or a 2^25+ weight); three on wide outputs, two on the rest
            # (since s46 the 256-row tiles and the two- and three-warpgroup loops with a producer)
            # (since s47 the 256-row tiles with K split in clusters at 129-256 rows where those fill one wave)
            # (since s48 the 7B's q/k/v and o at 257-512 rows: the loops whose tiles fill one wave)
            # (since s49 the 14B's o and down at 385-512 rows: 192-row tiles, one wave)
            big = n * k >= 1 << 25
            c = -(-n // 128)
            narrow = 256 < m and n < 16384 and k <= 4096 and not (n <= 2048 and k <= 2048)
            if narrow and 2 * -(-n // 192) * -(-m // 128) <= 132:
                assert got.config == dispatch.WgConfig(3, 4, 1.0, tail=True, cluster=True, prescale=True,
                                                       tma=True), (m, n, k)
            elif narrow and c * -(-m // 128) <= 132:
                assert got.config == dispatch.WgConfig(2, 4, 1.0, tail=True, prescale=True, tma=True,
                                                       producer=True), (m, n, k)
            elif narrow and c * -(-m // 192) <= 132:
                assert got.config == dispatch.WgConfig(2, 4, 1.0, tail=True, prescale=True, tile=192, tma=True,
                                                       producer=True), (m, n, k)
            elif 384 < m and 5120 <= n and 5120 <= k <= 13824 and c * -(-m // 192) <= 132:  # (the 14B's o and down)
                assert got.config == dispatch.WgConfig(2, 4, 1.0, tail=True, prescale=True, tile=192, tma=True,
                                                       producer=True), (m, n, k)
            elif (m <= 256 and not (n <= 2048 and k <= 2048) and 2 <= min(132 // c, k // 256, 8)
                  and c * min(132 // c, k // 256, 8) <= 112):
                assert got.config == dispatch.WgConfig(2, 3, 1.0, tail=True, cluster=True, prescale=True, tile=256,
                                                       tma=True), (m, n, k)
            elif (n <= 2048 and k <= 2048) or (m >= 256 and n < 16384 and k <= 4096) or (m > 384 and not big):
                assert got == dispatch.DEQUANT, (m, n, k)
            elif big and not 256 < m <= 384:
                assert got.config == dispatch.WgConfig(2, 3, 1.0, tail=True, prescale=True, tile=256, tma=True,
                                                       producer=True)
            else:
                cluster = n >= 5120 and k >= 5120 and (m <= 256 or big) and n < 16384 and n * k < 1 << 26
                nwg = 4 if m > 256 and (n * k >= 1 << 26 or n >= 16384) else 3 if n >= 16384 or cluster else 2
                assert got.config == dispatch.WgConfig(nwg, 4, 1.0, tail=True, cluster=cluster, prescale=True,
                                                       tma=True, producer=not cluster and nwg < 4), (m, n, k)
            continue
        if fam == "w4" and gen == "sm90" and 768 < m <= 1024 and n == k and 2048 < n < 5120:  # added in s50: the 7B's o
            assert want == old_form(dispatch.DEQUANT, fam), want
            assert dispatch.lookup("w4a16", gen, m, n, k).config == dispatch.WgConfig(
                2, 3, 1.0, tail=True, prescale=True, tile=256, tma=True, producer=True), (m, n, k)
            continue
        # added: 256-row tiles (on weights of 2^25 elements or more)
        if fam == "w4" and gen == "sm90" and 512 < m <= 1024 and n * k >= 1 << 25:
            assert want == old_form(dispatch.DEQUANT, fam), want
            got = dispatch.lookup("w4a16", gen, m, n, k)
            if m > 768 and k > 8192 and n >= 5120:  # (but cuBLAS on the dequantized weight there since s47)
                assert got == dispatch.DEQUANT, (m, n, k)
                continue
            assert got.config == dispatch.WgConfig(2, 3, 1.0, tail=True, prescale=True, tile=256, tma=True,
                                                   producer=True), (m, n, k)
            continue
        if fam == "fp8" and 16 < m <= 128 and k > 8192 and n <= 2048:  # added: 1.5B down, K split
            got = dispatch.lookup("fp8", "none", m, n, k)
            assert got.kernel == "tma" and got.config.split_k == (4 if m <= 64 else 2), (m, n, k)
            assert got.config.bm == 64, (m, n, k)
            continue
        if fam == "fp8" and 16 < m <= 128 and n <= 2048 and k <= 2048:  # added: 1.5B q/k/v and o
            got = dispatch.lookup("fp8", "none", m, n, k)
            assert got == Plan("pointer", dispatch.TileConfig(64, 32, 256, split_k=1, num_stages=4)), (m, n, k)
            continue
        if fam == "gated_fp8" and 16 < m <= 128 and k <= 2048:  # added: the gated GEMM for the 1.5B's gate/up
            got = dispatch.lookup("gated_fp8", "none", m, 2 * n, k)
            assert got.kernel == "gated" and got.config.bm == 64 and got.config.bn == (32 if m <= 64 else 64), (m, n, k)
            continue
        # added: 14B / 32B shapes at M 33-64
        if fam == "w4" and gen == "sm90" and m <= 64 and _wide_hidden_m33(m, n, k):
            got = dispatch.lookup("w4a16", gen, m, n, k)
            assert got.config == dispatch.WgConfig(3, 4, 1.0, True, 1, True, True), (m, n, k)
            continue
        # added: the 1.5B's o and q/k/v at 33-64
        if fam == "w4" and gen == "sm90" and m <= 64 and (m > 32 and n <= 2048 and k <= 2048):
            assert dispatch.lookup("w4a16", gen, m, n, k).config == dispatch.WgConfig(
                1, 4, 1.0, True, 1, True, True, mbar=True, tma=True)  # s42: the TMA loop
            continue
        if fam == "w4" and gen == "sm90" and m <= 64 and (m > 32 and n < 16384):  # added s42: the TMA loop
            assert dispatch.lookup("w4a16", gen, m, n, k).config == dispatch.WgConfig(
                1, 4, 2.0, True, 2, True, True, mbar=True, tma=True), (m, n, k)
            continue
        if fam == "w4" and gen == "sm90" and m <= 64 and (m > 32 and k > 8192):  # added s42: down, the TMA loop
            got = dispatch.lookup("w4a16", gen, m, n, k)
            assert got.config == dispatch.WgConfig(1, 4, 2.0, True, 2, True, True, mbar=True, tma=True), (m, n, k)
            continue
        if want == ["WgConfig", 3, 4, 1.0, True, 1, True, False]:  # since s25: 5 slots, per-slot mbarriers; s42: TMA
            got = dispatch.lookup("w4a16", gen, m, n, k)
            assert got.config == dispatch.WgConfig(3, 5, 1.0, True, 1, True, mbar=True, tma=True), (m, n, k)
            continue
        if fam == "act_quant":
            got = list(dispatch.act_quant_plan(m, k))
        else:
            nn = 2 * n if fam.startswith("gated") else n  # the capture asked for a [gate; up] of 2 n rows
            got = old_form(dispatch.lookup(FAMILY[fam], gen if fam == "w4" else "none", m, nn, k), fam)
        if got != want:
            bad.append((gen, m, n, k, fam, got, want))
    assert count > 5000
    assert not bad, f"{len(bad)} differ, e.g. {bad[:3]}"


def test_every_generation_has_a_row_for_every_shape():
    for fam in dispatch.TABLES:
        for gen in dispatch.GENS:
            for m in (1, 7, 64, 100, 3000):
                dispatch.lookup(fam, gen, m, 4096, 12288)  # raises when no row matches


def test_hopper_runs_wgmma_and_the_others_frag_tile_or_swap():
    assert dispatch.lookup("w4a16", "sm90", 1, 4608, 3584).kernel == "wgmma"
    assert dispatch.lookup("w4a16", "sm90", 64, 37888, 3584).config.nwg == 3
    # the 32B's o and down at M = 64 (an H100 sweep of the wgmma kernel on the 32B at M = 64); the 7B's as before
    for n, k in ((5120, 5120), (7168, 5120), (5120, 27648)):
        assert dispatch.lookup("w4a16", "sm90", 64, n, k).config == dispatch.WgConfig(3, 4, 1.0, True, 1, True, True)
        assert dispatch.lookup("w4a16", "sm90", 32, n, k).config != dispatch.WgConfig(3, 4, 1.0, True, 1, True, True)
    # down projections (K > 8192) at 33-64 rows: the TMA loop, one warpgroup (sweep_tma64_1p5b_h200_s42.json)
    tma_down = dispatch.WgConfig(1, 4, 2.0, True, 2, True, True, mbar=True, tma=True)
    assert dispatch.lookup("w4a16", "sm90", 64, 3584, 18944).config == tma_down
    assert dispatch.lookup("w4a16", "sm90", 33, 1536, 8960).config == tma_down
    assert dispatch.lookup("w4a16", "sm90", 32, 1536, 8960).config.nwg == 2
    assert dispatch.lookup("w4a16", "sm90", 64, 17920, 1536).config.tma
    assert dispatch.lookup("w4a16", "sm90", 64, 3584, 3584).config.nwg == 1
    # the 1.5B's o and q/k/v at 33-64 rows: one block per SM's worth of K splits (sweep_wgmma_1p5b_m64_h100_s38.json),
    # the TMA loop since s42; the 7B's q/k/v and o at 33-64 rows: the TMA loop, two blocks per SM
    small = dispatch.WgConfig(1, 4, 1.0, True, 1, True, True, mbar=True, tma=True)
    assert dispatch.lookup("w4a16", "sm90", 64, 1536, 1536).config == small
    assert dispatch.lookup("w4a16", "sm90", 32, 1536, 1536).config != small
    assert dispatch.lookup("w4a16", "sm90", 64, 4608, 3584).config == tma_down
    assert not dispatch.lookup("w4a16", "sm90", 32, 4608, 3584).config.tma
    assert dispatch.lookup("w4a16", "sm90", 64, 3584, 3584).config.blocks_per_sm == 2.0
    # 65-128 rows since s43 (sweep_pstma_{1p5b,7b_m128,14b}_h200_s43.json): the single-tile loop
    # with TMA copies, one warpgroup on the 1.5B's small weights, two on the rest; the pre-scaled
    # loop with TMA copies on wide outputs (three warpgroups) and on the 14B's weights (two)
    single = dispatch.WgConfig(2, 4, 1.0, single=True, tail=True, cluster=True, mbar=True, tma=True)
    for n, k in ((4608, 3584), (3584, 3584), (3584, 18944), (1536, 8960), (2048, 1536)):
        assert dispatch.lookup("w4a16", "sm90", 65, n, k).config == single, (n, k)
        assert dispatch.lookup("w4a16", "sm90", 128, n, k).config == single, (n, k)
    assert dispatch.lookup("w4a16", "sm90", 128, 1536, 1536).config == single._replace(nwg=1)
    # (s46: the loops without clusters, of 2-3 warpgroups, have a producer warpgroup)
    ps = dispatch.WgConfig(3, 4, 1.0, tail=True, prescale=True, tma=True, producer=True)
    psc = ps._replace(cluster=True, producer=False)
    for n, k in ((37888, 3584), (17920, 1536), (55296, 5120)):
        assert dispatch.lookup("w4a16", "sm90", 128, n, k).config == ps, (n, k)
    # s48 (sweep_mid_14b_gateup_m128_h200_s48.json): four warpgroups where their 256-column
    # blocks fill one wave and three warpgroups' take two (the 14B's gate/up)
    assert dispatch.lookup("w4a16", "sm90", 128, 27648, 5120).config == ps._replace(nwg=4, producer=False)
    for n, k in ((5120, 5120), (7168, 5120), (5120, 13824)):
        assert dispatch.lookup("w4a16", "sm90", 100, n, k).config == psc, (n, k)
    # 129-512 rows (sweep_pstma_7b_h200_s43.json and the 1.5B's and 14B's): cuBLAS on the
    # dequantized weight on the 1.5B's squares, from 256 rows for the 7B's q/k/v and o, and past
    # 384 rows on weights under 2^25 elements; the pre-scaled loop with TMA copies elsewhere:
    # 256-row tiles on the large weights at 129-256 and 385-512 rows, four warpgroups at 257-384,
    # three with K split in clusters on the 14B's o up to 256 rows and q/k/v at 257-384
    for m, n, k in ((512, 17920, 1536), (512, 1536, 8960), (200, 2048, 1536), (256, 1536, 1536)):
        assert dispatch.lookup("w4a16", "sm90", m, n, k) == dispatch.DEQUANT, (m, n, k)
    tile256 = dispatch.WgConfig(2, 3, 1.0, tail=True, prescale=True, tile=256, tma=True, producer=True)
    for m, n, k in ((129, 37888, 3584), (512, 37888, 3584), (400, 3584, 18944), (256, 27648, 5120), (256, 5120, 13824)):
        assert dispatch.lookup("w4a16", "sm90", m, n, k).config == tile256, (m, n, k)
    # s47 (sweep_mid_7b_h200_s47.json, sweep_bf16s_*_h200_s47.json): at 129-256 rows the 256-row
    # tile splits K in clusters where those fill one wave (7B q/k/v, o and down, 14B q/k/v, the
    # 1.5B's down; not the 14B's o and down); at 769-1024 rows the 14B's and 32B's down run cuBLAS
    # on the dequantized weight, and at 513-1024 rows the 14B's q/k/v (2^25 elements) the 256-row tile
    for m, n, k in ((129, 3584, 3584), (256, 3584, 3584), (256, 4608, 3584), (256, 3584, 18944), (200, 1536, 8960),
                    (256, 7168, 5120)):
        want = tile256._replace(cluster=True, producer=False)
        assert dispatch.lookup("w4a16", "sm90", m, n, k).config == want, (m, n, k)
    for m, n, k in ((769, 5120, 13824), (1024, 5120, 27648)):
        assert dispatch.lookup("w4a16", "sm90", m, n, k) == dispatch.DEQUANT, (m, n, k)
    for m, n, k in ((768, 5120, 13824), (1024, 3584, 18944), (1024, 7168, 5120), (513, 7168, 5120)):
        assert dispatch.lookup("w4a16", "sm90", m, n, k).config == tile256, (m, n, k)
    for n, k in ((37888, 3584), (3584, 18944), (17920, 1536), (27648, 5120), (5120, 13824)):
        assert dispatch.lookup("w4a16", "sm90", 300, n, k).config == ps._replace(nwg=4, producer=False), (n, k)
    assert dispatch.lookup("w4a16", "sm90", 256, 17920, 1536).config == ps
    assert dispatch.lookup("w4a16", "sm90", 300, 1536, 8960).config == ps._replace(nwg=2)
    assert dispatch.lookup("w4a16", "sm90", 384, 5120, 5120).config == ps._replace(nwg=2)
    assert dispatch.lookup("w4a16", "sm90", 256, 5120, 5120).config == psc
    assert dispatch.lookup("w4a16", "sm90", 384, 7168, 5120).config == psc
    # s48 (sweep_mid_7b_qo_qkv_h200_s48.json, three rounds): the 7B's o and q/k/v at 257-512 rows
    # run the loop whose tiles fill one wave instead of cuBLAS on the dequantized weight: three
    # warpgroups with K split two ways (o up to 384 rows), two warpgroups with a producer (q/k/v
    # up to 384, o above), 192-row tiles (q/k/v above 384)
    for m, n, k, want in ((320, 3584, 3584, psc), (384, 3584, 3584, psc), (385, 3584, 3584, ps._replace(nwg=2)),
                          (512, 3584, 3584, ps._replace(nwg=2)), (257, 4608, 3584, ps._replace(nwg=2)),
                          (384, 4608, 3584, ps._replace(nwg=2)), (385, 4608, 3584, ps._replace(nwg=2, tile=192)),
                          (512, 4608, 3584, ps._replace(nwg=2, tile=192))):
        assert dispatch.lookup("w4a16", "sm90", m, n, k).config == want, (m, n, k)
    # s49 (sweep_mid_14b_o_down_h200_s49.json, three rounds): the 14B's o and down at 385-512 rows
    # in 192-row tiles (one wave of 120 blocks), its o at 513-768 in 256-row tiles with K split in
    # clusters; the 32B's down (K = 27648, not swept) keeps the 256-row tile
    tile192 = ps._replace(nwg=2, tile=192)
    for m, n, k, want in ((385, 5120, 5120, tile192), (512, 5120, 5120, tile192), (512, 5120, 13824, tile192),
                          (512, 5120, 27648, tile256),
                          (513, 5120, 5120, tile256._replace(cluster=True, producer=False)),
                          (768, 5120, 5120, tile256._replace(cluster=True, producer=False)),
                          (768, 5120, 13824, tile256)):
        assert dispatch.lookup("w4a16", "sm90", m, n, k).config == want, (m, n, k)
    assert dispatch.lookup("w4a16", "sm90", 769, 5120, 5120) == dispatch.DEQUANT
    # 513-1024 rows (sweep_ws_7b_h200_s44.json): 256-row tiles on weights of 2^26 elements or more
    for m, n, k in ((513, 37888, 3584), (1024, 3584, 18944), (1024, 27648, 5120)):
        assert dispatch.lookup("w4a16", "sm90", m, n, k).config == tile256, (m, n, k)
    for m, n, k in ((1024, 4608, 3584), (1024, 5120, 5120), (1025, 37888, 3584), (4096, 3584, 18944)):
        assert dispatch.lookup("w4a16", "sm90", m, n, k) == dispatch.DEQUANT, (m, n, k)
    assert dispatch.lookup("w4a16", "sm80", 200, 3584, 3584) == dispatch.DEQUANT  # no wgmma before Hopper
    assert dispatch.lookup("w4a16", "sm90", 129, 37888, 3584, dense=True) == dispatch.DEQUANT
    assert dispatch.lookup("w4a16", "sm80", 129, 4608, 3584) == dispatch.DEQUANT
    for gen in ("sm80", "sm89"):
        assert dispatch.lookup("w4a16", gen, 4, 4608, 3584).kernel == "frag"
        assert dispatch.lookup("w4a16", gen, 8, 37888, 3584).kernel == "tile"
        assert dispatch.lookup("w4a16", gen, 8, 4608, 3584).kernel == "swap"
    assert {dispatch.lookup("w4a16", "none", m, 37888, 3584).kernel for m in (1, 8, 64)} == {"swap"}


def test_overrides_replace_a_family_inside_the_block_only():
    import torch

    from quarl.quant import quantize_weight

    qw = quantize_weight(torch.randn(64, 256), "w4a16")
    forced = Plan("swap", dispatch.TileConfig(16, 32, split_k=2))
    assert dispatch.pick(qw, 1, torch.device("cpu")) != forced
    with dispatch.overrides(w4a16=forced):
        assert dispatch.pick(qw, 1, torch.device("cpu")) == forced
        with dispatch.overrides(w4a16=lambda m, n, k: dispatch.DEQUANT, act_quant=(64, 4)):
            assert dispatch.pick(qw, 1, torch.device("cpu")) == dispatch.DEQUANT
            assert dispatch.act_quant_plan(1, 4096) == (64, 4)
        assert dispatch.pick(qw, 1, torch.device("cpu")) == forced
    assert dispatch.pick(qw, 1, torch.device("cpu")) != forced
    with pytest.raises(ValueError, match="unknown kernel families"):
        with dispatch.overrides(w5=forced):
            pass


def test_wgmma_config_check_names_what_it_cannot_run():
    """The wgmma kernel's config check (pure; the GPU test runs it through the kernel): M past
    128 tokens, a 128-token tile without the single fp32 tile (or the pre-scaled loop's), the
    pre-scaled loop with another loop's flags, too few stages, too much shared memory; every
    table row passes it at its own M range."""
    from quarl.quant.kernels.config import WgConfig

    with pytest.raises(ValueError, match="M <= 128"):
        WgConfig(2, 3, single=True).check(129)
    with pytest.raises(ValueError, match="needs single=True or prescale=True"):
        WgConfig(2, 4).check(65)
    WgConfig(3, 4, prescale=True).check(128)  # the pre-scaled loop keeps one fp32 tile: 128 tokens fit
    WgConfig(2, 3, prescale=True, tile=256).check(1000)  # 256-token tiles: 3 x 72 KB slots
    WgConfig(2, 4, prescale=True, tile=192).check(1000)  # 192: 4 x 56 KB
    WgConfig(2, 6, prescale=True, tile=256, halves=True).check(1000)  # 6 half slots of 36 KB
    assert WgConfig(2, 6, prescale=True, tile=256, halves=True).smem_bytes(256) == 6 * 36 * 1024 + 1024
    with pytest.raises(ValueError, match="halves=True runs 192- or 256-token tiles"):
        WgConfig(2, 6, prescale=True, halves=True).check(1000)
    with pytest.raises(ValueError, match="shared memory"):
        WgConfig(2, 7, prescale=True, tile=256, halves=True).check(1000)
    assert WgConfig(2, 3, prescale=True, tile=256).tile_tokens(100) == 256
    assert WgConfig(2, 3, prescale=True).tile_tokens(1000) == 128 and WgConfig(2, 3).tile_tokens(20) == 32
    for bad in (WgConfig(3, 3, prescale=True, tile=256), WgConfig(2, 3, single=True, tile=256),
                WgConfig(2, 3, minb=2, prescale=True, tile=256), WgConfig(2, 3, prescale=True, tile=160)):
        with pytest.raises(ValueError, match="tile=192 or 256 runs the pre-scaled loop"):
            bad.check(100)
    with pytest.raises(ValueError, match="shared memory"):
        WgConfig(2, 4, prescale=True, tile=256).check(300)  # 4 slots of 72 KB
    for bad in (WgConfig(2, 4, single=True, prescale=True), WgConfig(2, 4, single=True, mbar=True, prescale=True)):
        with pytest.raises(ValueError, match="prescale=True runs its own loop"):
            bad.check(64)
    for bad in (WgConfig(3, 5, single=True, tma=True), WgConfig(2, 4, tma=True)):
        with pytest.raises(ValueError, match="tma=True feeds the mbarrier loop"):
            bad.check(64)
    ws = WgConfig(2, 3, 1.0, tail=True, prescale=True, tile=256, tma=True, producer=True)
    ws.check(1000)
    assert ws.threads == 384 and ws._replace(producer=False).threads == 256
    for bad in (ws._replace(tma=False), ws._replace(nwg=1, tile=0), ws._replace(cluster=True),
                WgConfig(4, 4, prescale=True, tma=True, producer=True),
                WgConfig(2, 4, single=True, mbar=True, tma=True, producer=True)):
        with pytest.raises(ValueError, match="producer=True feeds the pre-scaled TMA loop"):
            bad.check(100)
    WgConfig(3, 5, single=True, mbar=True, tma=True).check(64)
    WgConfig(2, 8, prescale=True, tile=192, halves=True, tma=True).check(300)
    with pytest.raises(ValueError, match=">= 3 stages"):
        WgConfig(1, 2).check(8)
    with pytest.raises(ValueError, match="shared memory"):
        WgConfig(4, 8, single=True).check(128)
    for row in dispatch.TABLES["w4a16"]["sm90"]:
        if row.plan is not None and isinstance(row.plan.config, WgConfig):
            row.plan.config.check(row.m_max)


def test_fp8_decode_gemms_of_a_1p5b_model_take_the_swept_plans():
    """The 1.5B's fp8 decode GEMMs at 17-128 rows (session 36's sweep, bench/NOTES.md): down
    (N = 1536, K = 8960) on the TMA kernel with 256-column K steps, split in 4 on 64 x 32
    tiles up to 64 rows and in 2 on 64 x 64 tiles to 128; q/k/v and o (N, K <= 2048) on the
    pointer kernel's 64 x 32 x 256 tiles, unsplit. The 7B's (N = 3584) and larger M keep the
    old rows."""
    plan = dispatch.lookup("fp8", "none", 64, 1536, 8960)
    assert (plan.kernel, plan.config.bn, plan.config.bk, plan.config.split_k) == ("tma", 32, 256, 4)
    plan = dispatch.lookup("fp8", "none", 128, 1536, 8960)
    assert (plan.kernel, plan.config.bn, plan.config.bk, plan.config.split_k) == ("tma", 64, 256, 2)
    for n in (2048, 1536):
        for m in (17, 64, 128):
            plan = dispatch.lookup("fp8", "none", m, n, 1536)
            assert (plan.kernel, plan.config.bn, plan.config.bk, plan.config.split_k) == ("pointer", 32, 256, 1)
    assert dispatch.lookup("fp8", "none", 16, 2048, 1536).config.bm == 16
    assert dispatch.lookup("fp8", "none", 64, 4608, 3584).config.bn == 64
    assert dispatch.lookup("fp8", "none", 128, 3584, 18944).config.split_k == 2
    assert dispatch.lookup("fp8", "none", 129, 1536, 8960).config.bk == 128
    assert dispatch.lookup("int8", "none", 64, 1536, 8960).kernel == "pointer"  # int8 not swept


def test_a_kept_dense_copy_takes_small_weights_at_65_to_128_rows_on_hopper():
    """With the engine's dense copies the 1.5B-class weights (n k <= 2^25) run the plain GEMM
    at 65 <= M <= 128 on sm90 (the w4 kernel lost to bf16 on all four 1.5B shapes there);
    larger weights, other M, other GPUs and owners without a copy keep the table's plan."""
    for n, k in ((1536, 1536), (2048, 1536), (17920, 1536), (1536, 8960), (4608, 3584)):
        assert dispatch.lookup("w4a16", "sm90", 128, n, k, True).kernel == "dequant"
        assert dispatch.lookup("w4a16", "sm90", 65, n, k, True).kernel == "dequant"
        assert dispatch.lookup("w4a16", "sm90", 128, n, k).kernel == "wgmma"
        assert dispatch.lookup("w4a16", "sm90", 64, n, k, True).kernel == "wgmma"
    for n, k in ((37888, 3584), (3584, 18944)):  # 7B gate_up / down: the w4 kernel wins at M = 128
        assert dispatch.lookup("w4a16", "sm90", 128, n, k, True).kernel == "wgmma"
    assert dispatch.lookup("w4a16", "sm80", 128, 1536, 1536, True) == dispatch.lookup("w4a16", "sm80", 128, 1536, 1536)
    assert dispatch.lookup("w4a16", "sm90", 256, 1536, 1536, True).kernel == "dequant"


def test_the_gated_fp8_gemm_runs_the_small_hidden_gate_up_to_128_tokens():
    """1.5B gate/up (K = 1536) at M = 65-128: the gated GEMM (SiLU-and-mul in its epilogue),
    measured ~2.5 us a layer faster than cuBLASLt + SiLU-and-mul; the 7B's (K = 3584), where the
    two measured alike, keeps the plain GEMM (bench/NOTES.md, sessions 32-33)."""
    assert dispatch.lookup("gated_fp8", "none", 128, 17920, 1536).config.bn == 64
    assert dispatch.lookup("gated_fp8", "none", 64, 17920, 1536).config.bn == 32
    assert dispatch.lookup("gated_fp8", "none", 64, 37888, 3584).config.bn == 64
    assert dispatch.lookup("gated_fp8", "none", 100, 17920, 1536).kernel == "gated"
    assert dispatch.lookup("gated_fp8", "none", 128, 37888, 3584) is None
    assert dispatch.lookup("gated_fp8", "none", 129, 17920, 1536) is None


def test_the_gated_w4a16_epilogue_runs_the_plain_wgmma_plan_on_hopper_only():
    import torch

    from quarl.quant import quantize_weight

    assert dispatch.lookup("gated_w4a16", "sm90", 64, 17920, 1536) == Plan("wgmma")
    assert dispatch.lookup("gated_w4a16", "sm90", 128, 17920, 1536) == Plan("wgmma")
    # past 128 rows too, wherever the plain plan is the wgmma kernel (its pre-scaled loop up to 256)
    assert dispatch.lookup("gated_w4a16", "sm90", 256, 17920, 1536) == Plan("wgmma")
    assert dispatch.lookup("w4a16", "sm90", 256, 17920, 1536).kernel == "wgmma"
    assert dispatch.lookup("w4a16", "sm90", 513, 17920, 1536).kernel == "dequant"  # (pick_gated_w4: None)
    for gen in ("sm80", "sm89", "none"):
        assert dispatch.lookup("gated_w4a16", gen, 64, 17920, 1536) is None
    qw = quantize_weight(torch.randn(64, 256), "w4a16")
    assert dispatch.pick_gated_w4(qw, 4, torch.device("cpu")) is None  # no wgmma kernel off Hopper
    assert dispatch.pick_gated_w4(quantize_weight(torch.randn(64, 256), "w8a8-fp8"), 4, torch.device("cpu")) is None
