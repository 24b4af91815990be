"""``quarl train``: the QaRL loop (defaults: built-in model, synthetic arithmetic, aligned W4A16 + TBPO)."""

from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path


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
    p.add_argument("--resume", action="store_true",
                   help="continue the run in trainer.run_dir from its newest checkpoint, with its config.yaml "
                        "(flags given here override it)")
    p.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: accept changed settings that the checkpoint depends on (model, data, "
                        "quantization, optimizer, seed, batch shape)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--debug", action="store_true", help="show full tracebacks")
    p.set_defaults(run=run, accepts_overrides=True)


def run(args: argparse.Namespace) -> int:
    from quarl.config.typed import dump_yaml

    cfg = resolve_config(args)
    if args.dry_run:
        sys.stdout.write(dump_yaml(cfg))
        return 0
    from rich.console import Console

    from quarl.distributed import leave, shutdown
    from quarl.trainer.loop import Trainer

    console = None if args.quiet else Console(stderr=True)
    lock = _lock_run_dir(Path(cfg.trainer.run_dir), args.resume)
    try:
        trainer = Trainer(cfg, resume=args.resume, console=console, allow_config_change=args.allow_config_change)
        # under torchrun: rank 0 alone reports and prints
        code = _run_main(trainer, cfg) if trainer.dist.main else _run_rank(trainer)
        if trainer.dist.world > 1 and code == 0:
            leave(0)  # the run directory is complete and closed
    except OSError as e:  # a file the run writes (config, metrics, warm-start cache): one line, what to do
        if getattr(args, "debug", False) or e.errno not in _WRITE_ERRORS:
            raise
        raise ValueError(_write_failed(Path(cfg.trainer.run_dir), e)) from e
    finally:
        shutdown()
        if lock is not None:
            lock.release()
    return code


# a write refused or cut short: a full disk or quota, a read-only or failing disk, no permission
_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG,
                 errno.ENOTDIR}


def _lock_run_dir(run_dir: Path, resume: bool):
    """The run directory's lock (:mod:`quarl.trainer.lock`), taken by rank 0 alone (the ranks of one
    run share the directory); a resume first checks there is a run to continue."""
    import os

    from quarl.trainer.lock import RunLock
    from quarl.trainer.resume import check_resumable

    if resume:
        check_resumable(run_dir)
    if os.environ.get("RANK", "0") != "0":
        return None
    return RunLock(run_dir).acquire(resume)


def _write_failed(run_dir: Path, e: OSError) -> str:
    from quarl.trainer.checkpoint import latest_checkpoint

    newest = latest_checkpoint(run_dir)
    kept = (f"its newest checkpoint, {newest.name}, is intact: continue with quarl train --resume "
            f"--trainer.run_dir={run_dir}" if newest is not None else "no checkpoint was written")
    return f"could not write {e.filename or run_dir} ({e.strerror or e}); {kept} once the cause is fixed"


def _run_main(trainer, cfg) -> int:
    from quarl.trainer.checkpoint import CheckpointWriteError
    from quarl.trainer.loop import TrainingAborted
    from quarl.trainer.oom import OutOfGPUMemory

    from quarl.trainer.faults import EvaluationFailed

    resume_hint = f"quarl train --resume --trainer.run_dir={trainer.run_dir}"
    try:
        last = trainer.run()
    except KeyboardInterrupt:  # a second Ctrl-C: no report, the user wants out now
        print(f"quarl train: stopped; {_stopped(trainer, resume_hint)}", file=sys.stderr)
        return 130
    except EvaluationFailed as e:
        write_report(trainer.run_dir)
        print(f"quarl train: error: {e}; the step is saved in its checkpoint, step_{e.step:06d}: once the cause is "
              f"fixed, evaluate it with quarl eval {trainer.run_dir} or continue with {resume_hint}",
              file=sys.stderr)
        return 1
    except TrainingAborted as e:
        write_report(trainer.run_dir)
        print(f"quarl train: aborted: {e}", file=sys.stderr)
        return 3
    except CheckpointWriteError as e:
        write_report(trainer.run_dir)
        print(f"quarl train: error: {e.strerror}", file=sys.stderr)
        return 1
    except OutOfGPUMemory as e:
        write_report(trainer.run_dir)
        print(f"quarl train: error: {e}\n{_kept(trainer)}, then continue with: {resume_hint} --<setting>=<value>",
              file=sys.stderr)
        return 1
    if trainer.interrupted and trainer.step == 0:  # (stopped before a step finished: nothing was saved)
        print("quarl train: interrupted before the first step finished; nothing was kept: start it again with the "
              "same command", file=sys.stderr)
        return 130
    report = write_report(trainer.run_dir)
    if trainer.interrupted:
        print(f"quarl train: interrupted after step {trainer.step} (checkpoint saved); continue with: {resume_hint}",
              file=sys.stderr)
        return 130
    if not last:
        print(f"{trainer.run_dir} is already at step {trainer.step} (trainer.steps={cfg.trainer.steps}): nothing to "
              "train; pass a larger --trainer.steps to continue")
        return 0
    summary = ", ".join(
        f"{k}={last[k]:.4g}" for k in ("reward/mean", "acc/mean", "eval/acc", "mismatch/kl_k3") if k in last
    )
    print(f"finished {trainer.step} steps in {trainer.run_dir}: {summary}" + (f"; report {report}" if report else ""))
    return 0


