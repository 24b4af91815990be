"""A run's checkpoints as the loop writes and resumes them (the files themselves:
:mod:`quarl.trainer.checkpoint`).

A checkpoint holds the learner's tensors, where the run stands (:class:`RunPosition`), the
random state and the config; no per-rank state, so a run resumes on any number of ranks. On
several ranks rank 0 writes it while the others wait, except for a sharded learner, whose
ranks each write their shards (:func:`save_sharded`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from quarl.config import RunConfig
from quarl.config.run import upgrade
from quarl.config.typed import to_dict
from quarl.distributed import Dist
from quarl.trainer import checkpoint as ckpt
from quarl.trainer.notices import Notices
from quarl.trainer.resume import apply_optimizer_settings, check_config_change, check_resumable, existing_run

Found = tuple  # (path, state, [(bad path, why), ...]) of :func:`~quarl.trainer.checkpoint.load_latest_intact`


@dataclass(frozen=True)
class RunPosition:
    """Where a run stands: its completed steps, the train examples drawn, and the count of
    consecutive skipped updates."""

    step: int = 0
    data_pos: int = 0
    bad_steps: int = 0


def preflight(run_dir: Path, cfg: RunConfig, resume: bool, evaluation_only: bool, allow_config_change: bool,
              notices: Notices) -> Found | None:
    """Reads only. Refuses a new run into an existing one; loads and checks the checkpoint to resume."""
    existing = existing_run(run_dir)
    if not resume:
        if existing is not None and not evaluation_only:
            from_zero = " (from step 0: no checkpoint was written)" if "no checkpoint" in existing else ""
            raise ValueError(
                f"{run_dir} already holds a run ({existing}): pass --resume to continue it{from_zero}, "
                "or --trainer.run_dir=NEW_DIR to start another (or delete the directory)"
            )
        return None
    if not evaluation_only:
        check_resumable(run_dir)
    # to the CPU: the learner copies each tensor into its own (the whole state on the GPU next to the
    # model would double the learner's memory), and random generator states must stay CPU tensors
    found = ckpt.load_latest_intact(run_dir, map_location="cpu")
    if found is None:
        what = f"it holds {existing}" if existing else "it holds no run yet"
        if evaluation_only:  # an untrained model's score would pass for the run's
            raise ValueError(f"{run_dir} has no checkpoint to evaluate ({what}): train it first "
                             f"(quarl train --resume --trainer.run_dir={run_dir}), or evaluate a model "
                             "directory with quarl eval --model DIR")
        notices.warn(f"--resume: no checkpoint in {run_dir} ({what}): starting from step 0")
        return None
    path, state, bad = found
    for bad_path, why in bad:
        notices.warn(f"checkpoint {bad_path} cannot be loaded ({why}); using {path.name} (step {state['step']}) "
                     "instead")
    if not evaluation_only and isinstance(state.get("config"), dict):
        source = f"the config stored in {path}"
        for notice in check_config_change(upgrade(state["config"]), to_dict(cfg), source, allow_config_change,
                                          run_dir):
            notices.warn(notice)
    return found


def misfit(path: Path, run_dir: Path, e: BaseException) -> ValueError:
    """The error for a checkpoint whose tensors do not fit the model built from the config."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ValueError(
        f"checkpoint {path} does not fit the model built from this config ({first}): it was written "
        "with other model, quant or optim settings. Resume with the run's own settings "
        f"('quarl train --resume --trainer.run_dir={run_dir}' uses its config.yaml)"
    )


def restore(found: Found, learner, cfg: RunConfig, run_dir: Path, notices: Notices, quarantine: bool,
            on_misfit: Callable[[], None] = lambda: None) -> RunPosition:
    """Load what :func:`preflight` found into ``learner`` and the random state; ``quarantine``:
    move the unreadable checkpoints it skipped aside. A checkpoint that does not fit the
    learner calls ``on_misfit`` (what must not outlive a failed start), then raises
    :func:`misfit`'s ValueError."""
    path, state, bad = found
    try:
        if state["learner"].get("format") == ckpt.SHARDED_FORMAT:  # a sharded learner's
            learner.load_sharded_state(path / "learner", state["learner"])
        else:
            learner.load_state_dict(state["learner"])
    except (RuntimeError, KeyError, ValueError) as e:
        on_misfit()
        raise misfit(path, run_dir, e) from e
    apply_optimizer_settings(learner, cfg.optim)  # the config's, not those stored with the state
    position = RunPosition(state["step"], state["data_pos"], state["bad_steps"])
    ckpt.set_rng_state(state["rng"])
    for bad_path, _ in bad if quarantine else []:
        # out of the way, not deleted: the run must not pick it up again, and nothing is lost
        aside = bad_path.with_name(f"{bad_path.name}.corrupt-{os.getpid()}")
        bad_path.rename(aside)
        notices.warn(f"moved the unreadable checkpoint aside to {aside}")
    notices.say(f"resumed from {path} (step {position.step})")
    return position


