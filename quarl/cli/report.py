"""``quarl report``: an HTML report of one run, or several runs overlaid."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report",
        help="write an HTML report (plots, summary, samples) of one or more runs",
        description="Plot the metrics of RUN_DIR (several: overlaid on shared axes) into a self-contained "
        "HTML file plus PNGs. Default output: RUN_DIR/report.html for one run, "
        "FIRST_RUN_DIR/report-compare.html for several.",
    )
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directory with metrics.jsonl")
    p.add_argument("--out", type=Path, help="write the report into this directory instead")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from quarl.cli.common import os_error
    from quarl.trainer.report import render_report

    out_dir = args.out if args.out is not None else args.run_dirs[0]
    try:
        _check_has_metrics(args.run_dirs)
    except OSError as e:  # (metrics that cannot be read: a read error, not the write one below)
        if e.filename is None:
            raise
        raise os_error(e, None) from None
    try:
        print(render_report(args.run_dirs, args.out))
    except OSError as e:
        if e.filename is None:  # the report's own messages (not a run directory): as they are
            raise
        raise os_error(e, out_dir, f"the report into {out_dir}",
                       "pass --out DIR to write it into a writable directory") from None
    return 0


def _check_has_metrics(run_dirs: list[Path]) -> None:
    """Refuse a run whose metrics.jsonl holds no row yet (a run that has not finished a step, or
    a file emptied by hand): its report would be empty and replace a good one."""
    from quarl.trainer.logger import read_metrics

    for d in run_dirs:
        if not (d / "metrics.jsonl").is_file():
            continue  # render_report names what is missing
        if not read_metrics(d, warn=lambda _: None):
            others = " (or leave it out of the comparison)" if len(run_dirs) > 1 else ""
            raise ValueError(f"{d / 'metrics.jsonl'} holds no metrics yet: nothing to report, and any report "
                             f"already there is kept; report {d} once it has logged a step{others}")