def _run_rank(trainer) -> int:
    """A rank other than 0: the same steps, silently; its exit status says how they ended
    (rank 0 reports the error)."""
    from quarl.trainer.checkpoint import CheckpointWriteError
    from quarl.trainer.loop import TrainingAborted
    from quarl.trainer.oom import OutOfGPUMemory

    try:
        trainer.run()
    except KeyboardInterrupt:
        return 130
    except (TrainingAborted, CheckpointWriteError):
        return 3
    except OutOfGPUMemory as e:  # (a rank may run out alone: it says so itself)
        print(f"quarl train (rank {trainer.dist.rank}): error: {e}\n{_kept(trainer)}", file=sys.stderr)
        return 1
    return 130 if trainer.interrupted else 0


def resolve_config(args: argparse.Namespace):
    """The run config; on --resume without --config, the run's own config.yaml under the flags."""
    from quarl.config import load_run_config

    if args.allow_config_change and not args.resume:
        raise ValueError("--allow-config-change only applies with --resume")
    cfg = load_run_config(args.config, args.overrides)
    saved = Path(cfg.trainer.run_dir) / "config.yaml"
    if args.resume and args.config is None and saved.is_file():
        # the directory is where the run is now, even if config.yaml names where it was
        cfg = load_run_config(str(saved), [*args.overrides, f"--trainer.run_dir={cfg.trainer.run_dir}"])
    return cfg


def write_report(run_dir: Path) -> Path | None:
    """RUN_DIR/report.html; a report that cannot be drawn is a warning, never a failed run."""
    from quarl.trainer.interrupt import HardStop
    from quarl.trainer.report import render_report

    try:
        with HardStop():  # the checkpoint is saved: Ctrl-C now only skips the report
            return render_report([run_dir])
    except KeyboardInterrupt:
        print(f"quarl train: report skipped (interrupted); write it with: quarl report {run_dir}", file=sys.stderr)
        return None
    except Exception as e:  # noqa: BLE001 -- matplotlib missing, a full disk, a damaged metrics line...
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"quarl train: warning: could not write {run_dir / 'report.html'}: {first} "
              f"(the run itself is fine; retry with: quarl report {run_dir})", file=sys.stderr)
        return None


def _stopped(trainer, resume_hint: str) -> str:
    """What a second Ctrl-C left: the newest checkpoint, or that there is none."""
    from quarl.trainer.checkpoint import latest_checkpoint

    newest = latest_checkpoint(trainer.run_dir)
    if newest is not None:
        return f"its newest checkpoint, {newest.name}, is intact: continue with {resume_hint}"
    if trainer.step == 0:
        return "no step was trained and nothing was kept: start it again with the same command"
    return (f"no checkpoint was written, so its {trainer.step} steps are lost (trainer.save_every sets how often "
            f"one is): start it again from step 0 with {resume_hint}")


def _kept(trainer) -> str:
    """What of the run is safe after a failed step: its newest checkpoint."""
    from quarl.trainer.checkpoint import latest_checkpoint

    newest = latest_checkpoint(trainer.run_dir)
    if newest is None:
        return "no checkpoint was written yet: change the setting"
    return f"its newest checkpoint, {newest.name}, is intact: change the setting"
