"""``quarl bench learner``: the learner's micro-batch alone, host against GPU, by mode."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    from quarl.bench.learner import MODES, Spec
    from quarl.model.presets import PRESETS

    d = Spec()
    p = subparsers.add_parser(
        "learner", help="the learner's micro-batch: host time against GPU kernel time, by mode",
        description="Times the learner's micro-batch (log-probs through the compiled layer regions and the "
        "backward, gradients accumulated) on random weights of a preset shape: the host's time, the wall time, "
        "the GPU's kernel time and launches per micro-batch. A host slower than its kernels leaves the GPU "
        "waiting. With several modes (or a baseline) each runs in a fresh process of its own.",
    )
    p.add_argument("--modes", default="bf16,aligned-w8a8-fp8", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--shape", choices=sorted(PRESETS), default=d.shape)
    p.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens per micro-batch (the learner's token_budget)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per row (prompt + response)")
    p.add_argument("--micro-batches", type=int, default=d.micro_batches, help="micro-batches per timed repeat")
    p.add_argument("--reps", type=int, default=d.reps, help="timed repeats")
    p.add_argument("--warmup", type=int, default=d.warmup, help="repeats before timing (compilation)")
    p.add_argument("--eager", action="store_true", help="the learner's eager ops instead of its compiled regions")
    p.add_argument("--profile", nargs="?", const="kernels", choices=("kernels", "host"),
                   help="also profile one more repeat: 'kernels' (the default) the GPU kernels by total time, the "
                   "busy share and the device syncs; 'host' where the host's time goes (cProfile, functions by "
                   "cumulative time)")
    p.add_argument("--baseline", metavar="DIR",
                   help="a directory holding another version's quarl/ package (`git archive REV quarl | tar -x -C "
                   "DIR`): each mode also runs under that code right after")
    p.add_argument("--baseline-commit", metavar="SHA", help="the baseline's commit, recorded in the result")
    p.add_argument("--out", help="write the JSON result here (saved after every run)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from quarl.bench.learner import Spec, run_benchmark, summary_table

    if not torch.cuda.is_available():
        print("quarl bench learner: no CUDA GPU here; the CPU's times say nothing of a GPU learner's", flush=True)
    spec = Spec(args.shape, args.layers, args.tokens, args.seq_len, args.micro_batches, args.reps, args.warmup,
                not args.eager)
    result = run_benchmark([m for m in args.modes.split(",") if m], spec, Path(args.out) if args.out else None,
                           Path(args.baseline) if args.baseline else None, args.baseline_commit, args.profile)
    print(summary_table(result))
    return 0