def checkpoint_state(position: RunPosition, learner: dict, cfg: RunConfig) -> dict[str, Any]:
    """A checkpoint's contents: ``learner``'s state and where the run stands."""
    return {"step": position.step, "data_pos": position.data_pos, "bad_steps": position.bad_steps,
            "learner": learner, "rng": ckpt.rng_state(), "config": to_dict(cfg)}


def save(run_dir: Path, position: RunPosition, learner, cfg: RunConfig, dist: Dist) -> Path:
    """Write this step's checkpoint atomically (:class:`ckpt.CheckpointWriteError` if it cannot be).
    On several ranks rank 0 writes it (every rank holds the same weights and optimizer
    state) while the others wait; a sharded learner's ranks each write their shards
    (:func:`save_sharded`)."""
    if learner.sharded:
        return save_sharded(run_dir, position, learner, cfg, dist)
    if not dist.main:
        dist.barrier()
        return run_dir / "checkpoints" / f"step_{position.step:06d}"
    state = checkpoint_state(position, learner.state_dict(), cfg)
    try:
        return ckpt.save_checkpoint(run_dir, position.step, state, cfg.trainer.keep_last)
    finally:
        dist.barrier()


def save_sharded(run_dir: Path, position: RunPosition, learner, cfg: RunConfig, dist: Dist) -> Path:
    """A sharded learner's checkpoint: every rank writes its shards of the learner's tensors
    with ``torch.distributed.checkpoint`` into ``learner/`` of rank 0's temporary directory,
    then rank 0 adds the rest and renames it into place. A rank whose write fails fails
    the checkpoint on every rank (:class:`ckpt.CheckpointWriteError`); the previous one
    stays intact."""
    import torch.distributed.checkpoint as dcp

    step = position.step
    tensors, rest = learner.sharded_state()
    pid = dist.gather(os.getpid())[0]  # rank 0's temporary directory
    tmp = ckpt.temporary_dir(run_dir, step, pid)
    error: BaseException | None = None
    if dist.main:
        try:
            ckpt.start_checkpoint(run_dir, step, pid)
        except ckpt.CheckpointWriteError as e:
            error = e
    # the ranks agree after each part (the same collectives on every rank, whichever failed)
    failed = dist.max(int(error is not None))
    if not failed:
        try:
            dcp.save(tensors, checkpoint_id=str(tmp / "learner"))
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # a full disk on any rank fails the collective save on all (CheckpointException)
            error = first_failure(e)
        failed = dist.max(int(error is not None))
        if not failed:
            if dist.main:
                try:  # (removes the temporary directory itself if it fails)
                    ckpt.save_checkpoint(run_dir, step, checkpoint_state(position, rest, cfg), cfg.trainer.keep_last,
                                         tmp=tmp)
                except ckpt.CheckpointWriteError as e:
                    error = e
            failed = dist.max(int(error is not None))  # (the others wait for rank 0's rename)
    if failed:
        if not dist.main:  # rank 0 reports the cause
            raise ckpt.CheckpointWriteError(getattr(error, "errno", None),
                                            f"the checkpoint of step {step} could not be written")
        if isinstance(error, ckpt.CheckpointWriteError):
            raise error
        raise ckpt.discard_checkpoint(tmp, run_dir, step,
                                      error or RuntimeError("another rank could not write its part"))
    return run_dir / "checkpoints" / f"step_{step:06d}"


def first_failure(e: BaseException) -> BaseException:
    """The error behind a failed ``torch.distributed.checkpoint`` call (its CheckpointException
    carries each failed rank's), else ``e``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (exc, _trace) = min(failures.items(), key=lambda kv: kv[0])
        return type(exc)(*exc.args) if isinstance(exc, OSError) else RuntimeError(f"rank {rank}: {exc}")
    return e
