"""``quarl train``: the QaRL loop (defaults: built-in model, synthetic arithmetic, aligned W4A16 + TBPO)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train with RL (default: the built-in demo run)",
        description=(
            "Train a policy with RL. With no arguments: a small built-in model learns synthetic "
            "arithmetic (supervised warm-start, then aligned W4A16 + TBPO). Any config key can be "
            "overridden with --section.key=value, e.g. --quant.mode=rollout --algo.loss=ppo."
        ),
    )
    p.add_argument("--config", help="YAML run config (sections: model, data, rollout, quant, algo, optim, trainer)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in trainer.run_dir")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    p.set_defaults(run=run, accepts_overrides=True)


def run(args: argparse.Namespace) -> int:
    from quarl.config import load_run_config
    from quarl.configuration import dump_yaml

    cfg = load_run_config(args.config, args.overrides)
    if args.dry_run:
        sys.stdout.write(dump_yaml(cfg))
        return 0
    from rich.console import Console

    from quarl.trainer.loop import Trainer, TrainingAborted

    console = None if args.quiet else Console(stderr=True)
    trainer = Trainer(cfg, resume=args.resume, console=console)
    try:
        last = trainer.run()
    except TrainingAborted as e:
        print(f"quarl train: aborted: {e}", file=sys.stderr)
        return 3
    summary = ", ".join(
        f"{k}={last[k]:.4g}" for k in ("reward/mean", "acc/mean", "eval/acc", "mismatch/kl_k3") if k in last
    )
    print(f"finished {trainer.step} steps in {trainer.run_dir}: {summary}")
    return 0
