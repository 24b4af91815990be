"""Checkpoints that a crash or Ctrl-C can never corrupt.

Layout: ``RUN_DIR/checkpoints/step_000012/{state.pt, meta.json}``, plus ``learner/`` (the
files of ``torch.distributed.checkpoint``, one per rank) for a sharded learner. A checkpoint is
written into ``step_000012.tmp-<pid>`` and renamed into place once complete (rename is
atomic on POSIX); ``meta.json`` is written last inside the temporary directory, so a
directory without it is incomplete and ignored. The newest complete checkpoint is
what ``--resume`` loads; older ones beyond ``keep_last`` are deleted only after the new
one is in place.

A write that fails (a full disk) removes its temporary directory and raises
:class:`CheckpointWriteError`; the previous checkpoint is untouched. A checkpoint that
cannot be read back (``state.pt`` cut short, ``meta.json`` garbled) is skipped by
:func:`load_latest_intact`, which falls back to the newest one that loads.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quarl.io import fsync_file, replace_dir
from quarl.learner.learner import SHARDED_FORMAT

FORMAT = "quarl-checkpoint-v1"
REQUIRED_KEYS = ("step", "data_pos", "learner", "rng")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. no space left); the previous one is intact."""


class CheckpointUnreadable(ValueError):
    """No checkpoint of a run directory can be loaded."""


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())  # (generator states are CPU byte tensors, wherever loaded)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def temporary_dir(run_dir: str | Path, step: int, pid: int | None = None) -> Path:
    """Where the checkpoint of ``step`` is written before it is renamed into place (``pid``:
    the writing process's, by default this one)."""
    return checkpoint_dir(run_dir) / f"step_{step:06d}.tmp-{os.getpid() if pid is None else pid}"


def start_checkpoint(run_dir: str | Path, step: int, pid: int | None = None) -> Path:
    """An empty temporary directory for a checkpoint that several processes write into
    (:func:`save_checkpoint` with ``tmp``); raises :class:`CheckpointWriteError` if it cannot be made."""
    tmp = temporary_dir(run_dir, step, pid)
    try:
        tmp.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as e:
        raise discard_checkpoint(tmp, run_dir, step, e) from e
    return tmp


def discard_checkpoint(tmp: Path, run_dir: str | Path, step: int, e: BaseException) -> CheckpointWriteError:
    """Remove a checkpoint's temporary directory after a failed write; the error to raise."""
    shutil.rmtree(tmp, ignore_errors=True)
    final = checkpoint_dir(run_dir) / f"step_{step:06d}"
    errno = getattr(e, "errno", None)
    return CheckpointWriteError(errno, _write_error_message(run_dir, final, e))


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], keep_last: int = 2,
                    tmp: Path | None = None) -> Path:
    """Write ``state`` as the checkpoint of ``step`` and rename it into place. ``tmp``: a
    directory from :func:`start_checkpoint` that already holds other parts of it (a sharded
    learner's files); it is completed and renamed, or removed if the write fails."""
    root = checkpoint_dir(run_dir)
    final = root / f"step_{step:06d}"
    prepared = tmp is not None
    tmp = tmp if prepared else temporary_dir(run_dir, step)
    try:
        root.mkdir(parents=True, exist_ok=True)
        _write_complete(tmp, step, state, fresh=not prepared)
        _rename_into_place(tmp, final)
    except BaseException as e:  # a full disk, or a second Ctrl-C mid-write
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written directory helps nobody and holds space
        # torch.save reports a full disk as RuntimeError ("PytorchStreamWriter failed writing file")
        if isinstance(e, Exception):
            raise CheckpointWriteError(getattr(e, "errno", None), _write_error_message(run_dir, final, e)) from e
        raise
    for stale in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(stale, ignore_errors=True)
    for junk in root.glob("step_*.tmp-*"):
        if junk != tmp:
            shutil.rmtree(junk, ignore_errors=True)
    return final


