"""Checkpoints that a crash or Ctrl-C can never corrupt.

Layout: ``RUN_DIR/checkpoints/step_000012/{state.pt, meta.json}``. A checkpoint is
written into ``step_000012.tmp-<pid>`` and renamed into place once complete (rename is
atomic on POSIX); ``meta.json`` is written last inside the temporary directory, so a
directory without it is incomplete and ignored. The newest complete checkpoint is
what ``--resume`` loads; older ones beyond ``keep_last`` are deleted only after the new
one is in place.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "quarl-checkpoint-v1"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], keep_last: int = 2) -> Path:
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    torch.save(state, tmp / "state.pt")
    _fsync(tmp / "state.pt")
    (tmp / "meta.json").write_text(json.dumps({"format": FORMAT, "step": step}))
    _fsync(tmp / "meta.json")
    if final.exists():
        old = root / f"step_{step:06d}.old-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    for stale in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(stale, ignore_errors=True)
    for junk in root.glob("step_*.tmp-*"):
        if junk != tmp:
            shutil.rmtree(junk, ignore_errors=True)
    return final


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


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
