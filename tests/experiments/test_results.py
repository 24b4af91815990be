"""A suite's results: series read from metrics.jsonl, reduced, summarised over seeds, rendered."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from quarl.experiments.results import (
    _slug,
    cell,
    column_values,
    fmt,
    markdown_table,
    mean_curve,
    read_series,
    reduce_series,
    render,
    spread,
    summarize,
    without_steps,
)
from quarl.experiments.suite import Column, load_suite

# max (9) is neither the first nor the last value, min (1) neither: every reduction differs
SERIES = [(1, 3.0), (2, 9.0), (3, 1.0), (4, 5.0)]


@pytest.mark.parametrize("at, expected", [
    ("last", 5.0), ("first", 3.0), ("mean", 4.5), ("max", 9.0), ("min", 1.0), ("tail", 3.0),  # (1 + 5) / 2
])
def test_reduce_series_every_reduction(at, expected):
    assert reduce_series(SERIES, at, tail=2) == expected


def test_reduce_series_tail_longer_than_the_series_and_empty_and_unknown():
    assert reduce_series(SERIES, "tail", tail=10) == 4.5  # all four values
    assert reduce_series(SERIES, "tail", tail=1) == 5.0
    assert reduce_series(SERIES, "tail") == 4.5  # default tail 5 > 4 values
    for at in ("last", "first", "mean", "max", "min", "tail", "median"):
        assert reduce_series([], at, tail=2) is None
    with pytest.raises(ValueError, match="p90"):
        reduce_series(SERIES, "p90")


def test_reduce_series_median_of_the_tail_ignores_one_slow_step():
    """A timing series with a slow last step (a recompile): the median of the last 4 is the
    middle of 9, 1, 5, 100 ((5 + 9) / 2), where their mean is pulled to 28.75."""
    timed = [*SERIES, (5, 100.0)]
    assert reduce_series(timed, "median", tail=4) == 7.0
    assert reduce_series(timed, "tail", tail=4) == 28.75
    assert reduce_series(timed, "median", tail=1) == 100.0
    assert reduce_series(timed, "median", tail=10) == 5.0  # all five: 1, 3, 5, 9, 100


def test_without_leaves_out_the_steps_that_compiled_in_the_run_and_its_baseline():
    """Step times with compiles at steps 1 and 4 (x) and 1 and 3 (the baseline): each run's
    median over its own steps that compiled nothing, then the ratio of the two medians."""
    x = {"time/step": [(1, 30.0), (2, 2.0), (3, 4.0), (4, 11.0), (5, 3.0)],
         "perf/compiles": [(1, 3.0), (2, 0.0), (3, 0.0), (4, 1.0), (5, 0.0)]}
    base = {"time/step": [(1, 20.0), (2, 1.0), (3, 9.0), (4, 2.0), (5, 4.0)],
            "perf/compiles": [(1, 3.0), (2, 0.0), (3, 1.0), (4, 0.0), (5, 0.0)]}
    assert without_steps(x, "time/step", "perf/compiles") == [(2, 2.0), (3, 4.0), (5, 3.0)]
    assert without_steps(x, "time/step", None) == x["time/step"]
    assert without_steps({"time/step": x["time/step"]}, "time/step", "perf/compiles") == x["time/step"]  # never logged
    runs = {"x": {0: x}, "base": {0: base}}
    col = Column("time/step", "median", tail=4, without="perf/compiles")
    assert column_values(col, runs, "x", "base") == {0: 3.0}  # the median of 2, 4, 3
    ratio = Column("time/step", "median", tail=4, ratio=True, without="perf/compiles")
    assert column_values(ratio, runs, "x", "base") == {0: pytest.approx(3.0 / 2.0)}  # base: 1, 2, 4 -> 2
    assert column_values(Column("time/step", "median", tail=4), runs, "x", "base") == {0: 3.5}  # 2, 4, 11, 3
    assert col.name == "time/step (median of last 4 where perf/compiles = 0)"


def test_spread_sample_std_by_hand():
    s = spread([2.0, 4.0, 9.0])
    # mean 5; squared deviations 9 + 1 + 16 = 26; sample variance 26 / (3 - 1) = 13
    assert s["mean"] == pytest.approx(5.0)
    assert s["std"] == pytest.approx(math.sqrt(13.0))
    assert (s["min"], s["max"], s["n"]) == (2.0, 9.0, 3)
    one = spread([7.5])
    assert one == {"mean": 7.5, "std": 0.0, "min": 7.5, "max": 7.5, "n": 1}
    assert spread([]) == {"mean": None, "std": None, "min": None, "max": None, "n": 0}


def _runs():
    """run -> seed -> metric -> series; the baseline's value differs per seed so a wrong pairing shows."""
    return {
        "base": {0: {"m": [(1, 2.0), (2, 4.0)]},  # last 4
                 1: {"m": [(1, 10.0)]},            # last 10
                 2: {"m": [(1, 0.0)]}},            # last 0: no ratio for seed 2
        "x": {0: {"m": [(1, 1.0), (2, 8.0)]},      # last 8 -> 8 / 4 = 2
              1: {"m": [(1, 5.0)]},                # last 5 -> 5 / 10 = 0.5
              2: {"m": [(1, 3.0)]},                # baseline zero
              3: {"m": [(1, 7.0)]},                # baseline has no seed 3
              4: {"other": [(1, 1.0)]}},           # no value of its own
    }


