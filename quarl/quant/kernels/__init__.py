"""Fast GPU paths of the quantized GEMMs. Everything here imports triton lazily."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True
