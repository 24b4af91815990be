"""What every benchmark records beside its numbers."""

from __future__ import annotations

import os
import subprocess


def git_commit() -> str:
    """HEAD's hash, or ``$QUARL_GIT_COMMIT`` where the checkout has no .git (device copies)."""
    if os.environ.get("QUARL_GIT_COMMIT"):
        return os.environ["QUARL_GIT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"
