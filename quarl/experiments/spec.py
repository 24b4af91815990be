"""A suite's spec: ``suite.yaml`` read and checked (:func:`load_suite`) into a :class:`Suite`
of run configs, seeds, table columns and plots (the format: :mod:`quarl.experiments.suite`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from quarl.config.typed import merge, read_yaml

SUITE_FILE = "suite.yaml"
AT = ("last", "first", "mean", "max", "min", "tail", "median")  # how a column reduces a run's series
_SUITE_KEYS = {"title", "about", "base", "seeds", "parallel", "common", "baseline", "table", "plots"}
BASE_SECTIONS = ("model", "data", "rollout")  # what every run takes from the base recipe


@dataclass(frozen=True)
class Column:
    """One summary column: ``metric`` reduced over a run's steps by ``at`` (``tail`` /
    ``median``: the mean / median of the last ``tail`` values), and with ``ratio`` divided by
    the baseline's value of the same seed. ``without``: a metric whose nonzero steps are left
    out first (``perf/compiles``: the steps that compiled, for a steady-state time)."""

    metric: str
    at: str = "last"
    ratio: bool = False
    tail: int = 5
    label: str | None = None
    without: str | None = None

    @property
    def name(self) -> str:
        at = {"tail": f"last {self.tail}", "median": f"median of last {self.tail}"}.get(self.at, self.at)
        at += f" where {self.without} = 0" if self.without else ""
        return self.label or f"{self.metric} ({at}{' / baseline' if self.ratio else ''})"


@dataclass(frozen=True)
class Plot:
    """One figure. ``lines``: a subplot per metric, each run's mean over seeds along the
    steps with its seeds' range shaded. ``bars``: the metrics side by side, a bar per run
    (the metric reduced by ``at``, averaged over seeds; whiskers: the seeds' range; ``without``
    as for :class:`Column`)."""

    title: str
    metrics: tuple[str, ...]
    kind: str = "lines"
    at: str = "mean"
    log: bool = False
    tail: int = 5
    without: str | None = None


@dataclass
class Suite:
    name: str
    root: Path
    title: str
    about: str
    base: Path | None
    seeds: list[int]
    parallel: int
    common: dict[str, Any]
    baseline: str | None
    table: list[Column]
    plots: list[Plot]
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)


def _fail(where: Path, message: str):
    raise ValueError(f"{where}: {message}")


def load_suite(root: str | Path, run_names: list[str] | None = None) -> Suite:
    """The suite in directory ``root`` (a ValueError names the file and the fix for bad input).
    ``run_names``: the runs' names without their configs (a results directory's copy of
    ``suite.yaml``, which is only rendered)."""
    root = Path(root)
    spec_file = root / SUITE_FILE
    if not spec_file.is_file():
        raise ValueError(f"{root} is not a suite: it has no {SUITE_FILE} (see quarl.experiments.suite)")
    spec = read_yaml(spec_file)
    unknown = sorted(set(spec) - _SUITE_KEYS)
    if unknown:
        _fail(spec_file, f"unknown key(s) {', '.join(unknown)}; a suite has {', '.join(sorted(_SUITE_KEYS))}")
    seeds = spec.get("seeds", [0])
    try:
        check_seeds(seeds)
    except ValueError as e:
        _fail(spec_file, str(e))
    parallel = spec.get("parallel", 1)
    if not _is_int(parallel) or parallel < 1:
        _fail(spec_file, f"parallel must be an integer >= 1, got {parallel!r}")
    base = spec.get("base")
    base_path = (root / base).resolve() if base else None
    if base_path is not None and not base_path.is_file() and run_names is None:
        _fail(spec_file, f"base recipe {base} does not exist (a path relative to the suite's directory)")
    common = _common(spec_file, spec.get("common") or {}, check_files=run_names is None)
    if run_names is not None:
        runs = {n: {} for n in run_names}
    else:
        # a base recipe or common file kept beside suite.yaml is not a run
        shared = {p.resolve() for p in [base_path, *_common_files(spec_file, spec.get("common"))] if p is not None}
        runs = {f.stem: read_yaml(f) for f in sorted(root.glob("*.yaml"))
                if f.name != SUITE_FILE and f.resolve() not in shared}
    if not runs:
        _fail(root, "a suite needs at least one run config (*.yaml) beside suite.yaml")
    baseline = spec.get("baseline")
    if baseline is not None and baseline not in runs:
        _fail(spec_file, f"baseline {baseline!r} is not one of the runs ({', '.join(runs)})")
    table = [_column(spec_file, c) for c in spec.get("table") or []]
    if any(c.ratio for c in table) and baseline is None:
        _fail(spec_file, "a ratio column needs a baseline run: set baseline to one of the runs")
    plots = [_plot(spec_file, p) for p in spec.get("plots") or []]
    return Suite(root.resolve().name, root, spec.get("title") or root.name, (spec.get("about") or "").strip(),
                 base_path, seeds, parallel, common, baseline, table, plots, runs)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_seeds(seeds: Any) -> list[int]:
    """``seeds`` if it is a non-empty list of distinct integers, else a ValueError."""
    if not (isinstance(seeds, list) and seeds and all(_is_int(s) for s in seeds)) or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be a non-empty list of distinct integers, got {seeds!r}")
    return seeds


def _common(where: Path, common: Any, check_files: bool = True) -> dict[str, Any]:
    """``common``: a mapping of config sections, a YAML file's path (relative to the suite),
    or a list of these merged in order (later ones win)."""
    parts = common if isinstance(common, list) else [common]
    out: dict[str, Any] = {}
    for part in parts:
        if isinstance(part, str):
            f = where.parent / part
            if not f.is_file():
                if check_files:
                    _fail(where, f"common: {part} does not exist (a path relative to the suite's directory)")
                continue
            part = read_yaml(f)
        if not isinstance(part, dict):
            _fail(where, f"common must be a mapping of config sections, a YAML file or a list of these, got {part!r}")
        out = merge(out, part)
    return out


def _common_files(where: Path, common: Any) -> list[Path]:
    parts = common if isinstance(common, list) else [common]
    return [where.parent / p for p in parts if isinstance(p, str)]


def _column(where: Path, c: Any) -> Column:
    if isinstance(c, str):
        c = {"metric": c}
    if not isinstance(c, dict) or "metric" not in c:
        _fail(where, f"a table column is a metric name or a mapping with 'metric', got {c!r}")
    unknown = sorted(set(c) - {"metric", "at", "ratio", "tail", "label", "without"})
    if unknown:
        _fail(where, f"table column {c['metric']}: unknown key(s) {', '.join(unknown)}")
    col = Column(**c)
    if col.at not in AT:
        _fail(where, f"table column {col.metric}: at must be one of {', '.join(AT)}, got {col.at!r}")
    if not _is_int(col.tail) or col.tail < 1:
        _fail(where, f"table column {col.metric}: tail must be an integer >= 1")
    if not isinstance(col.ratio, bool):
        _fail(where, f"table column {col.metric}: ratio must be true or false, got {col.ratio!r}")
    if col.without is not None and not isinstance(col.without, str):
        _fail(where, f"table column {col.metric}: without names a metric, got {col.without!r}")
    return col


def _plot(where: Path, p: Any) -> Plot:
    if not isinstance(p, dict) or not isinstance(p.get("metrics"), list) or not p["metrics"]:
        _fail(where, f"a plot is a mapping with a title and a non-empty list of metrics, got {p!r}")
    unknown = sorted(set(p) - {"title", "metrics", "kind", "at", "log", "tail", "without"})
    if unknown:
        _fail(where, f"plot {p.get('title')!r}: unknown key(s) {', '.join(unknown)}")
    plot = Plot(str(p.get("title") or ", ".join(p["metrics"])), tuple(p["metrics"]), p.get("kind", "lines"),
                p.get("at", "mean"), bool(p.get("log", False)), p.get("tail", 5), p.get("without"))
    if plot.kind not in ("lines", "bars"):
        _fail(where, f"plot {plot.title!r}: kind must be lines or bars, got {plot.kind!r}")
    if plot.at not in AT:
        _fail(where, f"plot {plot.title!r}: at must be one of {', '.join(AT)}, got {plot.at!r}")
    if not _is_int(plot.tail) or plot.tail < 1:
        _fail(where, f"plot {plot.title!r}: tail must be an integer >= 1, got {plot.tail!r}")
    if plot.without is not None and not isinstance(plot.without, str):
        _fail(where, f"plot {plot.title!r}: without names a metric, got {plot.without!r}")
    if plot.without is not None and plot.kind != "bars":
        _fail(where, f"plot {plot.title!r}: without leaves steps out of a bars plot's reduction; "
                     "a lines plot draws every step")
    return plot
