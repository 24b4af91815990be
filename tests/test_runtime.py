"""quarl.runtime: the count of frames torch.compile compiled (perf/compiles)."""

from __future__ import annotations

import torch

from quarl.runtime import compiled_frames


def test_compiled_frames_counts_compilations_and_recompilations():
    def double_sin(x):
        return x.sin() * 2

    f = torch.compile(double_sin, backend="eager", dynamic=False)
    start = compiled_frames()
    f(torch.randn(3))
    first = compiled_frames()
    f(torch.randn(3))  # the same shape: the compiled frame runs again, nothing compiles
    again = compiled_frames()
    f(torch.randn(3, 2))  # another rank of input: recompiled
    assert first == start + 1 and again == first and compiled_frames() == again + 1
