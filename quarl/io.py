"""Writing files so that a reader sees the old content or the new, never part of it.

Every write goes to a temporary file beside the target (same directory, so the rename stays
on one file system), is flushed and fsynced, then renamed over the target (``os.replace``:
atomic on POSIX). A failed write removes the temporary file and leaves the target as it was.
The temporary names are unique per process and call, so concurrent writers of one target
never share one; the last rename wins.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync_file(path: str | Path) -> None:
    """Flush ``path``'s written data to the disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path for the block to write ``path``'s new content to (by any writer, e.g.
    ``safetensors.torch.save_file``); at a clean exit it is fsynced and renamed over ``path``,
    on an error removed. The parent directory is made if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(path)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "xb") as f:
        f.write(data)


def write_text_atomic(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    write_bytes_atomic(path, text.encode(encoding))


def write_json_atomic(path: str | Path, obj: Any, **dump_kwargs: Any) -> None:
    """``obj`` as JSON (``json.dumps(obj, **dump_kwargs)``) at ``path``."""
    write_text_atomic(path, json.dumps(obj, **dump_kwargs))


def replace_dir(tmp: str | Path, dst: str | Path) -> None:
    """Move the complete directory ``tmp`` to ``dst``: an existing ``dst`` is renamed aside
    first and removed only once ``tmp`` is in place, so at every moment one of the two is."""
    tmp, dst = Path(tmp), Path(dst)
    if not dst.exists():
        tmp.rename(dst)
        return
    old = dst.with_name(f".{dst.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    dst.rename(old)
    tmp.rename(dst)
    shutil.rmtree(old, ignore_errors=True)
