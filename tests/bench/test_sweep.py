"""quarl.bench.sweep on CPU: the family table, candidate specs, the summary, and the CLI's
answers without a GPU."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quarl.bench import sweep
from quarl.bench.sweep import FAMILIES, KERNEL_CONFIGS, ActQuantConfig, format_candidate, parse_candidates
from quarl.quant.kernels import dispatch
from quarl.quant.kernels.config import TileConfig, WgConfig
from quarl.quant.kernels.dispatch import Plan
from quarl.quant.scheme import get_scheme

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_builds_candidates_that_its_specs_read_back(name):
    fam = FAMILIES[name]
    assert fam.table in dispatch.TABLES or fam.table == "act_quant"
    with dispatch.overrides(**{fam.table: None}):  # a family the override mechanism accepts
        pass
    for m in fam.ms:
        cands = fam.candidates(m)
        assert cands and len(set(cands)) == len(cands), (name, m)
        for c in cands:
            kernel = "act_quant" if isinstance(c, ActQuantConfig) else c.kernel
            assert kernel in fam.kernels
            cls = KERNEL_CONFIGS[kernel]
            assert (c if kernel == "act_quant" else c.config) is None if cls is None else isinstance(
                c if kernel == "act_quant" else c.config, cls)
            assert parse_candidates(name, format_candidate(c)) == [c]


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.operands != "act_quant"])
def test_family_format_is_picked_from_the_table_it_overrides(name):
    fam = FAMILIES[name]
    sc = get_scheme(fam.format)
    table = ("gated_" + sc.act_format) if fam.operands == "gated" else dispatch.family(sc)
    assert table == fam.table


def test_spec_fields_positional_named_and_grids():
    got = parse_candidates("wgmma", "2,4,blocks_per_sm=1|2,cluster=1")
    assert got == [Plan("wgmma", WgConfig(2, 4, 1.0, cluster=True)), Plan("wgmma", WgConfig(2, 4, 2.0, cluster=True))]
    assert all(type(p.config.nwg) is int and type(p.config.blocks_per_sm) is float for p in got)
    assert parse_candidates("fp8", "cublas:; tma:64,64,waves=3  # a comment\npointer:16,64,256") == [
        Plan("cublas"), Plan("tma", TileConfig(64, 64, waves=3.0)), Plan("pointer", TileConfig(16, 64, 256))]
    assert parse_candidates("act-quant", "4096,4|16") == [ActQuantConfig(4096, 4), ActQuantConfig(4096, 16)]
    assert parse_candidates("wgmma", "1,3,single=true,minb=4,tail=0")[0].config == WgConfig(1, 3, single=True, minb=4)


@pytest.mark.parametrize("fam, spec, words", [
    ("wgmma", "2,4,zz=1", ["sweep wgmma", "unknown field 'zz'", "WgConfig fields: nwg, stages, blocks_per_sm"]),
    ("wgmma", "tma:64,64", ["sweep wgmma", "kernel 'tma'", "(wgmma)"]),
    ("fp8", "bm=64", ["sweep fp8", "TileConfig needs bn", "fields: bm, bn, bk"]),
    ("fp8", "cublas:128", ["sweep fp8", "cublas takes no config"]),
    ("wgmma", "blocks_per_sm=fast", ["sweep wgmma", "field blocks_per_sm", "'fast' is not a float"]),
    ("tile", "nt=4,2", ["sweep tile", "positional value after"]),
    ("int8", "64,64,nan_k=1", ["sweep int8", "unknown field 'nan_k'", "split_k"]),
    ("frag", "1,2,3,4", ["sweep frag", "FragConfig has 3 fields (nw, blocks_per_sm, stages)"]),
    ("gated-int8", " ; ", ["sweep gated-int8", "no candidates"]),
    ("nope", "1", ["unknown sweep family 'nope'", "wgmma"]),
])
def test_bad_specs_name_the_family_and_the_valid_fields(fam, spec, words):
    with pytest.raises(ValueError) as e:
        parse_candidates(fam, spec)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_shapes_and_family_shapes():
    shapes = sweep.parse_shapes("engine,1000x1041,engine", "qwen2.5-7b")
    assert [s[1:] for s in shapes] == [(3584, 3584), (4608, 3584), (37888, 3584), (3584, 18944), (1000, 1041)]
    assert [s[1:] for s in sweep.family_shapes(FAMILIES["gated-fp8"], shapes)] == [(37888, 3584), (1000, 1041)]
    assert sweep.family_shapes(FAMILIES["act-quant"], shapes) == [("K=1041", 0, 1041), ("K=3584", 0, 3584),
                                                                  ("K=18944", 0, 18944)]
    with pytest.raises(ValueError, match="neither a shape set"):
        sweep.parse_shapes("engine,37888by3584", "qwen2.5-7b")


def test_summarize_default_best_per_shape_and_best_single():
    # two shapes at M = 64; bf16 4 / 8 us, default 2 / 4, a: 1 / 8, b: 2 / 2, c: only on A (0.5)
    def row(layer, cfg, us):
        return dict(M=64, layer=layer, cfg=cfg, us=us, bf16_us={"A": 4.0, "B": 8.0}[layer])

    rows = [row("A", "default", 2.0), row("B", "default", 4.0), row("A", "a", 1.0), row("B", "a", 8.0),
            row("A", "b", 2.0), row("B", "b", 2.0), row("A", "c", 0.5), row("B", "c", math.nan), row("A", "plain", 0.1)]
    (s,) = sweep.summarize(rows)
    assert s["layers"] == ["A", "B"]
    assert math.isclose(s["default_speedup"], 2.0)  # 4/2 and 8/4
    assert math.isclose(s["best_per_shape_speedup"], math.sqrt(8 * 4))  # A: c 0.5 us, B: b 2 us; plain is no candidate
    assert s["best_single"] == "b"  # a: sqrt(1 * 8) = 2.83, b: 2; c did not run on B
    assert math.isclose(s["best_single_speedup"], math.sqrt(2 * 4))
    assert math.isclose(s["best_single_vs_default"], math.sqrt(2))  # 2/2, 4/2
    assert "best single 2.83x / 1.41x (b)" in sweep.summary_lines([s])[0]


def test_rounds_time_every_passing_plan_in_turn_and_keep_each_ones_times():
    """``time_shape``: round one checks each plan's output and times it; later rounds time
    bf16 and every plan that passed again, in the same order (a plan whose output differs is
    not timed); a gated family's plain path is the reference and an entry of its own."""
    import torch

    from quarl.quant.kernels import dispatch

    fam = sweep.family("swap")
    good, bad = sweep.parse_candidates("swap", "bm=64,bn=64;bm=128,bn=64")
    order: list[str] = []

    def call():  # the op as a candidate's override sees it: bad gives other values
        return torch.full((4,), 2.0 if dispatch._OVERRIDES.get().get(fam.table) == bad else 1.0)

    def timer(calls, reps):
        plan = dispatch._OVERRIDES.get().get(fam.table)
        name = ("bf16" if calls is bf16 else "plain" if calls is plain
                else sweep.format_candidate(plan) if plan else "default")
        order.append(name)
        return float(len(order) + 1)  # (seconds: a fake clock)

    bf16, plain = [lambda: torch.ones(4)], [lambda: torch.ones(4)]
    b = sweep.Bench([call], bf16, exact=False, bytes=1.0)
    t_bf16, entries = sweep.time_shape(fam, b, [good, bad], reps=1, rounds=3, timer=timer)
    per_round = ["bf16", "default", "swap:bm=64,bn=64"]
    assert order == per_round + per_round + per_round
    assert t_bf16 == [2, 5, 8]
    assert [(cfg, err is None) for cfg, _, err in entries] == [("default", True), ("swap:bm=64,bn=64", True),
                                                                ("swap:bm=128,bn=64", False)]
    assert entries[1][1] == [4, 7, 10] and all(t != t for t in entries[2][1]) and len(entries[2][1]) == 1
    order.clear()
    gated = sweep.Bench([call], bf16, exact=False, bytes=1.0, plain=plain)
    _, entries = sweep.time_shape(fam, gated, [good], reps=1, rounds=2, timer=timer)
    assert order == ["bf16", "plain", "default", "swap:bm=64,bn=64"] * 2
    assert [cfg for cfg, _, _ in entries] == ["plain", "default", "swap:bm=64,bn=64"]


