"""One process at a time in a run directory.

Two ``quarl train`` into one directory, or a run and a ``--resume`` of it, would both
append the same steps to ``metrics.jsonl`` and overwrite each other's checkpoints.
:class:`RunLock` holds an OS file lock (``fcntl.flock``) on ``RUN_DIR/.quarl.lock`` for
the run's life; a second process fails at once, naming the holder's pid (written into
the file). The kernel drops the lock when its process dies, however it dies, so a lock
left by a crashed or killed run is simply taken over; the pid in the file is only for
the message.

Taking the lock is also the first write into the directory: a directory that cannot be
written (a read-only mount, no permission, a path through a file) fails here, in one
line, before anything is built. A run that fails before its first step leaves no
directory behind that it created (:meth:`RunLock.release`).
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

try:
    import fcntl
except ImportError:  # (not on Windows: no lock there)
    fcntl = None

LOCK_FILE = ".quarl.lock"
# what a run writes before its first step: removed with a directory the run created and never used
SETUP_FILES = ("config.yaml", "metrics.jsonl", "samples.jsonl", "report.html", "report_files", "tensorboard",
               LOCK_FILE)


class RunDirError(ValueError):
    """The run directory cannot be written. A ValueError: the CLI reports it in one line."""


class RunDirBusy(RunDirError):
    """Another process holds the run directory."""


def unwritable(run_dir: Path, e: OSError, resume: bool) -> str:
    """The one-line message for a run directory that cannot be written."""
    reason = e.strerror or str(e)
    where = f" ({e.filename})" if e.filename and Path(e.filename) != run_dir else ""
    fix = ("copy the run to a writable disk and resume it there (quarl train --resume --trainer.run_dir=COPY)"
           if resume else "make it writable, or pass --trainer.run_dir=DIR on a writable disk")
    return f"cannot write to the run directory {run_dir}: {reason}{where}; {fix}"


class RunLock:
    """``lock = RunLock(run_dir).acquire(resume)`` ... ``lock.release()``."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.fd: int | None = None
        self.created: Path | None = None  # the outermost directory that acquire() created

    def acquire(self, resume: bool = False) -> "RunLock":
        created = next((p for p in reversed([self.run_dir, *self.run_dir.parents]) if not p.exists()), None)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.created = created
            fd = os.open(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            self.release()  # (removes what mkdir made, if anything)
            raise RunDirError(unwritable(self.run_dir, e, resume)) from e
        if not self._lock(fd):
            holder = os.read(fd, 200).decode(errors="replace").split()
            os.close(fd)
            raise RunDirBusy(_busy(self.run_dir, holder))
        self.fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
            _check_writable(self.run_dir)  # (an existing lock file opens for writing in a directory that is not)
        except OSError as e:
            self.release()
            raise RunDirError(unwritable(self.run_dir, e, resume)) from e
        return self

    def _lock(self, fd: int) -> bool:
        """Whether this process now holds the lock (True too where the file system has no locks)."""
        if fcntl is None:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as e:  # (a network file system without locks: run unprotected, and say so)
            print(f"warning: cannot lock {self.run_dir / LOCK_FILE} ({e.strerror}); nothing stops a second "
                  "process from writing into this run directory", file=sys.stderr)
        return True

    def release(self) -> None:
        """Drop the lock. A directory this lock created and no step was written into (the run
        failed before its first step) is removed, with the directories above it that it created."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.created is None or _holds_a_step(self.run_dir):
            return
        for name in SETUP_FILES:
            path = self.run_dir / name
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists():
                path.unlink(missing_ok=True)
        for d in [self.run_dir, *self.run_dir.parents]:
            try:
                d.rmdir()  # only while empty: a warm-start cache stays, and whatever else is there
            except OSError:
                break
            if d == self.created:
                break


def _busy(run_dir: Path, holder: list[str]) -> str:
    pid = holder[0] if holder else "unknown"
    host = f" on {holder[1]}" if len(holder) > 1 and holder[1] != socket.gethostname() else ""
    stop = f" or stop it (kill {pid})" if pid != "unknown" and not host else ""
    return (f"{run_dir} is in use by another quarl process (pid {pid}{host}): two processes in one run directory "
            f"would write the same steps twice. Wait for it to finish{stop}, or pass --trainer.run_dir=NEW_DIR")


def _check_writable(run_dir: Path) -> None:
    probe = run_dir / f".write-check-{os.getpid()}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.close(fd)
    probe.unlink()


def _holds_a_step(run_dir: Path) -> bool:
    """Whether a step of this run was logged or checkpointed."""
    metrics = run_dir / "metrics.jsonl"
    checkpoints = run_dir / "checkpoints"
    return (metrics.is_file() and metrics.stat().st_size > 0) or (checkpoints.is_dir() and any(checkpoints.iterdir()))
