"""A suite's results directory: its summary JSON and its page (markdown tables, PNG plots).

The directory (:func:`quarl.experiments.suite.collect`) holds ``suite.yaml``,
``meta.json``, ``base.json``, ``runs.json`` and ``runs/<name>/seed<k>/metrics.jsonl`` (and
``flagged.jsonl``, the run's error-token examples, where it had any).
:func:`summarize` reduces every run's series to the suite's table columns, per seed,
and over the seeds (mean, sample standard deviation, min, max); a ratio column divides
each seed's value by the baseline run's value of the same seed, so a seed's noise
shared by both runs cancels. :func:`render` writes ``summary.json``, ``README.md`` and
one PNG per plot.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from quarl import plots
from quarl.experiments.flagged import flagged_section
from quarl.experiments.spec import SUITE_FILE, Column, Plot, Suite, load_suite
from quarl.experiments.suite import steps_done

Series = list[tuple[int, float]]  # (step, value), in step order
fmt = plots.fmt_table


def read_series(metrics_file: Path) -> dict[str, Series]:
    """Every numeric metric of a ``metrics.jsonl`` as (step, value) pairs; nulls and
    non-finite values are left out (the logger writes NaN and inf as null)."""
    out: dict[str, Series] = {}
    for line in Path(metrics_file).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        step = int(row.get("step", 0))
        for k, v in row.items():
            if (k not in ("step", "wall") and isinstance(v, (int, float)) and not isinstance(v, bool)
                    and math.isfinite(v)):
                out.setdefault(k, []).append((step, float(v)))
    for s in out.values():
        s.sort(key=lambda p: p[0])
    return out


def reduce_series(series: Series, at: str, tail: int = 5) -> float | None:
    """One number from a series: its ``last`` / ``first`` value, its ``mean`` / ``max`` /
    ``min``, or the mean (``tail``) or median (``median``) of its last ``tail`` values; None
    for an empty series."""
    values = [v for _, v in series]
    if not values:
        return None
    if at == "last":
        return values[-1]
    if at == "first":
        return values[0]
    if at == "mean":
        return sum(values) / len(values)
    if at == "max":
        return max(values)
    if at == "min":
        return min(values)
    if at == "tail":
        last = values[-tail:]
        return sum(last) / len(last)
    if at == "median":
        return statistics.median(values[-tail:])
    raise ValueError(f"unknown reduction {at!r}")


def without_steps(series: dict[str, Series], metric: str, without: str | None) -> Series:
    """``metric``'s series less the steps where ``without``'s value is nonzero (all of it
    without ``without``, or where the run never logged it)."""
    kept = series.get(metric, [])
    if without is None:
        return kept
    dropped = {step for step, v in series.get(without, []) if v != 0}
    return [(step, v) for step, v in kept if step not in dropped]


def spread(values: list[float]) -> dict[str, float | int | None]:
    """mean, sample standard deviation (0 for one value), min, max and count."""
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": sum(values) / len(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def run_progress(run_dir: Path) -> tuple[int, int | None]:
    """(the last step a run logged, the steps its config.yaml asks for; None if it has none)."""
    import yaml

    last = steps_done(run_dir)
    cfg = run_dir / "config.yaml"
    steps = (yaml.safe_load(cfg.read_text()) or {}).get("trainer", {}).get("steps") if cfg.is_file() else None
    return last, steps


def load_runs(out: Path, names: list[str], seeds: list[int], incomplete: list[str] | None = None
              ) -> dict[str, dict[int, dict[str, Series]]]:
    """run name -> seed -> metric -> series, for the runs whose metrics exist and that ran
    all their steps (a run cut short would mix an earlier step into "last"); those cut
    short are named in ``incomplete`` ("name seed k (step i of n)")."""
    runs: dict[str, dict[int, dict[str, Series]]] = {}
    for name in names:
        for seed in seeds:
            d = out / "runs" / name / f"seed{seed}"
            if not (d / "metrics.jsonl").is_file():
                continue
            last, steps = run_progress(d)
            if steps is not None and last < steps:
                if incomplete is not None:
                    incomplete.append(f"{name} seed {seed} (step {last} of {steps})")
                continue
            runs.setdefault(name, {})[seed] = read_series(d / "metrics.jsonl")
    return runs


def column_values(col: Column, runs: dict[str, dict[int, dict[str, Series]]], name: str,
                  baseline: str | None) -> dict[int, float]:
    """seed -> the column's value for run ``name`` (seeds where it, or the baseline a ratio
    needs, has no value are left out)."""
    values = {}
    for seed, series in runs.get(name, {}).items():
        v = reduce_series(without_steps(series, col.metric, col.without), col.at, col.tail)
        if v is None:
            continue
        if col.ratio:
            base = reduce_series(without_steps(runs.get(baseline, {}).get(seed, {}), col.metric, col.without),
                                 col.at, col.tail)
            if base is None or base == 0:
                continue
            v = v / base
        values[seed] = v
    return values


def summarize(suite: Suite, out: Path, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The summary of a results directory (also written to ``out/summary.json``)."""
    meta = meta if meta is not None else _read_json(out / "meta.json") or {}
    incomplete: list[str] = []
    runs = load_runs(out, list(suite.runs), suite.seeds, incomplete)
    table = {}
    for name in suite.runs:
        row = {}
        for col in suite.table:
            per_seed = column_values(col, runs, name, suite.baseline)
            row[col.name] = {"seeds": {str(k): v for k, v in per_seed.items()}, **spread(list(per_seed.values()))}
        table[name] = row
    status = _read_json(out / "runs.json") or []
    summary = {
        "suite": suite.name, "title": suite.title, "device": meta.get("device"), "date": meta.get("date"),
        "git_commit": meta.get("git_commit"), "seeds": suite.seeds, "baseline": suite.baseline,
        "columns": [{"name": c.name, "metric": c.metric, "at": c.at, "ratio": c.ratio, "tail": c.tail,
                     "without": c.without}
                    for c in suite.table],
        "base": _read_json(out / "base.json"), "runs": table,
        "failed": [r for r in status if r.get("status") == "failed"],
        "incomplete": incomplete,
        "missing": [f"{n} seed {s}" for n in suite.runs for s in suite.seeds if s not in runs.get(n, {})
                    and not any(i.startswith(f"{n} seed {s} ") for i in incomplete)],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _read_json(f: Path) -> Any:
    return json.loads(f.read_text()) if f.is_file() else None


def cell(s: dict[str, Any], seeds: int) -> str:
    if not s["n"]:
        return "-"
    text = fmt(s["mean"]) + (f" ± {fmt(s['std'])}" if s["n"] > 1 else "")
    return text + (f" (n={s['n']})" if s["n"] < seeds else "")


def markdown_table(summary: dict[str, Any]) -> str:
    cols = [c["name"] for c in summary["columns"]]
    lines = ["| run | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, row in summary["runs"].items():
        lines.append(f"| {name} | " + " | ".join(cell(row[c], len(summary["seeds"])) for c in cols) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- plots


def mean_curve(per_seed: list[Series]) -> tuple[list[int], list[float], list[float], list[float]]:
    """steps, mean, min and max over the seeds that logged each step."""
    at: dict[int, list[float]] = {}
    for series in per_seed:
        for step, v in series:
            at.setdefault(step, []).append(v)
    steps = sorted(at)
    return (steps, [sum(at[s]) / len(at[s]) for s in steps], [min(at[s]) for s in steps],
            [max(at[s]) for s in steps])


def plot_lines(plot: Plot, runs: dict[str, dict[int, dict[str, Series]]], path: Path) -> bool:
    metrics = [m for m in plot.metrics if any(m in s for r in runs.values() for s in r.values())]
    if not metrics:
        return False
    fig, axes = plots.figure(len(metrics), plot.title, max_cols=3, panel=(4.6, 3.3))
    for ax, metric in zip(axes, metrics):
        positive = True
        for i, (name, seeds) in enumerate(runs.items()):
            curves = [s[metric] for s in seeds.values() if metric in s]
            if not curves:
                continue
            steps, mean, lo, hi = mean_curve(curves)
            positive = positive and min(lo) > 0
            color = plots.color(i)
            ax.plot(steps, mean, color=color, label=name, lw=1.4, marker="o" if len(steps) < 12 else None, ms=3)
            if len(curves) > 1:
                ax.fill_between(steps, lo, hi, color=color, alpha=0.15, lw=0)
        ax.set_title(metric, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        if plot.log and positive:
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    plots.save_png(fig, path)
    return True


def plot_bars(plot: Plot, runs: dict[str, dict[int, dict[str, Series]]], path: Path) -> bool:
    names = list(runs)
    if not names:
        return False
    fig, axes = plots.figure(1, plot.title, max_cols=3, panel=(4.6, 3.3))
    ax = axes[0]
    width = 0.8 / len(names)
    drawn = False
    for i, name in enumerate(names):
        means, lo, hi = [], [], []
        for metric in plot.metrics:
            vals = [v for s in runs[name].values()
                    if (v := reduce_series(without_steps(s, metric, plot.without), plot.at, plot.tail)) is not None]
            m = sum(vals) / len(vals) if vals else float("nan")
            means.append(m)
            lo.append(m - min(vals) if vals else 0.0)
            hi.append(max(vals) - m if vals else 0.0)
            drawn = drawn or bool(vals)
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(plot.metrics))]
        ax.bar(xs, means, width, yerr=[lo, hi], capsize=2, color=plots.color(i), label=name)
    if not drawn:
        return False
    ax.set_xticks(range(len(plot.metrics)))
    ax.set_xticklabels(plot.metrics, fontsize=7, rotation=15)
    ax.tick_params(labelsize=7)
    if plot.log:
        ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=2)
    plots.save_png(fig, path)
    return True


def phase_table(runs: dict[str, Any], status: list[dict[str, Any]]) -> str:
    """A markdown table of each run's mean start / steps / end seconds ("" when none was timed)."""
    rows = []
    for name in runs:
        timed = [r["phases"] for r in status if r.get("name") == name and r.get("status") == "done" and r.get("phases")]
        if timed:
            mean = {k: sum(p[k] for p in timed) / len(timed) for k in ("start", "steps", "end")}
            rows.append(f"| {name} | {mean['start']:.0f} | {mean['steps']:.0f} | {mean['end']:.0f} | {len(timed)} |")
    if not rows:
        return ""
    return "\n".join(["| run | start | steps | end | seeds |", "|---|---|---|---|---|", *rows])


def _slug(title: str) -> str:
    s = "".join(c.lower() if c.isalnum() else "-" for c in title)
    return "-".join(p for p in s.split("-") if p)[:60] or "plot"


# ---------------------------------------------------------------------- the page


def render(out: str | Path, suite_dir: str | Path | None = None) -> Path:
    """Summarise the results directory ``out`` and write its page ``out/README.md`` with its
    plots; the suite's spec is ``out/suite.yaml`` (the copy taken when it ran) unless
    ``suite_dir`` names another. Returns the page's path."""
    out = Path(out)
    meta = _read_json(out / "meta.json")
    if meta is None:
        raise ValueError(f"{out} has no meta.json: is it the results directory of a suite (quarl suite run)?")
    suite = load_suite(suite_dir, None) if suite_dir else load_suite(out, meta.get("runs") or [])
    suite.seeds = meta.get("seeds") or suite.seeds
    suite.name = meta.get("suite") or suite.name
    summary = summarize(suite, out, meta)
    runs = load_runs(out, list(suite.runs), suite.seeds)
    lines = [f"# {suite.title}", ""]
    if suite.about:
        lines += [suite.about, ""]
    lines += [_setup_line(summary, meta), ""]
    if suite.table:
        lines += ["Values: mean ± sample standard deviation over the seeds (each seed's value, min and max in "
                  "[summary.json](summary.json)); a ratio column divides each seed's value by the baseline "
                  f"run's (`{suite.baseline}`) of the same seed.", "", markdown_table(summary), ""]
    timing = phase_table(summary["runs"], _read_json(out / "runs.json") or [])
    if timing:
        lines += ["Where a run's wall time went (seconds, mean over its finished seeds; start: launch to the "
                  "first logged row, steps: first row to last, end: last row to exit):", "", timing, ""]
    for plot in suite.plots:
        name = _slug(plot.title) + ".png"
        drawn = (plot_bars if plot.kind == "bars" else plot_lines)(plot, runs, out / name)
        if drawn:
            lines += [f"![{plot.title}]({name})", ""]
    lines += flagged_section(out, list(suite.runs), suite.seeds)
    if summary["failed"]:
        lines += ["Failed runs:", ""]
        for r in summary["failed"]:
            tail = r.get("tail", "").strip().splitlines()[-1:] or [""]
            lines.append(f"- {r['name']} seed {r['seed']}: {tail[0]}")
        lines.append("")
    if summary["incomplete"]:
        lines += [f"Cut short (left out of the table and plots; its metrics are under runs/): "
                  f"{', '.join(summary['incomplete'])}.", ""]
    if summary["missing"]:
        lines += [f"Not run (or no metrics): {', '.join(summary['missing'])}.", ""]
    lines += [f"Run configs: `experiments/{suite.name}/`; every run's metrics: [runs/](runs/). "
              f"Rendered by `quarl suite report {out}`.", ""]
    page = out / "README.md"
    page.write_text("\n".join(lines))
    return page


def _setup_line(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    commit = (summary.get("git_commit") or "unknown")[:7]
    date = (summary.get("date") or "")[:10]
    text = (f"Measured on {summary.get('device')} at {commit} ({date}); seeds {', '.join(map(str, summary['seeds']))}; "
            f"{len(summary['runs'])} configurations.")
    calls = meta.get("calls") or []
    if len(calls) > 1:
        parts = [f"{c['date'][:16]} at {(c.get('git_commit') or '?')[:7]} (seeds {', '.join(map(str, c['seeds']))}, "
                 f"{len(c['runs'])} runs, base {c.get('base_sha256') or '?'})" for c in calls]
        digests = {c.get("base_sha256") for c in calls}
        text += (f" Run in {len(calls)} calls: {'; '.join(parts)}; "
                 + ("the same base weights in each." if len(digests) == 1 and None not in digests else
                    "**the base weights differ between calls** (rebuilt on each machine; each call's digest and "
                    "base accuracy are in meta.json)."))
    base = summary.get("base")
    if base:
        acc = (base.get("eval") or {}).get("eval/acc")
        text += (f" Base model: {base.get('steps')} supervised warm-start steps (loss {fmt(base.get('loss_first'))} -> "
                 f"{fmt(base.get('loss_last'))}, {base.get('warmstart_s')} s), held-out accuracy {fmt(acc)} "
                 "(bf16, greedy).")
    return text


__all__ = ["read_series", "reduce_series", "without_steps", "spread", "summarize", "render", "markdown_table",
           "SUITE_FILE"]