def _quarl(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "quarl", *args], capture_output=True, text=True, timeout=120, env=env)


def test_sweep_cli_without_a_gpu():
    r = _quarl("bench", "sweep", "--help")
    assert r.returncode == 0 and "--out" in r.stdout and "--candidates" in r.stdout and "gated-fp8" in r.stdout
    r = _quarl("bench", "sweep", "wgmma", "--m", "64", "--candidates", "2,4,2")
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr, r.stderr
    r = _quarl("bench", "sweep", "fp8", "--candidates", "tma:64")
    assert r.returncode == 2 and "sweep fp8" in r.stderr and "needs bn" in r.stderr and "Traceback" not in r.stderr
    r = _quarl("bench", "sweep", "int8", "--format", "w4a16")
    assert r.returncode == 2 and "table w4a16" in r.stderr
    r = _quarl("bench", "sweep", "wgmma", "--rounds", "0")
    assert r.returncode == 2 and "--rounds 0" in r.stderr and "Traceback" not in r.stderr
    r = _quarl("bench", "sweep", "wgmma", "--m", "16", "--list")  # no GPU needed
    assert r.returncode == 0 and "wgmma:nwg=1,stages=3,tail=1\n" in r.stdout
    for bad in (("fp8", "--trace"), ("mid", "--trace", "--once", "--candidates", "dequant:")):
        r = _quarl("bench", "sweep", *bad)
        assert r.returncode == 2 and "--trace probes the w4a16 wgmma kernel" in r.stderr, r.stderr
    r = _quarl("bench", "sweep", "mid", "--trace")
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr, r.stderr
    r = _quarl("bench", "rollout", "--profile-kernels")
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr, r.stderr
    r = _quarl("bench", "rollout", "--kv-cache-dtype", "auto,fp16")
    assert r.returncode == 2 and "kv_cache_dtype must be 'auto'" in r.stderr and "Traceback" not in r.stderr


