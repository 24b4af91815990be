"""``quarl eval``: greedy accuracy of a model or a run's checkpoint on the task's eval set."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a run's latest checkpoint (or a model) on the task's eval split",
        description="Greedy decoding with the rollout engine; prints the task's metrics as JSON.",
    )
    p.add_argument("run_dir", nargs="?", help="a run directory (its config and latest checkpoint are used)")
    p.add_argument("--config", help="YAML run config with model.path set (to evaluate a model, not a run)")
    p.add_argument("--scheme", help="evaluate with this quantization scheme in the engine (default: the run's)")
    p.add_argument("--debug", action="store_true")
    p.set_defaults(run=run, accepts_overrides=True)


def run(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from quarl.config import load_run_config

    overrides = list(args.overrides)
    if args.scheme:
        mode = "bf16" if args.scheme == "bf16" else "rollout"  # the engine in that scheme, the weights as trained
        overrides += [f"--quant.scheme={args.scheme}", f"--quant.mode={mode}"]
    if args.run_dir:
        run_dir = Path(args.run_dir)
        cfg_file = run_dir / "config.yaml"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{run_dir} has no config.yaml: is it a quarl run directory?")
        cfg = load_run_config(
            str(cfg_file), overrides + [f"--trainer.run_dir={run_dir}", "--trainer.tensorboard=false"]
        )
        return _evaluate(cfg, resume=True)
    # A model as it is: no warm-start, and no run directory left behind.
    with tempfile.TemporaryDirectory(prefix="quarl-eval-") as scratch:
        cfg = load_run_config(args.config, overrides + [
            "--trainer.sft_warmup_steps=0", f"--trainer.run_dir={scratch}", "--trainer.tensorboard=false"])
        if not cfg.model.path:  # else: an untrained random model, whose score means nothing
            raise ValueError(
                "nothing to evaluate: pass a run directory (quarl eval RUN_DIR), or a model with "
                "quarl eval --config run.yaml where model.path is set (or --model.path=DIR)"
            )
        return _evaluate(cfg, resume=False)


def _evaluate(cfg, resume: bool) -> int:
    from quarl.trainer.loop import Trainer

    trainer = Trainer(cfg, resume=resume, evaluation_only=True)
    metrics = trainer.evaluate(log=False)
    metrics["step"] = trainer.step
    print(json.dumps(metrics, indent=2))
    return 0
