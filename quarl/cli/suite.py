"""``quarl suite``: run an experiment suite (a directory of run configs) over its seeds, and render its page."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser(
        "suite",
        help="run an experiment suite over seeds and render its results page",
        description="run: build the suite's base model, train every run config of SUITE_DIR for every seed "
                    "(PARALLEL at once), copy the metrics into OUT and render OUT/README.md. report: render "
                    "a results directory again. Flags --section.key=value go to every run.",
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    r = verbs.add_parser("run", help="run a suite", description="run suites one after another (see quarl suite -h); "
                         "suites whose work directories sit side by side share a base built from the same recipe")
    r.add_argument("suite_dir", type=Path, nargs="+", metavar="SUITE_DIR",
                   help="directory with suite.yaml and run configs; several run in turn")
    r.add_argument("--work", type=Path,
                   help="where the runs live (default runs/suites/<suite>; with several suites WORK/<suite>)")
    r.add_argument("--out", type=Path,
                   help="results directory (default docs/results/<suite>; with several suites OUT/<suite>)")
    r.add_argument("--parallel", type=int, help="runs at once (default: the suite's)")
    r.add_argument("--seeds", help="comma-separated seeds instead of the suite's, e.g. 0,1")
    r.add_argument("--only", help="comma-separated run names: run these alone")
    r.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each finished run's final checkpoint (default: deleted, the metrics kept)")
    r.add_argument("--debug", action="store_true", help="show full tracebacks")
    r.set_defaults(run=run_suite_cmd, accepts_overrides=True)
    b = verbs.add_parser("base", help="build and evaluate a suite's base model alone",
                         description="warm-start the suite's base recipe (cached in WORK/base) and print its "
                                     "held-out accuracy (bf16, greedy): the step that calibrates a recipe")
    b.add_argument("suite_dir", type=Path, metavar="SUITE_DIR")
    b.add_argument("--work", type=Path, help="default runs/suites/<suite>")
    b.add_argument("--debug", action="store_true", help="show full tracebacks")
    b.set_defaults(run=base_cmd, accepts_overrides=True)
    rep = verbs.add_parser("report", help="render a suite's results page",
                           description="summarise RESULTS_DIR into summary.json and README.md with its plots")
    rep.add_argument("results_dir", type=Path, metavar="RESULTS_DIR")
    rep.add_argument("--suite", type=Path,
                     help="the suite directory whose spec to use (default: the copy in RESULTS_DIR)")
    rep.add_argument("--debug", action="store_true", help="show full tracebacks")
    rep.set_defaults(run=report_cmd)


def _ints(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds takes comma-separated integers, got {text!r}") from None


def run_suite_cmd(args: argparse.Namespace) -> int:
    from quarl.experiments.results import render
    from quarl.experiments.suite import check_seeds, collect, load_suite, run_suite

    suites = [load_suite(d) for d in args.suite_dir]  # every suite is checked before any runs
    several = len(suites) > 1
    names = [s.name for s in suites]
    if len(set(names)) < len(names):
        raise ValueError(f"two suites are named {next(n for n in names if names.count(n) > 1)!r}: their runs would "
                         "share a work directory; run them in separate commands with --work")
    if several and args.only:
        raise ValueError("--only names the runs of one suite: give one SUITE_DIR with it")
    if args.parallel is not None and args.parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {args.parallel}")
    seeds = check_seeds(_ints(args.seeds)) if args.seeds is not None else None
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    complete = True
    for suite in suites:
        if seeds is not None:
            suite.seeds = seeds
        work = _place(args.work, Path("runs/suites"), suite.name, several)
        out = _place(args.out, Path("docs/results"), suite.name, several)
        try:
            plan = run_suite(suite, work, args.overrides, args.parallel, only, args.keep_checkpoints,
                             log=lambda m: print(m, flush=True))
        except KeyboardInterrupt:  # what finished is kept: its results are rendered, a rerun goes on
            collect(suite, work, out)
            print(f"results so far: {render(out)}; run the same command again to continue", flush=True)
            return 130
        collect(suite, work, out)
        print(f"results: {render(out)}", flush=True)
        complete = complete and all(r.status in ("done", "skipped") for r in plan)
    return 0 if complete else 1


def _place(given: Path | None, default_root: Path, name: str, several: bool) -> Path:
    """A suite's work or results directory: the one given, or ``<given>/<suite>`` when several
    suites run; by default ``<default_root>/<suite>``."""
    if given is None:
        return default_root / name
    return given / name if several else given


def base_cmd(args: argparse.Namespace) -> int:
    import json
    import sys

    from quarl.experiments.suite import build_base, load_suite

    suite = load_suite(args.suite_dir)
    if suite.base is None:
        raise ValueError(f"{args.suite_dir}/suite.yaml names no base recipe (base: path/to/recipe.yaml)")
    work = args.work or Path("runs/suites") / suite.name
    _, info = build_base(suite, work, args.overrides, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps({k: v for k, v in info.items() if k != "recipe"}, indent=2))
    return 0


def report_cmd(args: argparse.Namespace) -> int:
    from quarl.experiments.results import render

    print(render(args.results_dir, args.suite))
    return 0