def test_candidates_from_a_file(tmp_path):
    from quarl.cli.bench_sweep import _candidates

    f = tmp_path / "c.txt"
    f.write_text("# wgmma shapes of run 19\n2,3,2,single=1\n1,4,blocks_per_sm=2|4\n")
    assert _candidates("wgmma", f"@{f}") == [Plan("wgmma", WgConfig(2, 3, 2.0, True)),
                                             Plan("wgmma", WgConfig(1, 4, 2.0)),
                                             Plan("wgmma", WgConfig(1, 4, 4.0))]


def _saved_sweep(device: str = "NVIDIA H200") -> dict:
    """A saved sweep of family mid on three shapes at M = 128 (times by hand)."""
    def spec(m, n, k):
        return format_candidate(dispatch.lookup("w4a16", "sm90", m, n, k))

    now_a, now_b = spec(128, 3584, 18944), spec(128, 37888, 3584)
    assert now_a != now_b and "tma=1" in now_a
    row = dict(M=128, layer="", N=0, K=0, bf16_us=0.0, error=None)
    rows = [
        # down: the table's plan now was swept (12 us) but another ran faster (10 us): flagged
        {**row, "layer": "down", "N": 3584, "K": 18944, "bf16_us": 12.0, "cfg": "default", "plan": "wgmma:old",
         "us": 24.0},
        {**row, "layer": "down", "N": 3584, "K": 18944, "bf16_us": 12.0, "cfg": now_a, "us": 12.0},
        {**row, "layer": "down", "N": 3584, "K": 18944, "bf16_us": 12.0, "cfg": "wgmma:fast", "us": 10.0},
        {**row, "layer": "down", "N": 3584, "K": 18944, "bf16_us": 12.0, "cfg": "wgmma:broken", "us": 1.0,
         "error": "relative error 0.5"},
        # gate/up: the table then picked what it picks now (no candidate row of it): the default's time
        {**row, "layer": "gate_up", "N": 37888, "K": 3584, "bf16_us": 30.0, "cfg": "default", "plan": now_b,
         "us": 20.0},
        {**row, "layer": "gate_up", "N": 37888, "K": 3584, "bf16_us": 30.0, "cfg": "wgmma:slow", "us": 40.0},
        # o: the plan picked now was not a candidate
        {**row, "layer": "o", "N": 3584, "K": 3584, "bf16_us": 8.0, "cfg": "default", "plan": "wgmma:old", "us": 10.0},
    ]
    return {"benchmark": "sweep", "family": "mid", "format": "w4a16", "device": device, "git_commit": "abc",
            "rows": rows}


