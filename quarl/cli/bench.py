"""``quarl bench gemm|sweep|rollout|train|learner|mismatch``: the benchmark suites (GPU; JSON under bench/results/)."""

from __future__ import annotations

import importlib

SUITES = ("gemm", "sweep", "rollout", "train", "learner", "mismatch")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (GEMM kernels, kernel-config sweeps, rollout engine, the whole RL step)")
    inner = p.add_subparsers(dest="suite", metavar="SUITE", required=True)
    for suite in SUITES:
        importlib.import_module(f"quarl.cli.bench_{suite}").add_parser(inner)
