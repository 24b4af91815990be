"""A static HTML report of one run, or of several runs overlaid for comparison.

``render_report([RUN_DIR, ...])`` reads each run's ``metrics.jsonl`` (docs/design.md metric
names), ``samples.jsonl`` and ``config.yaml`` and writes:

* ``<name>.html``: a summary table per run, one figure per panel below, the last
  sample completions of each run and its last flagged responses (error tokens,
  :mod:`quarl.trainer.error_tokens`) with the first bad token marked. Figures are
  embedded as base64 PNGs, so the HTML file alone is the whole report (it can be mailed
  or moved).
* ``<name>_files/<panel>.png``: the same figures as files, for slides and papers.

Where it goes: for one run ``RUN_DIR/report.html``; for several runs
``FIRST_RUN_DIR/report-compare.html``; with ``out_dir`` given, ``out_dir/report.html``
(or ``report-compare.html`` for several runs) regardless of the runs.

Runs share every axis; each run keeps one colour across all figures and is labelled
by its directory name (with its parent's name added when two runs share a name).
Metrics that are missing or ``null`` (the logger writes non-finite values as ``null``)
are skipped point by point; a metric with no data in any run gets no subplot, and a
panel with no subplot is left out (the report lists what had no data).
"""

from __future__ import annotations

import base64
import html
import json
import math
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quarl import plots
from quarl.trainer.logger import read_metrics

Series = tuple[list[float], list[float]]  # steps, values


@dataclass(frozen=True)
class Panel:
    """One figure: a subplot per metric, every run overlaid on each subplot.

    log: put a subplot's y axis on a log scale when all its values are positive and
        span more than a factor of 20 (otherwise it stays linear).
    """

    name: str
    title: str
    metrics: tuple[str, ...]
    log: bool = False


PANELS: tuple[Panel, ...] = (
    Panel("reward", "Reward and accuracy", ("reward/mean", "acc/mean", "eval/acc")),
    Panel("length", "Responses", ("response/len_mean", "response/len_max", "response/clip_frac",
                                  "response/repeat_frac")),
    Panel("errors", "Error tokens", ("errors/response_frac", "errors/loop_frac", "errors/garbled_frac",
                                     "errors/first_pos", "errors/token_frac_after")),
    Panel("mismatch", "Sampler / learner mismatch", ("mismatch/kl_k1", "mismatch/kl_k3", "mismatch/ppl_ratio"),
          log=True),
    Panel("moe", "MoE routing", ("moe/route_agreement", "moe/expert_load_max", "mismatch/kl_k3_noreplay")),
    Panel("clipping", "Clipped and dropped", ("loss/clip_frac", "tbpo/drop_frac_pos", "tbpo/drop_frac_neg")),
    Panel("entropy", "Entropy", ("entropy",)),
    Panel("grad_norm", "Gradient norm", ("grad_norm",), log=True),
    Panel("quant", "Low-bit weights", ("quant/update_visible_frac", "quant/rel_update", "quant/rel_quant_err"),
          log=True),
)
TIME_PARTS = ("time/rollout", "time/learner", "time/publish")
THROUGHPUT = "rollout/tokens_per_s"
SUMMARY_CONFIG_KEYS = (("mode", "quant", "mode"), ("scheme", "quant", "scheme"), ("loss", "algo", "loss"),
                       ("correction", "algo", "correction"), ("uaq", "quant", "uaq_scale"))
NUM_SAMPLES = 4
NUM_FLAGGED = 4  # flagged responses shown per run
SMOOTH_ABOVE = 50  # points per series beyond which a smoothed line is drawn over the raw one


@dataclass
class RunData:
    path: Path
    label: str
    rows: list[dict[str, Any]]
    config: dict[str, Any] | None
    samples: list[dict[str, Any]]
    flagged: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def series(self, metric: str) -> Series:
        """The finite values of ``metric`` and their steps (missing and null skipped)."""
        steps, values = [], []
        for i, row in enumerate(self.rows):
            v = row.get(metric)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            steps.append(float(row.get("step", i)))
            values.append(float(v))
        return steps, values


def render_report(run_dirs: list[Path], out_dir: Path | None = None) -> Path:
    """Write the report of ``run_dirs`` (see the module docstring for where); returns the HTML path."""
    if not run_dirs:
        raise ValueError("give at least one run directory")
    runs = load_runs([Path(d) for d in run_dirs])
    stem = "report" if len(runs) == 1 else "report-compare"
    out_dir = Path(out_dir) if out_dir is not None else runs[0].path
    out_dir.mkdir(parents=True, exist_ok=True)
    assets = out_dir / f"{stem}_files"
    assets.mkdir(exist_ok=True)
    figures, empty = [], []
    drawn = [(p.title, p.name, plot_panel(p, runs)) for p in PANELS] + [("Step time", "time", plot_time(runs))]
    for title, name, png in drawn:
        if png is None:
            empty.append(title)
        else:
            figures.append((title, name, png))
    for old in assets.glob("*.png"):  # a re-render must not leave figures of metrics that vanished
        old.unlink()
    for _, name, png in figures:
        (assets / f"{name}.png").write_bytes(png)
    page = _html_page(runs, figures, empty)
    out = out_dir / f"{stem}.html"
    out.write_text(page, encoding="utf-8")
    return out