def test_the_table_now_replayed_over_a_saved_sweep():
    rows = {r["layer"]: r for r in sweep.against_table(_saved_sweep())}
    down, gu, o = rows["down"], rows["gate_up"], rows["o"]
    assert (down["then_us"], down["now_us"], down["best_us"], down["best_cfg"]) == (24.0, 12.0, 10.0, "wgmma:fast")
    assert (gu["then_us"], gu["now_us"], gu["best_us"], gu["best_cfg"]) == (20.0, 20.0, 20.0, gu["now_plan"])
    assert o["then_us"] == 10.0 and math.isnan(o["now_us"]) and o["then_plan"] == "wgmma:old"
    lines = sweep.against_lines(list(rows.values()))
    flagged = [ln for ln in lines if ln.endswith("<<")]
    assert len(flagged) == 2 and any("down" in ln for ln in flagged) and any("(not swept)" in ln for ln in flagged)
    # over down and gate/up (swept then and now): then sqrt(12/24 * 30/20), now sqrt(12/12 * 30/20)
    assert lines[-1] == (f"M=128: 2 shapes, geomean over bf16: then {math.sqrt(0.5 * 1.5):.2f}x, "
                         f"now {math.sqrt(1.5):.2f}x")
    assert sweep.against_lines(list(rows.values()), slack=1.25)[0].endswith("  now: " + down["now_plan"])


def test_a_saved_sweeps_generation_comes_from_its_device_or_gen():
    assert sweep.sweep_gen({"device": "NVIDIA H100 80GB HBM3"}) == "sm90"
    assert sweep.sweep_gen({"device": "NVIDIA A100-SXM4-80GB"}) == "sm80"
    with pytest.raises(ValueError, match="pass --gen"):
        sweep.sweep_gen({"device": "cpu"})
    # on an A100 the w4a16 table has no wgmma rows: the plans now are others
    assert all("wgmma" not in r["now_plan"] for r in sweep.against_table(_saved_sweep("NVIDIA A100"), None))
    assert all("wgmma" not in r["now_plan"] for r in sweep.against_table(_saved_sweep("cpu"), "sm80"))


def test_sweep_against_saved_files_needs_no_gpu(tmp_path):
    import json

    f = tmp_path / "s.json"
    f.write_text(json.dumps(_saved_sweep()))
    r = _quarl("bench", "sweep", "mid", "--against", str(f))
    assert r.returncode == 0 and r.stdout.count("<<") == 2 and "M=128: 2 shapes" in r.stdout, r.stderr
    r = _quarl("bench", "sweep", "wgmma", "--against", str(f))
    assert r.returncode == 2 and "a sweep of family mid, not wgmma" in r.stderr
    r = _quarl("bench", "sweep", "mid", "--against", str(tmp_path / "none.json"))
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr


COMMITTED_MID = [("sweep_producer_1p5b_h200_s46", (128, 384)),
                                     ("sweep_bf16s_1p5b_h200_s47", (256,)),
                                     ("sweep_producer_7b_384_h200_s46", (384,)),
                                     ("sweep_producer_14b_h200_s46", (128, 384)),
                                     ("sweep_bf16s_14b_h200_s47", (256, 1024)),
                                     ("sweep_ws_7b_h200_s44", (4096,)),
                                     ("sweep_mid_7b_qo_qkv_h200_s48", (320, 384, 448, 512)),
                                     ("sweep_mid_14b_gateup_m128_h200_s48", (128,)),
                                     ("sweep_mid_14b_o_down_h200_s49", (512, 768, 1024)),
                                     ("sweep_mid_7b_burst_streamk_h200_s50", (128, 256, 512, 1024))]


