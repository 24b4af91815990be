"""``quarl bench train``: the whole RL step, every mode in one call (GPU)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    from quarl.bench.train import MODE_OPTIONS, MODES, PROFILED_STAGES, PROFILES, WORKLOADS

    p = subparsers.add_parser(
        "train", help="end-to-end RL step time by mode (random weights, forced length)",
        description="Runs each mode's RL steps on the same random-weight model and workload in one call and "
        "reports the step-time breakdown, rollout tok/s, mismatch, learner MFU, peak memory and ratios to bf16. "
        "With several modes each runs in a fresh process of its own. "
        "Extra --section.key=value flags go to every mode's run config.",
    )
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="w1")
    p.add_argument("--modes", default=",".join(m for m in MODES if m != "aligned-w8a8-int8"),
                   help=f"comma list of {', '.join(MODES)}, each optionally with "
                        f"{', '.join('+' + o for o in MODE_OPTIONS)} (e.g. aligned-w4a16+kvfp8: that mode with "
                        "the FP8 KV cache, the others without)")
    p.add_argument("--steps", type=int, help="steps per mode (default: the workload's)")
    p.add_argument("--profile", nargs="?", const="kernels", choices=PROFILES,
                   help="profile one stage of each mode's last step (--profile-stage): 'kernels' (the default) "
                   "its GPU kernels by total time, the GPU busy share and the device syncs with their source lines; "
                   "'host' where the host's time goes (cProfile, functions by cumulative time). That step is left "
                   "out of the medians")
    p.add_argument("--profile-stage", choices=PROFILED_STAGES, default="learner",
                   help="the stage --profile looks at: the learner's update (default) or the publish into the engine")
    p.add_argument("--baseline", metavar="DIR",
                   help="a directory holding another version's quarl/ package (e.g. `git archive REV quarl | tar -x "
                   "-C DIR`): each mode also runs under that code right after, and the table gives the speedup over "
                   "it (old and new measured in one call)")
    p.add_argument("--baseline-commit", metavar="SHA", help="the baseline's commit, recorded in the result")
    p.add_argument("--model", metavar="DIR",
                   help="a saved checkpoint of the workload's shape to run on (default: random weights of that shape, "
                   "made once per call and loaded by every mode)")
    p.add_argument("--gpus", metavar="N,N,...",
                   help="scaling: run each mode on each of these GPU counts (torchrun, one rank per GPU, data "
                   "parallel) with the workload's prompts per GPU, e.g. --gpus 1,2,4; reports each count's step "
                   "breakdown and its efficiency against one GPU. Sharding the learner: add "
                   "--trainer.shard_learner=true")
    p.add_argument("--out", help="write the JSON result here (e.g. bench/baselines/train_w1_h100.json); it is "
                   "saved after every run")
    p.add_argument("--resume", action="store_true",
                   help="continue the result at --out (a call cut short): keep the runs it has, run the missing "
                   "ones (same workload, commit and flags, else an error)")
    p.set_defaults(run=run, accepts_overrides=True)
    return p


def run(args: argparse.Namespace) -> int:
    import json
    import os
    from pathlib import Path

    import torch

    from quarl.bench.train import run_benchmark, summary_table

    if not torch.cuda.is_available():
        raise ValueError("quarl bench train needs a CUDA GPU; run it on a GPU machine")
    extra = list(args.overrides) + ([f"--trainer.steps={args.steps}"] if args.steps else [])
    modes = [m for m in args.modes.split(",") if m]
    gpus = parse_gpus(args.gpus, torch.cuda.device_count()) if args.gpus else None
    if gpus and args.baseline:
        raise ValueError("--gpus and --baseline do not combine: compare versions on one GPU count at a time")
    result = run_benchmark(args.workload, modes, extra, Path(args.out) if args.out else None, args.profile,
                           Path(args.baseline) if args.baseline else None, args.baseline_commit,
                           Path(args.model) if args.model else None, args.profile_stage, gpus, args.resume)
    if os.environ.get("RANK", "0") == "0":  # (a torchrun child's rank 0 reports)
        print(summary_table(result))
        if not args.out:
            print(json.dumps({m: r["median"] for m, r in result["modes"].items()}, indent=2))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from quarl.distributed import leave

        leave(0)
    return 0


def parse_gpus(text: str, available: int) -> list[int]:
    """``--gpus``: distinct counts from 1 to the GPUs this machine has, ascending."""
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--gpus {text}: give GPU counts separated by commas, e.g. --gpus 1,2,4") from None
    if not counts or counts[0] < 1 or counts[-1] > available:
        raise ValueError(f"--gpus {text}: each count must be between 1 and the {available} GPU(s) of this machine")
    return counts
