"""quarl.bench.gemm: the GEMM benchmark's bookkeeping (shapes, per-layer sums, targets): pure functions, CPU."""

from __future__ import annotations

import math

import pytest

from quarl.bench.gemm import MODELS, check_targets, layer_speedups, linear_shapes


def test_shape_sets_of_qwen_7b():
    shapes = {s.label: s for s in linear_shapes(MODELS["qwen2.5-7b"])}
    assert (shapes["qkv_proj (fused)"].n, shapes["qkv_proj (fused)"].k) == (3584 + 2 * 512, 3584)
    assert (shapes["gate_up_proj (fused)"].n, shapes["gate_up_proj (fused)"].k) == (2 * 18944, 3584)
    # every decoder-layer linear counted once per set: 7 modules, 4 engine GEMMs
    assert sum(s.counts.get("modules", 0) for s in shapes.values()) == 7
    assert sum(s.counts.get("engine", 0) for s in shapes.values()) == 4
    # weights per layer agree between the sets
    per_set = {st: sum(s.n * s.k * s.counts.get(st, 0) for s in shapes.values()) for st in ("modules", "engine")}
    assert per_set["modules"] == per_set["engine"]
    only = linear_shapes(MODELS["qwen2.5-7b"], ("modules",))
    assert all("fused" not in s.label for s in only) and len(only) == 4


def _rows():
    rows = []
    # two shapes: A (modules x2), B (engine x1); bf16 2 ms / 4 ms, w4a16 1 ms / 1 ms
    for label, counts, base in (("A", {"modules": 2}, 2.0), ("B", {"engine": 1}, 4.0)):
        for m in (1, 64):
            rows.append(dict(model="qwen2.5-7b", layer=label, counts=counts, M=m, format="bf16", ms=base, speedup=1.0))
            rows.append(dict(model="qwen2.5-7b", layer=label, counts=counts, M=m, format="w4a16", ms=1.0, speedup=base))
    return rows


def test_layer_speedups_and_targets_per_shape_set():
    rows = _rows()
    mod = {(r["M"], r["format"]): r for r in layer_speedups(rows, "modules")}
    assert mod[(1, "bf16")]["layer_ms"] == 4.0 and mod[(1, "w4a16")]["layer_ms"] == 2.0
    assert mod[(1, "w4a16")]["speedup"] == 2.0
    eng = {(r["M"], r["format"]): r for r in layer_speedups(rows, "engine")}
    assert eng[(64, "w4a16")]["speedup"] == 4.0
    t_mod = {t["where"]: t for t in check_targets(rows, shape_set="modules")}
    t_eng = {t["where"]: t for t in check_targets(rows, shape_set="engine")}
    assert math.isclose(t_mod["M<=16"]["geomean"], 2.0) and not t_mod["M<=16"]["met_geomean"]  # target 2.5x
    assert math.isclose(t_eng["M<=16"]["geomean"], 4.0) and t_eng["M<=16"]["met_all"]
    assert t_eng["M=64"]["min_at"] == "B M=64"


def test_engine_split_times_fused_input_gemms_apart():
    from quarl.bench.gemm import engine_split

    both = {"modules": 1, "engine": 1}
    # down_proj: the engine's SiLU-and-mul quantizes its input, a module's QuantLinear launches the quantizer
    assert engine_split("down_proj", both, "w8a8-fp8") == ({"modules": 1}, {"engine": 1})
    assert engine_split("gate_up_proj (fused)", {"engine": 1}, "w8a8-int8") == ({}, {"engine": 1})
    # o_proj's input comes from attention: the quantizer launch stays; weight-only formats have none
    assert engine_split("o_proj", both, "w8a8-fp8") == (both, {})
    assert engine_split("down_proj", both, "w4a16") == (both, {})
    assert engine_split("down_proj", both, "bf16") == (both, {})