def _superseded(name: str) -> set[tuple[int, int, int]]:
    """The (M, N, K) a later session's sweep in :data:`COMMITTED_MID` covers (its rows rest on it)."""
    import json

    session = int(name.rsplit("_s", 1)[1])
    out = set()
    for other, ms in COMMITTED_MID:
        if int(other.rsplit("_s", 1)[1]) > session:
            rows = json.loads((ROOT / "bench" / "baselines" / "sweeps" / f"{other}.json").read_text())["rows"]
            out |= {(r["M"], r["N"], r["K"]) for r in rows if r["M"] in ms}
    return out


@pytest.mark.parametrize("name,ms", COMMITTED_MID)
def test_the_hopper_w4a16_rows_pick_near_the_fastest_of_the_committed_mid_sweeps(name, ms):
    """The sm90 rows at 65-4096 rows against the H200 sweeps they were written from (session
    46's, where the producer warpgroup came in; session 47's, with the pre-scaled loop's bf16
    multiply, at the M where rows changed (the 7B's now read in s50's); s44's at 4096 rows;
    s48's, three rounds each, for the 7B's q/k/v and o at 257-512 rows and the 14B's gate/up
    at 128; s49's for the 14B's o and down at 512-1024 rows, wgmma plans and cuBLAS on the
    dequantized weight only; s50's of the 7B at 128-1024 rows, timed in the burst power state;
    an (M, shape) a later sweep covers is read there only): where the table's plan was swept
    it is within 12% of that (M, shape)'s fastest candidate (in session 46 one plan timed
    twice in one sweep at 512+ rows moved by up to 11%), and per M the plans picked now are no
    slower than those picked when the sweep ran."""
    import json

    result = json.loads((ROOT / "bench" / "baselines" / "sweeps" / f"{name}.json").read_text())
    later = _superseded(name)
    rows = [r for r in sweep.against_table(result) if r["M"] in ms and (r["M"], r["N"], r["K"]) not in later]
    swept = [r for r in rows if r["now_us"] == r["now_us"]]
    cases = {(r["M"], r["N"], r["K"]) for r in result["rows"] if r["M"] in ms} - later
    assert cases and len(rows) == len(cases) and swept == rows, [r for r in rows if r not in swept]
    slow = [(r["M"], r["layer"], r["now_us"], r["best_us"]) for r in swept if r["now_us"] > 1.12 * r["best_us"]]
    assert not slow
    for m in {r["M"] for r in swept}:
        at = [r for r in swept if r["M"] == m and r["then_us"] == r["then_us"]]
        assert sweep._geomean([r["now_us"] for r in at]) <= 1.005 * sweep._geomean([r["then_us"] for r in at]), m


@pytest.mark.parametrize("fam,ms", [("wgmma", (64, 128)), ("mid", (128, 256, 384, 512, 1024))])
def test_the_hopper_w4a16_families_time_the_tables_own_plans(fam, ms):
    """A default sweep of a family times each plan the sm90 table picks in its range on the 1.5B,
    7B and 14B engine shapes as a candidate of its own, not only as the ``default`` column (the
    s46 producer plans and the s42 TMA loops were missing from the defaults before)."""
    from quarl.bench.gemm import MODELS, linear_shapes

    family = FAMILIES[fam]
    shapes = {(s.n, s.k) for mdl in ("qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-14b")
              for s in linear_shapes(MODELS[mdl], ("engine",))}
    missing = []
    for m in ms:
        cands = {format_candidate(c) for c in family.candidates(m)}
        for n, k in sorted(shapes):
            spec = sweep._table_spec(family, family.format, "sm90", m, n, k)
            if spec.startswith("wgmma") and spec not in cands:
                missing.append((m, n, k, spec))
    assert not missing, missing


