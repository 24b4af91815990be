"""Reward functions for the RewardPool tests: importable, so workers can load them by path."""

from __future__ import annotations

import os
import time


def exact(completion: str, answer: str, meta: dict) -> float:
    """1.0 on an exact match; "hang" sleeps forever, "raise" raises, "die" kills the worker."""
    if completion == "hang":
        time.sleep(3600)
    if completion == "raise":
        raise RuntimeError("verifier bug")
    if completion == "die":
        os._exit(3)
    if completion == "none":
        return None  # type: ignore[return-value]
    return 1.0 if completion == answer else 0.0


NOT_A_FUNCTION = 3