def test_format_table_lists_engine_rows_apart():
    from quarl.bench.gemm import format_table

    def row(fmt, ms, **kw):
        return dict(model="m", layer="down_proj", counts={"modules": 1}, M=256, format=fmt, ms=ms, speedup=2.0 / ms,
                    floor_frac=0.5, **kw)

    result = dict(device="d", date="t", git_commit="c" * 10, formats=["bf16", "w8a8-fp8"], targets=[],
                  ceilings=dict(bandwidth=1e12, bf16_flops=1e15, fp8_flops=2e15),
                  rows=[row("bf16", 2.0), row("w8a8-fp8", 1.6),
                        row("w8a8-fp8", 1.0, input="quantized by the fused silu_mul", producer_extra_ms=-0.001)])
    text = format_table(result)
    assert " 1.25x/0.50" in text  # the standalone row in the main table
    assert "2.00x (fused quantizer -1.0 us; input quantized by the fused silu_mul)" in text


def test_summarize_counts_engine_rows():
    """A W8A8 format's engine-set layer time and targets come from its engine rows (GEMM on
    fused-quantizer input), not from its standalone rows that the engine never runs."""
    from quarl.bench.gemm import summarize

    def row(layer, counts, fmt, ms, **kw):
        return dict(model="qwen2.5-7b", layer=layer, counts=counts, M=256, format=fmt, ms=ms, speedup=0.0, **kw)

    rows = [row("o", {"modules": 1, "engine": 1}, "bf16", 1.0), row("o", {"modules": 1, "engine": 1}, "w8a8-fp8", 1.0),
            row("down", {"modules": 1, "engine": 1}, "bf16", 4.0), row("down", {"modules": 1}, "w8a8-fp8", 4.0),
            row("down", {"engine": 1}, "w8a8-fp8", 1.0, input="quantized by the fused silu_mul")]
    out = summarize(dict(rows=rows, shape_sets=["modules", "engine"]))
    sp = {(r["shapes"], r["format"]): r["speedup"] for r in out["layer_speedups"]}
    assert sp[("engine", "w8a8-fp8")] == 2.5 and sp[("modules", "w8a8-fp8")] == 1.0


def test_engine_rows_of_a_gated_mlp(monkeypatch):
    """Where the MLP runs the gated gate/up GEMM, its row is the gated GEMM + down's
    quantizer - the bf16 SiLU-and-mul + the RMSNorm quantizer's extra, and down's row is its
    GEMM alone; elsewhere each GEMM on codes carries its producer's extra."""
    from quarl.bench import gemm as bench

    cost = {"gemm": 5.0, "gated": 9.0, "silu": 2.0, "norm_extra": 0.5, "silu_extra": 3.0}
    monkeypatch.setattr(bench, "time_per_call", lambda calls, **kw: calls)
    monkeypatch.setattr(bench, "make_calls_quantized_input", lambda *a: cost["gemm"])
    monkeypatch.setattr(bench, "make_calls_gated", lambda *a: cost["gated"])
    monkeypatch.setattr(bench, "silu_mul_seconds", lambda *a: cost["silu"])
    monkeypatch.setattr(bench, "producer_extra_seconds",
                        lambda prod, *a: cost["norm_extra" if prod == "rmsnorm" else "silu_extra"])
    hidden, inter = 64, 160
    for gated in (True, False):
        monkeypatch.setattr(bench, "gated_mlp", lambda fmt, m, h, i: gated and (h, i) == (hidden, inter))
        extra = {}
        t_gu, note_gu = bench.engine_row_seconds("gate_up_proj (fused)", "w8a8-fp8", 64, 2 * inter, hidden, None, 0,
                                                 {}, extra)
        t_down, note_down = bench.engine_row_seconds("down_proj", "w8a8-fp8", 64, hidden, inter, None, 0, {}, extra)
        if gated:
            assert (t_gu, t_down) == (9.0 - 2.0 + 0.5, 5.0)
            assert "epilogue" in note_gu["input"] and note_down["producer_extra_ms"] == 0.0
        else:
            assert (t_gu, t_down) == (5.0 + 0.5, 5.0 + 3.0)
            assert note_down["input"] == "quantized by the fused silu_mul"