def test_column_values_plain_and_ratio_pair_the_same_seed():
    runs = _runs()
    plain = column_values(Column("m", "last"), runs, "x", "base")
    assert plain == {0: 8.0, 1: 5.0, 2: 3.0, 3: 7.0}
    ratio = column_values(Column("m", "last", ratio=True), runs, "x", "base")
    assert ratio == {0: 2.0, 1: 0.5}  # a cross-seed pairing would give 0.8 or 1.25
    assert column_values(Column("m", "last", ratio=True), runs, "base", "base") == {0: 1.0, 1: 1.0}
    # the reduction applies to both sides: first of x seed 0 is 1, first of base seed 0 is 2
    assert column_values(Column("m", "first", ratio=True), runs, "x", "base")[0] == 0.5
    assert column_values(Column("m", "last"), runs, "nonexistent", "base") == {}


def test_read_series_skips_nulls_non_finite_booleans_and_sorts_by_step(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text("\n".join([
        '{"step": 2, "a": 1.5, "b": null, "flag": true, "name": "x"}',
        '{"step": 0, "a": 0.5, "c": 4}',
        "",
        '{"step": 1, "a": NaN, "b": 3, "d": Infinity, "flag": false}',
        '{"step": 3, "a": -Infinity, "c": 6}',
    ]) + "\n")
    series = read_series(f)
    assert series == {"a": [(0, 0.5), (2, 1.5)], "b": [(1, 3.0)], "c": [(0, 4.0), (3, 6.0)]}
    assert all(isinstance(v, float) for s in series.values() for _, v in s)


@pytest.mark.parametrize("value, text", [
    (None, "-"), (0, "0"), (0.0, "0"), (0.5, "0.5"), (-0.5, "-0.5"), (0.12345, "0.123"), (12.345, "12.3"),
    (0.01, "0.01"), (0.001234, "1.23e-03"), (-0.001234, "-1.23e-03"), (123.4, "123"), (9999.4, "9999"),
    (12345.0, "1.23e+04"), (1.0, "1"),
])
def test_fmt(value, text):
    assert fmt(value) == text


def test_cell_marks_missing_seeds_and_hides_std_of_one():
    assert cell(spread([0.25, 0.5, 0.75]), 3) == "0.5 ± 0.25"
    assert cell(spread([2.0, 4.0]), 3) == "3 ± 1.41 (n=2)"  # std sqrt(2)
    assert cell(spread([1.5]), 3) == "1.5 (n=1)"
    assert cell(spread([1.5]), 1) == "1.5"
    assert cell(spread([]), 3) == "-"


def test_markdown_table_rows():
    summary = {
        "seeds": [0, 1, 2],
        "columns": [{"name": "acc (last)"}, {"name": "t (mean / baseline)"}],
        "runs": {
            "bf16": {"acc (last)": spread([0.25, 0.5, 0.75]), "t (mean / baseline)": spread([1.0, 1.0, 1.0])},
            "w4": {"acc (last)": spread([0.125]), "t (mean / baseline)": spread([])},
        },
    }
    assert markdown_table(summary).splitlines() == [
        "| run | acc (last) | t (mean / baseline) |",
        "|---|---|---|",
        "| bf16 | 0.5 ± 0.25 | 1 ± 0 |",
        "| w4 | 0.125 (n=1) | - |",
    ]


def test_column_names():
    assert Column("eval/acc").name == "eval/acc (last)"
    assert Column("time/step", "mean", ratio=True).name == "time/step (mean / baseline)"
    assert Column("time/step", "mean", ratio=True, label="speed").name == "speed"


def test_mean_curve_over_the_seeds_that_logged_each_step():
    steps, mean, lo, hi = mean_curve([[(0, 1.0), (1, 3.0)], [(1, 5.0), (2, 7.0)]])
    assert (steps, mean, lo, hi) == ([0, 1, 2], [1.0, 4.0, 7.0], [1.0, 3.0, 7.0], [1.0, 5.0, 7.0])


def test_slug():
    assert _slug("Reward and accuracy") == "reward-and-accuracy"
    assert _slug("KL (k3) / step!") == "kl-k3-step"
    assert _slug("!!!") == "plot"


def _metrics(path, rows):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def results_dir(tmp_path):
    """A results directory as collect() leaves it, written by hand: runs a (seeds 0, 1) and b (seed 0;
    seed 1 failed), no training."""
    out = tmp_path / "out"
    out.mkdir()
    spec = {
        "title": "Hand-made", "about": "What it shows.", "base": "../base.yaml", "seeds": [0, 1],
        "common": ["../missing-elsewhere.yaml"],  # a results directory's copy: files are not needed
        "baseline": "a",
        "table": [{"metric": "acc", "at": "last"}, {"metric": "t", "at": "mean", "ratio": True},
                  {"metric": "loss", "at": "tail", "tail": 2}],
        "plots": [{"title": "Curves", "metrics": ["acc", "loss"]},
                  {"title": "Bars", "metrics": ["t"], "kind": "bars"},
                  {"title": "Never logged", "metrics": ["nothing/here"]}],
    }
    (out / "suite.yaml").write_text(yaml.safe_dump(spec))
    (out / "meta.json").write_text(json.dumps({"suite": "hand", "git_commit": "abcdef0123",
                                               "date": "2025-01-02T03:04:05",
                                               "device": "cpu", "seeds": [0, 1], "runs": ["a", "b"]}))
    (out / "runs.json").write_text(json.dumps([
        {"name": "a", "seed": 0, "status": "done"}, {"name": "a", "seed": 1, "status": "done"},
        {"name": "b", "seed": 0, "status": "done"},
        {"name": "b", "seed": 1, "status": "failed", "tail": "step 1\nRuntimeError: boom"}]))
    (out / "base.json").write_text(json.dumps({"eval": {"eval/acc": 0.25}, "steps": 50, "loss_first": 4.0,
                                               "loss_last": 0.5, "warmstart_s": 1.5}))
    _metrics(out / "runs/a/seed0", [{"step": 0, "acc": 0.1}, {"step": 1, "t": 2.0, "loss": 3.0},
                                    {"step": 2, "t": 4.0, "loss": 1.0, "acc": 0.5}])
    _metrics(out / "runs/a/seed1", [{"step": 1, "t": 5.0, "loss": 2.0, "acc": 0.25},
                                    {"step": 2, "t": 5.0, "loss": 2.0, "acc": 0.75}])
    _metrics(out / "runs/b/seed0", [{"step": 1, "t": 6.0, "loss": 0.5}, {"step": 2, "t": 3.0, "loss": 1.5,
                                                                         "acc": 0.125}])
    return out


def test_summarize_a_results_directory(results_dir):
    suite = load_suite(results_dir, ["a", "b"])
    summary = summarize(suite, results_dir)
    assert json.loads((results_dir / "summary.json").read_text()) == summary
    assert [c["name"] for c in summary["columns"]] == ["acc (last)", "t (mean / baseline)", "loss (last 2)"]
    a, b = summary["runs"]["a"], summary["runs"]["b"]
    assert a["acc (last)"]["seeds"] == {"0": 0.5, "1": 0.75}
    assert a["acc (last)"]["mean"] == pytest.approx(0.625)
    assert a["acc (last)"]["std"] == pytest.approx(math.sqrt(0.125 ** 2 * 2))  # deviations +-0.125
    assert a["t (mean / baseline)"]["seeds"] == {"0": 1.0, "1": 1.0}
    assert b["t (mean / baseline)"]["seeds"] == {"0": 1.5}  # mean 4.5 / a's seed-0 mean 3
    assert b["t (mean / baseline)"]["std"] == 0.0 and b["t (mean / baseline)"]["n"] == 1
    assert a["loss (last 2)"]["seeds"] == {"0": 2.0, "1": 2.0} and b["loss (last 2)"]["seeds"] == {"0": 1.0}
    assert summary["missing"] == ["b seed 1"]
    assert [(r["name"], r["seed"]) for r in summary["failed"]] == [("b", 1)]
    assert summary["base"]["eval"]["eval/acc"] == 0.25
    assert (summary["device"], summary["git_commit"], summary["baseline"]) == ("cpu", "abcdef0123", "a")


def test_render_writes_the_page_and_its_plots(results_dir):
    page = render(results_dir)
    assert page == results_dir / "README.md"
    text = page.read_text()
    assert text.startswith("# Hand-made\n\nWhat it shows.\n")
    assert "Measured on cpu at abcdef0 (2025-01-02); seeds 0, 1; 2 configurations." in text
    assert "Base model: 50 supervised warm-start steps (loss 4 -> 0.5, 1.5 s), held-out accuracy 0.25" in text
    assert "| run | acc (last) | t (mean / baseline) | loss (last 2) |" in text
    assert "| a | 0.625 ± 0.177 | 1 ± 0 | 2 ± 0 |" in text
    assert "| b | 0.125 (n=1) | 1.5 (n=1) | 1 (n=1) |" in text
    assert "![Curves](curves.png)" in text and "![Bars](bars.png)" in text
    assert (results_dir / "curves.png").stat().st_size > 0 and (results_dir / "bars.png").stat().st_size > 0
    assert "never-logged" not in text and not (results_dir / "never-logged.png").exists()
    assert "- b seed 1: RuntimeError: boom" in text
    assert "Not run (or no metrics): b seed 1." in text
    assert f"quarl suite report {results_dir}" in text
    assert (results_dir / "summary.json").is_file()


def test_render_refuses_a_directory_without_meta(tmp_path):
    with pytest.raises(ValueError, match="no meta.json"):
        render(tmp_path)


def test_a_run_cut_short_is_left_out_and_named(results_dir):
    # a run's config asks for 3 steps but it logged 2: "last" would read an earlier step
    (results_dir / "runs/a/seed1/config.yaml").write_text(yaml.safe_dump({"trainer": {"steps": 3}}))
    (results_dir / "runs/a/seed0/config.yaml").write_text(yaml.safe_dump({"trainer": {"steps": 2}}))
    suite = load_suite(results_dir, ["a", "b"])
    summary = summarize(suite, results_dir)
    assert summary["incomplete"] == ["a seed 1 (step 2 of 3)"]
    assert "a seed 1" not in " ".join(summary["missing"])
    assert summary["runs"]["a"]["acc (last)"]["seeds"] == {"0": 0.5}  # seed 1 (0.75) is out
    page = render(results_dir).read_text()
    assert "Cut short" in page and "a seed 1 (step 2 of 3)" in page


def test_phase_table_averages_the_finished_seeds():
    from quarl.experiments.results import phase_table

    status = [{"name": "a", "seed": 0, "status": "done", "phases": {"start": 10.0, "steps": 100.0, "end": 4.0}},
              {"name": "a", "seed": 1, "status": "done", "phases": {"start": 20.0, "steps": 110.0, "end": 6.0}},
              {"name": "a", "seed": 2, "status": "failed", "phases": {"start": 99.0, "steps": 1.0, "end": 1.0}},
              {"name": "b", "seed": 0, "status": "done", "phases": None}]
    assert phase_table({"a": {}, "b": {}}, status).splitlines() == [
        "| run | start | steps | end | seeds |", "|---|---|---|---|---|", "| a | 15 | 105 | 5 | 2 |"]
    assert phase_table({"b": {}}, status) == ""
