"""``quarl bench mismatch``: the sampler/learner mismatch by mode, and the part of it that
summation order alone makes (the learner against itself at another token budget)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    from quarl.bench.train import MODES, WORKLOADS

    p = subparsers.add_parser(
        "mismatch", help="where the sampler/learner mismatch comes from, by mode (random weights)",
        description="For each mode, one rollout of a `quarl bench train` workload is scored by the learner at the "
        "workload's token budget and at --other-budget (other micro-batch shapes, so other GEMM kernels and "
        "summation orders). Prints kl_k3 engine vs learner, learner vs learner, engine vs learner at the other "
        "budget, and the learner against itself with its linears' inputs nudged by one ulp (how much each mode "
        "amplifies last-bit differences). Extra --section.key=value flags go to every mode's run config.",
    )
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="w1")
    p.add_argument("--modes", default="bf16,aligned-w4a16,aligned-w8a8-fp8,aligned-w8a8-int8",
                   help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--other-budget", type=int, default=1024,
                   help="the learner's second token budget (default 1024: about one response per micro-batch)")
    p.add_argument("--nudge", type=float, default=0.1,
                   help="fraction of each decoder linear's input elements moved one ulp for the nudged pass "
                        "(default 0.1)")
    p.add_argument("--out", help="write the JSON result here (e.g. bench/baselines/mismatch_w1_h100.json)")
    p.set_defaults(run=run, accepts_overrides=True)
    return p


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from quarl.bench.mismatch import run_mismatch, summary_table

    modes = [m for m in args.modes.split(",") if m]
    result = run_mismatch(args.workload, modes, args.other_budget, list(args.overrides),
                          Path(args.out) if args.out else None, args.nudge)
    print(summary_table(result))
    return 0
