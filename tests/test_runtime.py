"""quarl.runtime: the compiled steps' dynamic batch and time, the count of frames torch.compile
compiled (perf/compiles), the time it took (perf/compile_s), and the garbage collector's time
(perf/gc_s, perf/gc_full)."""

from __future__ import annotations

import gc

import torch

from quarl.runtime import compile_seconds, compiled, compiled_frames, gc_clock, process_totals


def _heads_out(x, w):
    """As the region after attention starts: ``[B, T, H, D]`` flattened to rows, projected."""
    return (x.reshape(-1, x.shape[2] * x.shape[3]) @ w).relu()


def test_a_view_of_a_computed_base_does_not_recompile_at_one_row():
    """The attention output the learner passes on is a view (a transpose of SDPA's output) of
    a base computed under autograd. A graph without gradients, then one with, then a first
    call of one row: without the base's batch dimension marked the second graph guards on
    ``2 <= x._base.size()[0]`` and the one-row call compiles it again (on the GPU: one 0.2-1.4 s
    recompile a run). Without the base marked this fails on torch 2.11 and 2.13 alike."""
    step = compiled(_heads_out)
    w = torch.randn(24, 8, requires_grad=True)
    p = torch.randn(12, 12, requires_grad=True)

    def call(rows: int, t: int, grad: bool) -> None:
        with torch.set_grad_enabled(grad):
            base = torch.randn(rows, t, 2, 12) @ p  # [B, T, H, D]: what the kernel writes
            x = base.transpose(1, 2).transpose(1, 2)  # its [B, H, T, D] output, transposed back
            assert x._base is base
            y = step(x, w)
            torch.testing.assert_close(y, (base.reshape(-1, 24) @ w).relu())
            if grad:
                y.sum().backward()

    call(3, 9, False)
    call(4, 11, True)
    frames = compiled_frames()
    for rows, t, grad in ((2, 7, True), (1, 13, True), (4, 6, True), (1, 5, False)):
        call(rows, t, grad)
    assert compiled_frames() == frames


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


def test_triton_builds_count_through_the_post_compile_hook_and_chain_to_the_previous_one(monkeypatch):
    """perf/triton_builds: the counter takes Triton's post-compile hook once, counts each call
    (Triton calls it per kernel variant built) and passes it on to a hook installed before it.
    (The interpreter compiles nothing, so the hook is called here as Triton calls it.)"""
    from triton import knobs

    from quarl.runtime import TRITON_BUILDS, _TritonBuilds

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw["key"]))
    builds = _TritonBuilds()
    builds.install()
    builds.install()  # (once: never its own previous hook)
    assert knobs.runtime.jit_post_compile_hook is builds
    knobs.runtime.jit_post_compile_hook(key="a", repr="k[...]", fn=None, compile={}, is_manual_warmup=False,
                                        already_compiled=False)
    knobs.runtime.jit_post_compile_hook(key="b", repr="k[...]", fn=None, compile={}, is_manual_warmup=False,
                                        already_compiled=False)
    assert builds.count == 2 and seen == ["a", "b"]
    assert process_totals()["perf/triton_builds"] == float(TRITON_BUILDS.count)
