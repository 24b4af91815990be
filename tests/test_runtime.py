"""quarl.runtime: the count of frames torch.compile compiled (perf/compiles) and the time it took (perf/compile_s)."""

from __future__ import annotations

import torch

from quarl.runtime import compile_seconds, compiled_frames


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


def test_compile_seconds_counts_the_forward_and_the_backward_compilation():
    """The frame's compilation and its backward graph's (compiled at the first backward)
    both add time; running compiled code again adds none."""
    def scaled_cos(x):
        return (x.cos() * 3).sum()

    f = torch.compile(scaled_cos, backend="aot_eager", dynamic=False)
    x = torch.randn(5, requires_grad=True)
    start = compile_seconds()
    y = f(x)
    forward = compile_seconds()
    y.backward()
    backward = compile_seconds()
    f(x).backward()
    assert forward > start and backward > forward and compile_seconds() == backward
