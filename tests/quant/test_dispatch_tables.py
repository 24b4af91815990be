"""The dispatch tables as data decide every shape exactly as the predicates in code they replaced.

``data/dispatch_decisions.json`` (``data/capture_dispatch_decisions.py``, run on the code
before the change) holds ``dispatch.lookup`` for every family, GPU row set and dense flag over
a grid: every N and K of the model shapes the old predicates were named after, both sides of
each threshold they compared against, weights on both sides of 2^25-2^27 elements, 40 random
shapes, and M at every row boundary and tile-count step.
"""

import json
from pathlib import Path

import pytest

from quarl.quant.kernels import dispatch, tables

DATA = json.loads((Path(__file__).parent / "data" / "dispatch_decisions.json").read_text())


def encode(plan) -> list | None:
    if plan is None:
        return None
    cfg = plan.config
    return [plan.kernel, None if cfg is None else type(cfg).__name__, None if cfg is None else list(cfg)]


def _expanded(run: list) -> list:
    return [DATA["plans"][i] for i, count in run for _ in range(count)]


@pytest.mark.parametrize("col", range(len(DATA["columns"])), ids=lambda c: "-".join(map(str, DATA["columns"][c])))
def test_the_tables_decide_as_the_old_predicates(col):
    fam, gen, dense = DATA["columns"][col]
    ms, bad = DATA["ms"], []
    runs = [_expanded(run) for run in DATA["runs"]]
    for n, k, *run_ids in DATA["shapes"]:
        want = runs[run_ids[col]]
        for m, w in zip(ms, want):
            got = encode(dispatch.lookup.__wrapped__(fam, gen, m, n, k, dense))
            if got != w:
                bad.append((m, n, k, got, w))
    assert len(ms) * len(DATA["shapes"]) > 50_000
    assert not bad, f"{len(bad)} decisions differ, e.g. {bad[:3]}"


def test_the_grid_covers_every_named_shape_and_threshold():
    shapes = {(n, k) for n, k, *_ in DATA["shapes"]}
    for hidden, inter, qkv in ((1536, 8960, 2048), (3584, 18944, 4608), (5120, 13824, 7168), (5120, 27648, 7168)):
        for n, k in ((qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)):
            assert (n, k) in shapes, (n, k)
    for m in (4, 8, 16, 32, 64, 127, 128, 256, 384, 512, 768, 1024, 2047):
        assert {m, m + 1} <= set(DATA["ms"])


def test_every_table_ends_in_a_catch_all_and_a_row_speaks_only_of_dimensions():
    for fam, by_gen in tables.TABLES.items():
        for gen, rows in by_gen.items():
            assert rows[-1].m_max is None and not rows[-1].when, (fam, gen)
            for row in rows:
                assert all(isinstance(w, tables.When) for w in row.when)


def test_when_bounds_are_inclusive_and_tiles_count_blocks():
    w = tables.When(m_min=33, n_max=2048, weight_min=1 << 20)
    assert w.holds(33, 2048, 512) and not w.holds(32, 2048, 512) and not w.holds(33, 2049, 512)
    assert not w.holds(33, 2048, 511)  # 2048 x 511 < 2^20
    one_wave = tables.Tiles(128, 128, hi=132)
    assert one_wave.holds(512, 4224) and not one_wave.holds(513, 4224)  # 4 x 33 = 132; 5 x 33 = 165
    assert tables.When(square=True).holds(1, 3584, 3584) and not tables.When(square=True).holds(1, 3584, 3585)
