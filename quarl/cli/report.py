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
    from quarl.trainer.report import render_report

    print(render_report(args.run_dirs, args.out))
    return 0