def _probe_row(entry, landed, loop_done, begin, written, sm, t0=7_000_000_000, mhz=0):
    """A block's probes, times in ns from ``t0`` (the timer's own origin; 0: not passed); with
    ``mhz``, clock64 counts at "landed" and "loop done" as an SM at that clock would read them."""
    times = [t0 + t if t or i == 0 else 0 for i, t in enumerate((entry, landed, loop_done, begin, written))]
    clocks = [0, 5_000, 5_000 + (loop_done - landed) * mhz // 1000, 0, 0] if mhz else [0] * 5
    return times + clocks + [sm, 0]


def test_trace_summary_phases_and_idle_time_by_hand():
    """Three blocks on two of three SMs: SM 0 runs 0-10 us then 12-20, SM 1 2-18 and SM 2 none;
    the third block has no "landed" probe (its fill and loop are not counted), a fourth row is a
    block that never ran. Span 20 us; idle: SM 0 2 us (10%), SM 1 2 + 2 us (20%), SM 2 all of it."""
    trace = [_probe_row(0, 1000, 9000, 9000, 10000, 0, mhz=1980),
             _probe_row(12000, 13500, 19000, 19000, 20000, 0, mhz=1500),
             _probe_row(2000, 0, 17000, 17000, 18000, 1, mhz=1000), [0] * 12]
    s = sweep.trace_summary(trace, sms=3)
    assert s["blocks"] == 3 and s["sms_used"] == 2 and s["span_us"] == 20.0
    assert s["fill"] == dict(median_us=1.5, p90_us=1.5)  # 1.0 and 1.5 us: the upper middle
    assert s["loop"] == dict(median_us=8.0, p90_us=8.0)  # 8.0 and 5.5
    assert s["epilogue"] == dict(median_us=1.0, p90_us=1.0)
    # the loops' clocks: 1980 MHz over 8 us and 1500 over 5.5 (the third block has no "landed")
    assert s["loop_clock_mhz"]["median"] == pytest.approx(1980) and s["loop_clock_mhz"]["min"] == pytest.approx(1500)
    assert s["blocks_per_sm"] == dict(min=0, max=2)
    assert s["sm_idle_frac"] == dict(median=0.2, max=1.0)
    line = sweep.trace_line(1024, "gate_up", "wgmma:tile=256", s)
    assert "3 blocks on 2 SMs (0-2 each), span 20.0 us" in line and "SM idle 20.0% (max 100.0%)" in line
    assert "loop at 1980 MHz (min 1500)" in line
    with pytest.raises(ValueError, match="W4_TRACE"):
        sweep.trace_summary([[0] * 12], sms=1)


def test_wgmma_trace_builds_the_probes_and_passes_their_buffer_before_the_tensor_map(monkeypatch):
    """The host side on CPU: ``wgmma_trace`` compiles with W4_TRACE, allocates 12 zeroed words a
    block of the launch's grid and passes them after the LoRA arguments and before the
    activation's tensor map (the kernel's parameter order); without it, no buffer."""
    import torch

    from quarl.quant.kernels import cuda_w4
    from quarl.quant.kernels.config import WgConfig
    from quarl.quant.qweight import quantize_weight

    built, launched = [], []
    monkeypatch.setattr(cuda_w4, "_wgmma_kernel", lambda *a: built.append(a) or "kernel")
    monkeypatch.setattr(cuda_w4, "launch", lambda kern, grid, block, args, smem: launched.append((grid, args)))
    monkeypatch.setattr(cuda_w4, "num_sms", lambda dev: 132)
    monkeypatch.setattr(cuda_w4, "x_tensor_map", lambda x, rows: "tmap")
    qw = quantize_weight(torch.randn(1024, 512) * 0.02, "w4a16")
    x = torch.randn(300, 512, dtype=torch.bfloat16)
    cfg = WgConfig(2, 3, 1.0, tail=True, prescale=True, tile=256, tma=True, producer=True)
    out, tr, grid = cuda_w4.wgmma_trace(x, qw, None, cfg)
    assert out.shape == (300, 1024) and "W4_TRACE" in built[-1][8]
    (g, args), = launched
    assert g == grid and grid[1] == 2 and tr.shape == (grid[0] * grid[1], 12) and tr.dtype == torch.int64
    assert not tr.any() and args[-2] is tr and args[-1] == "tmap"
    cuda_w4.wgmma_gemm(x, qw, None, cfg)
    assert "W4_TRACE" not in built[-1][8] and launched[-1][1][-1] == "tmap"
    assert not any(isinstance(a, torch.Tensor) and a.dtype == torch.int64 for a in launched[-1][1])