def _rename_into_place(tmp: Path, final: Path) -> None:
    """``tmp`` becomes ``final``; a checkpoint of the same step already there is replaced."""
    replace_dir(tmp, final)


def _write_complete(tmp: Path, step: int, state: dict[str, Any], fresh: bool = True) -> None:
    if fresh:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    torch.save(state, tmp / "state.pt")
    fsync_file(tmp / "state.pt")
    (tmp / "meta.json").write_text(json.dumps({"format": FORMAT, "step": step}))
    fsync_file(tmp / "meta.json")


def _write_error_message(run_dir: str | Path, final: Path, e: BaseException) -> str:
    previous = latest_checkpoint(run_dir)
    kept = (f"the checkpoint of step {int(previous.name.split('_')[1])} ({previous}) is intact"
            if previous is not None else "no earlier checkpoint exists, so a resume starts from step 0")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    reason = getattr(e, "strerror", None) or first
    return (f"could not write checkpoint {final} ({reason}); {kept}. "
            f"Free some space (or fix the cause) and continue with: quarl train --resume "
            f"--trainer.run_dir={run_dir}")


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    done = []
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith("step_") and "." not in d.name and (d / "meta.json").is_file():
            done.append(d)
    return sorted(done, key=lambda d: int(d.name.split("_")[1]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not a complete quarl checkpoint (no meta.json)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')!r} is not {FORMAT!r}")
    return torch.load(path / "state.pt", map_location=map_location, weights_only=False)


def policy_weights(path: str | Path, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The policy's weights in the checkpoint ``path`` (whose ``state.pt`` is ``state``), whole
    and in the model's dtype: from ``state.pt``, or for a sharded learner from its
    ``learner/`` files (the float32 masters rounded to the model's dtype, as the learner
    rounds them)."""
    learner = state["learner"]
    if learner.get("format") != SHARDED_FORMAT:
        return learner["model"]
    tensors = read_whole(Path(path) / "learner", ("model/", "master/"))
    dtype = getattr(torch, learner["model_dtype"])
    out = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    out.update((k.removeprefix("master/"), v.to(dtype)) for k, v in tensors.items() if k.startswith("master/"))
    return out


def read_whole(directory: str | Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors of a ``torch.distributed.checkpoint`` directory whose names start with one
    of ``prefixes``, whole, in this process (no process group needed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(directory))
    found = reader.read_metadata().state_dict_metadata
    tensors = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in found.items()
               if k.startswith(prefixes) and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # (that no process group exists is the point here)
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def load_latest_intact(
    run_dir: str | Path, map_location: str | torch.device = "cpu"
) -> tuple[Path, dict[str, Any], list[tuple[Path, str]]] | None:
    """The newest checkpoint that loads: ``(path, state, [(bad path, why), ...])``.

    None when the run has no complete checkpoint at all; :class:`CheckpointUnreadable`
    (naming each one and why) when it has some but none of them loads.
    """
    found = list_checkpoints(run_dir)
    if not found:
        return None
    bad: list[tuple[Path, str]] = []
    for path in reversed(found):
        try:
            state = load_checkpoint(path, map_location=map_location)
            missing = [k for k in REQUIRED_KEYS if k not in state]
            if missing:
                raise ValueError(f"state.pt lacks {', '.join(missing)}")
        except Exception as e:  # torch.load of a cut file raises RuntimeError, EOFError, UnpicklingError...
            first = str(e).splitlines()[0] if str(e) else ""
            bad.append((path, f"{type(e).__name__}: {first}" if first else type(e).__name__))
            continue
        return path, state, bad
    listing = "; ".join(f"{p.name} ({why})" for p, why in bad)
    raise CheckpointUnreadable(
        f"no checkpoint in {checkpoint_dir(run_dir)} can be loaded: {listing}. The files are damaged "
        f"(a full disk or a copy cut short?); start over with --trainer.run_dir=NEW_DIR"
    )
