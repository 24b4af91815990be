"""quarl.runtime: the count of frames torch.compile compiled (perf/compiles), the time it took
(perf/compile_s), and the garbage collector's time (perf/gc_s, perf/gc_full)."""

from __future__ import annotations

import gc

import torch

from quarl.runtime import compile_seconds, compiled_frames, gc_clock, process_totals


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


def test_gc_clock_counts_collections_and_their_time():
    """A full collection over many cyclic objects adds its time and one full collection; a
    young-generation one adds time but no full collection."""
    clock = gc_clock()
    assert gc_clock() is clock
    gc.disable()  # (no automatic collection while the cycles are made, nor between the reads below)
    try:
        cycles = []
        for _ in range(50_000):
            a: list = []
            a.append(a)
            cycles.append(a)
        del cycles, a
        s0, f0 = clock.seconds, clock.full
        freed = gc.collect(2)
        s1, f1 = clock.seconds, clock.full
        gc.collect(0)
        assert freed >= 50_000 and s1 > s0 and f1 == f0 + 1
        assert clock.seconds > s1 and clock.full == f1
        totals = process_totals()
        assert (totals["perf/gc_s"], totals["perf/gc_full"]) == (clock.seconds, clock.full)
        assert (totals["perf/compiles"], totals["perf/compile_s"]) == (compiled_frames(), compile_seconds())
    finally:
        gc.enable()