# ---------------------------------------------------------------------------------- MoE mode
def test_moe_shapes_and_methods():
    from quarl.bench.gemm_moe import MOE_MODELS, moe_methods, moe_shapes

    assert "qwen3-30b-a3b" in MOE_MODELS and "qwen2.5-7b" not in MOE_MODELS
    shapes = {s.label: s for s in moe_shapes("qwen3-30b-a3b")}
    assert tuple(shapes["gate_up_proj"]) == ("gate_up_proj", 128, 2 * 768, 2048)  # N = 2 I, K = H
    assert tuple(shapes["down_proj"]) == ("down_proj", 128, 2048, 768)  # N = H, K = I
    assert moe_methods("bf16") == ("grouped_mm",)
    assert moe_methods("w4a16") == moe_methods("w4a16-asym") == ("dequant", "kernel")
    assert moe_methods("w8a8-fp8") == moe_methods("w8a8-int8") == ("dequant", "kernel")
    assert moe_methods("w4a8-int8") == moe_methods("w2a16") == ("dequant",)
    with pytest.raises(ValueError, match="per-tensor"):
        moe_methods("nvfp4")
    with pytest.raises(ValueError, match="not an MoE preset"):
        moe_shapes("qwen2.5-7b")


def test_moe_floor_counts_every_experts_weight_once():
    from quarl.bench.gemm_moe import moe_floor_seconds
    from quarl.bench.timing import Ceilings

    ceil = Ceilings(bandwidth=3e12, bf16_flops=1e15, fp8_flops=2e15)
    e, n, k = 128, 1536, 2048
    # decode: bandwidth-bound; w4a16 stores 4 + 32 / 128 bits a weight
    t = 8
    want = (e * n * k * 4.25 / 8 + 2 * e * t * (k + n)) / 3e12
    assert math.isclose(moe_floor_seconds("w4a16", e, t, n, k, ceil), want)
    want16 = (e * n * k * 2 + 2 * e * t * (k + n)) / 3e12
    assert math.isclose(moe_floor_seconds("bf16", e, t, n, k, ceil), want16)
    # prefill: compute-bound at the bf16 rate (weight-only) or the fp8 rate (W8A8)
    t = 4096
    assert math.isclose(moe_floor_seconds("w4a16", e, t, n, k, ceil), 2 * e * t * n * k / 1e15)
    assert math.isclose(moe_floor_seconds("w8a8-fp8", e, t, n, k, ceil), 2 * e * t * n * k / 2e15)


def test_moe_calls_agree_on_the_cpu():
    """The three methods' closures (the kernel under the interpreter) compute one projection on
    the same operands, and the offsets give every expert t rows."""
    import torch

    from quarl.bench.gemm_moe import even_offsets, make_moe_calls, moe_shapes

    assert even_offsets(3, 4).tolist() == [4, 8, 12]
    shape = moe_shapes("moe-tiny")[1]  # down: N = H = 64, K = I = 32
    out = {m: make_moe_calls("w4a16" if m != "grouped_mm" else "bf16", m, shape, 2, torch.device("cpu"), 0)[0]()
           for m in ("grouped_mm", "dequant", "kernel")}
    assert out["kernel"].shape == (shape.e * 2, shape.n)
    scale = out["grouped_mm"].float().norm()
    assert float((out["kernel"].float() - out["dequant"].float()).norm() / scale) < 1e-2
    assert float((out["dequant"].float() - out["grouped_mm"].float()).norm() / scale) < 0.2  # int4 rounding