# ---------------------------------------------------------------------- reading runs
def load_runs(run_dirs: list[Path]) -> list[RunData]:
    for d in run_dirs:
        if not (d / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{d} has no metrics.jsonl: is it a quarl run directory (trainer.run_dir)?")
    labels = _labels(run_dirs)
    runs = []
    for d, label in zip(run_dirs, labels):
        rows = _read_samples(d)
        samples = [r for r in rows if not r.get("flagged")][-NUM_SAMPLES:]
        flagged = [r for r in rows if r.get("flagged")][-NUM_FLAGGED:]
        runs.append(RunData(d, label, read_metrics(d), _read_config(d), samples, flagged))
    return runs


def _labels(run_dirs: list[Path]) -> list[str]:
    names = [d.resolve().name for d in run_dirs]
    out = []
    for d, name in zip(run_dirs, names):
        if names.count(name) > 1:
            name = f"{d.resolve().parent.name}/{name}"
        out.append(name)
    if len(set(out)) < len(out):  # same directory given twice, or deeper clashes
        out = [f"{label} [{i}]" for i, label in enumerate(out)]
    return out


def _read_config(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    import yaml

    try:
        cfg = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return None  # the report is still useful without it
    return cfg if isinstance(cfg, dict) else None


def _read_samples(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "samples.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if isinstance(row, dict):
            rows.append(row)
    return rows


# ---------------------------------------------------------------------- figures
def _draw(ax, steps: list[float], values: list[float], color: str, label: str) -> None:
    marker = "o" if len(values) <= 20 else None  # sparse series (eval/acc) stay visible
    if len(values) > SMOOTH_ABOVE:
        ax.plot(steps, values, color=color, alpha=0.3, linewidth=0.8)
        ax.plot(steps, plots.ema(values, max(5, len(values) // 25)), color=color, linewidth=1.6, label=label)
    else:
        ax.plot(steps, values, color=color, marker=marker, markersize=3, linewidth=1.2, label=label)


def plot_panel(panel: Panel, runs: list[RunData]) -> bytes | None:
    """The panel's PNG, or None when no run has data for any of its metrics."""
    present = [m for m in panel.metrics if any(run.series(m)[1] for run in runs)]
    if not present:
        return None
    fig, axes = plots.figure(len(present), panel.title)
    for ax, metric in zip(axes, present):
        plotted: list[float] = []
        for i, run in enumerate(runs):
            steps, values = run.series(metric)
            if values:
                _draw(ax, steps, values, plots.color(i), run.label)
                plotted += values
        if panel.log:
            _log_scale(ax, plotted)
        ax.set_title(metric, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return plots.png(fig)


def _log_scale(ax, values: list[float]) -> None:
    # Signed series (k1 goes negative) and narrow ranges (ppl_ratio near 1) read better linear.
    if values and min(values) > 0 and max(values) / min(values) > 20:
        ax.set_yscale("log")


def plot_time(runs: list[RunData]) -> bytes | None:
    """Stacked rollout/learner/publish seconds per step (one subplot per run) and throughput."""
    timed = [(i, run) for i, run in enumerate(runs) if any(run.series(p)[1] for p in TIME_PARTS)]
    has_tps = any(run.series(THROUGHPUT)[1] for run in runs)
    n = len(timed) + has_tps
    if n == 0:
        return None
    fig, axes = plots.figure(n, "Step time")
    for ax, (_, run) in zip(axes, timed):
        steps, stacks, labels = _aligned_parts(run)
        ax.stackplot(steps, *stacks, labels=labels, colors=[plots.color(3 + j) for j in range(len(stacks))], alpha=0.8)
        ax.set_title(f"{run.label}: seconds per step", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    if has_tps:
        ax = axes[-1]
        for i, run in enumerate(runs):
            steps, values = run.series(THROUGHPUT)
            if values:
                _draw(ax, steps, values, plots.color(i), run.label)
        ax.set_title(THROUGHPUT, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return plots.png(fig)


def _aligned_parts(run: RunData) -> tuple[list[float], list[list[float]], list[str]]:
    """Steps with any timing, and each present part on those steps (a missing value counts 0)."""
    parts = [p for p in TIME_PARTS if run.series(p)[1]]
    by_part = {p: dict(zip(*run.series(p))) for p in parts}
    steps = sorted(set().union(*(d.keys() for d in by_part.values())))
    stacks = [[by_part[p].get(s, 0.0) for s in steps] for p in parts]
    return steps, stacks, [p.removeprefix("time/") for p in parts]


# ---------------------------------------------------------------------- summary + HTML
def summarize(run: RunData) -> dict[str, str]:
    """The summary table's row for ``run`` (strings, "-" where unknown)."""
    steps, reward = run.series("reward/mean")
    _, eval_acc = run.series("eval/acc")
    step_time = run.series("time/step")[1] or _summed_parts(run)
    last_step = max((r.get("step", 0) for r in run.rows if isinstance(r.get("step"), (int, float))), default=None)
    row = {
        "run": run.label,
        "steps": "-" if last_step is None else f"{int(last_step)} ({len(run.rows)} logged)",
        "final reward": plots.fmt_sig(reward[-1] if reward else None),
        "best reward": "-" if not reward else f"{max(reward):.4g} @ {int(steps[reward.index(max(reward))])}",
        "final eval acc": plots.fmt_sig(eval_acc[-1] if eval_acc else None),
        "mean step time (s)": plots.fmt_sig(sum(step_time) / len(step_time) if step_time else None),
    }
    for title, section, key in SUMMARY_CONFIG_KEYS:
        value = (run.config or {}).get(section, {})
        value = value.get(key) if isinstance(value, dict) else None
        row[title] = "-" if value is None else str(value)
    return row


def _summed_parts(run: RunData) -> list[float]:
    _, stacks, _ = _aligned_parts(run)
    return [sum(col) for col in zip(*stacks)] if stacks else []


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
th, td { border: 1px solid #ccc; padding: 4px 10px; text-align: left; font-size: 14px; }
th { background: #f2f2f2; }
img { max-width: 100%; display: block; margin: 0.5em 0 1.5em; }
pre { background: #f7f7f7; padding: 0.6em; white-space: pre-wrap; word-break: break-word; }
.meta { color: #666; font-size: 13px; }
"""


def _flagged_html(s: dict[str, Any]) -> str:
    """A flagged response: its error (kind, place) and its text with the first bad token in ``<mark>``."""
    e = html.escape
    meta = (f"step {s.get('step', '?')} · {s.get('error_kind', '?')} from response token {s.get('error_pos', '?')} "
            f"of {s.get('response_tokens', '?')} · reward {s.get('reward', '?')} · answer {s.get('answer', '?')}")
    split = s.get("error_text")
    if isinstance(split, list) and len(split) == 3:
        before, bad, after = (str(x) for x in split)
        text = f"{e(before)}<mark>{e(bad) or '&#9647;'}</mark>{e(after)}"  # (an empty token shows as a box)
    else:
        text = e(str(s.get("completion", "")))
    return (f'<p class="meta">{e(meta)}</p><pre><b>prompt</b>\n{e(str(s.get("prompt", "")))}\n'
            f"<b>completion</b>\n{text}</pre>")


def _html_page(runs: list[RunData], figures: list[tuple[str, str, bytes]], empty: list[str]) -> str:
    e = html.escape
    rows = [summarize(run) for run in runs]
    head = "".join(f"<th>{e(k)}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{e(v)}</td>" for v in row.values()) + "</tr>" for row in rows)
    parts = [
        "<!DOCTYPE html>", '<html><head><meta charset="utf-8">',
        f"<title>quarl report: {e(', '.join(r.label for r in runs))}</title>", f"<style>{_CSS}</style></head><body>",
        f"<h1>quarl report: {e(', '.join(r.label for r in runs))}</h1>",
        '<p class="meta">' + "<br>".join(f"{e(r.label)}: {e(str(r.path.resolve()))}" for r in runs) + "</p>",
        "<h2>Summary</h2>", f"<table><tr>{head}</tr>{body}</table>",
    ]
    for title, name, png in figures:
        data = base64.b64encode(png).decode("ascii")
        parts.append(f'<h2>{e(title)}</h2><img alt="{e(name)}" src="data:image/png;base64,{data}">')
    if empty:
        parts.append(f'<p class="meta">No data in any run for: {e(", ".join(empty))}.</p>')
    parts.append("<h2>Last samples</h2>")
    for run in runs:
        parts.append(f"<h3>{e(run.label)}</h3>")
        if not run.samples:
            parts.append('<p class="meta">no samples.jsonl</p>')
        for s in run.samples:
            meta = f"step {s.get('step', '?')} · reward {s.get('reward', '?')} · answer {s.get('answer', '?')}"
            if s.get("error_pos") is not None:
                meta += f" · {s.get('error_kind')} from response token {s['error_pos']}"
            parts.append(f'<p class="meta">{e(str(meta))}</p>')
            parts.append(f"<pre><b>prompt</b>\n{e(str(s.get('prompt', '')))}\n<b>completion</b>\n"
                         f"{e(str(s.get('completion', '')))}</pre>")
    if any(run.flagged for run in runs):
        parts.append("<h2>Flagged responses (error tokens)</h2>")
        parts.append('<p class="meta">Training responses with a looping tail or a garbled stretch; the first bad '
                     "token is marked.</p>")
        for run in runs:
            parts.append(f"<h3>{e(run.label)}</h3>")
            if not run.flagged:
                parts.append('<p class="meta">none flagged</p>')
            parts += [_flagged_html(s) for s in run.flagged]
    parts.append("</body></html>")
    return "\n".join(parts)
