"""``quarl bench gemm|sweep|rollout|train|learner|mismatch``: the benchmark suites (GPU; JSON; bench/baselines/)."""

from __future__ import annotations

import functools
import importlib
import importlib.util

SUITES = ("gemm", "sweep", "rollout", "train", "learner", "mismatch")


def add_parser(sub) -> None:
    p = sub.add_parser("bench",
                       help="benchmarks (GEMM kernels, kernel-config sweeps, rollout engine, the whole RL step)")
    inner = p.add_subparsers(dest="suite", metavar="SUITE", required=True)
    for suite in SUITES:
        importlib.import_module(f"quarl.cli.bench_{suite}").add_parser(inner)
        parser = inner.choices[suite]
        parser.set_defaults(run=_needs_triton(parser.get_default("run")))


def _needs_triton(run):
    """``run`` behind a check for triton: every suite times quarl's Triton/CUDA kernels, and
    neither the ``train`` extra nor the CPU torch wheel installs triton, so say what to install
    before any work instead of failing deep inside a kernel import."""

    @functools.wraps(run)
    def gated(args):
        if importlib.util.find_spec("triton") is None:
            raise ModuleNotFoundError("No module named 'triton'", name="triton")  # main names the install
        return run(args)

    return gated