def test_moe_benchmark_rows_totals_and_table(monkeypatch):
    """run_moe_benchmark with the GPU parts replaced: per row the speedup over bf16's grouped
    GEMM and the floor fraction, per layer the sum of both projections, and the table."""
    import types

    import torch

    from quarl.bench import gemm_moe as bench
    from quarl.bench.timing import Ceilings

    ceil = Ceilings(bandwidth=1e12, bf16_flops=1e15, fp8_flops=2e15)
    cost = {"grouped_mm": 4e-3, "dequant": 5e-3, "kernel": 1e-3, "tile": 0.5e-3}
    monkeypatch.setattr(bench, "measure_ceilings", lambda *a: ceil)
    monkeypatch.setattr(bench, "make_moe_calls", lambda fmt, method, *a, tile=None: "tile" if tile else method)
    monkeypatch.setattr(bench, "time_per_call", lambda calls, **kw: cost[calls])
    monkeypatch.setattr(bench, "git_commit", lambda: "c" * 12)
    props = types.SimpleNamespace(name="gpu", L2_cache_size=1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    result = bench.run_moe_benchmark(["qwen3-30b-a3b"], [8], ["w4a16"], power=(None,), log=lambda s: None)
    rows = {(r["layer"], r["method"]): r for r in result["rows"]}
    assert len(rows) == 6 and result["formats"] == ["bf16", "w4a16"]
    k = rows[("gate_up_proj", "kernel")]
    assert (k["M"], k["N"], k["K"], k["E"]) == (128 * 8, 1536, 2048, 128)
    assert math.isclose(k["speedup"], 4.0) and math.isclose(rows[("down_proj", "dequant")]["speedup"], 0.8)
    assert math.isclose(k["floor_frac"], bench.moe_floor_seconds("w4a16", 128, 8, 1536, 2048, ceil) / 1e-3)
    totals = {(t["format"], t["method"]): t for t in result["layer_totals"]}
    assert math.isclose(totals[("w4a16", "kernel")]["layer_ms"], 2.0)
    assert math.isclose(totals[("w4a16", "kernel")]["speedup"], 4.0)
    text = bench.format_moe_table(result)
    assert "(MoE experts)" in text and "MoE layer (gate_up + down):" in text
    line = next(s for s in text.splitlines() if "gate_up_proj" in s and "kernel" in s)
    assert line.split()[-4:] == ["1000.0", "4.00x", f"{k['floor_ms'] * 1e3:.1f}", f"{k['floor_frac']:.2f}"]
    # --moe-tiles: every candidate tile of the kernel gets its own rows (and layer totals) next to these
    from quarl.quant.kernels.moe_gemm import TILE_CANDIDATES, tile_label

    tiled = bench.run_moe_benchmark(["qwen3-30b-a3b"], [8], ["w4a16"], power=(None,), log=lambda s: None, tiles=True)
    methods = {r["method"] for r in tiled["rows"]}
    assert methods == {"grouped_mm", "dequant", "kernel"} | {tile_label(c) for c in TILE_CANDIDATES}
    assert len(tiled["rows"]) == 2 * (3 + len(TILE_CANDIDATES))
    tile_row = next(r for r in tiled["rows"] if r["method"] == tile_label(TILE_CANDIDATES[1]))
    assert math.isclose(tile_row["speedup"], 8.0) and tile_label(TILE_CANDIDATES[1]).endswith("T")


@pytest.mark.parametrize("fmt", ["bf16", "w4a16", "w8a8-fp8"])
def test_exact_formats_time_the_invariant_gemm_of_the_same_product(fmt):
    """``--formats X+exact``: closures over exact mode's invariant GEMM (interpreter here) on the
    same operands as format X's ordinary ones; their products agree to the format's rounding,
    and the floor is the scheme's."""
    import torch

    from quarl.bench.gemm import floor_seconds, make_calls, scheme_of
    from quarl.bench.timing import Ceilings

    assert scheme_of(fmt + "+exact") == fmt
    m, n, k = 5, 64, 256
    plain = make_calls(fmt, m, n, k, torch.device("cpu"), l2=0)[0]()
    exact = make_calls(fmt + "+exact", m, n, k, torch.device("cpu"), l2=0)[0]()
    assert exact.shape == plain.shape == (m, n) and exact.dtype == torch.bfloat16
    rel = float((exact.float() - plain.float()).norm() / plain.float().norm())
    assert rel < (2e-2 if fmt == "w8a8-fp8" else 5e-3), rel
    ceil = Ceilings(bandwidth=1e12, bf16_flops=1e15, fp8_flops=2e15)
    assert floor_seconds(fmt + "+exact", m, n, k, ceil) == floor_seconds(fmt, m, n, k, ceil)


def test_exact_formats_are_refused_for_the_moe_benchmark():
    import argparse

    from quarl.cli.bench_gemm import _formats

    with pytest.raises(ValueError, match="without --moe"):
        _formats(argparse.Namespace(formats="bf16,w4a16+exact", moe="qwen3-30b-a3b"))
    assert _formats(argparse.Namespace(formats="bf16,w4a16+exact", moe=None)) == ["bf16", "w4a16+exact"]
    with pytest.raises(ValueError, match="unknown scheme"):
        _formats(argparse.Namespace(formats="nvfp4+exact", moe=None))
