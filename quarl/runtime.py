"""Where and in which dtype a command runs (``auto`` resolved against the machine), and how
its compiled steps are built (:func:`compiled`)."""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
import time
from typing import Callable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str = "auto", flag: str = "--device") -> torch.device:
    """``flag``: how the command being run sets the device, for the error's hint."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use {flag}=cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def median_cuda_time(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls, each between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def matmul_rate(device: torch.device) -> float | None:
    """The GPU's bf16 matrix rate in FLOP/s, measured on an 8192^3 product (median of 10 after
    warm-up; ~790 TFLOP/s on an H100 SXM, whose dense spec is 989): the denominator of
    model-FLOPs utilisation. None on CPU."""
    if device.type != "cuda":
        return None
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    a @ b
    return 2 * n**3 / median_cuda_time(lambda: a @ b, 10)


@functools.cache
def _eager_numerics() -> dict[str, bool]:
    """Inductor options that keep eager's rounding: casts, and fp32 division as IEEE division
    (Triton's ``/`` is an approximation; named ``eager_numerics.division_rounding`` since
    PyTorch 2.11, ``emulate_divison_rounding`` in 2.10, absent before)."""
    from torch._inductor import config

    options = {"emulate_precision_casts": True}
    if hasattr(getattr(config, "eager_numerics", None), "division_rounding"):
        options["eager_numerics.division_rounding"] = True
    elif hasattr(config, "emulate_divison_rounding"):
        options["emulate_divison_rounding"] = True
    return options


@functools.cache
def compiled(fn):
    """``fn`` through ``torch.compile`` (eager's rounding kept: :func:`_eager_numerics`) with the
    batch and time dimensions of its activation arguments (3 dimensions or more:
    ``[B, T, ...]``) dynamic and every other size static. The batch dimension is
    unbacked: a backed size specialises on 1, so a first call with one row would compile
    again at the first call with two. Static widths (hidden size, heads, the MLP's) let the
    generated kernels index with constants instead of runtime divisions by symbolic sizes."""
    traced = torch.compile(fn, options=_eager_numerics())

    def call(*args):
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() >= 3:  # activations [B, T, ...], not weights
                _mark_batch_and_time(a)
        return traced(*args)

    return call


def _mark_batch_and_time(a: torch.Tensor) -> None:
    """Mark an activation's batch and time dimensions unbacked, and so too those of its base
    (a view's: the compiler traces a view from its base): the base's dimensions with the
    size and stride of the view's batch, its time, or the two flattened into rows. A base
    left backed has its batch size specialised to "at least 2" once a graph is made for a
    gradient after one without, and the first one-row call compiles that graph again (SDPA's
    output entering the region after attention: ``[B, T, H, D]`` written, a transpose
    returned). The base's other dimensions, the widths, stay static."""
    mark = torch._dynamo.decorators.mark_unbacked
    mark(a, 0)
    mark(a, 1)
    base = a._base
    if base is not None:
        rows = {(a.size(0), a.stride(0)), (a.size(1), a.stride(1)), (a.size(0) * a.size(1), a.stride(1))}
        for j in range(base.dim()):
            if (base.size(j), base.stride(j)) in rows:
                mark(base, j)


class GcClock:
    """Seconds Python's cyclic garbage collector has run in this process, and its full
    (oldest-generation) collections, from :data:`gc.callbacks`: a training step's share is
    ``perf/gc_s`` / ``perf/gc_full``. A full collection walks every tracked object (the
    model's modules, compiled graphs, autograd nodes) and holds the host that long, while the
    GPU drains its queue."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._start: float | None = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.full += info["generation"] == 2  # the oldest generation
            self._start = None


@functools.cache
def gc_clock() -> GcClock:
    """The process's :class:`GcClock` (installed at the first call)."""
    return GcClock()


_RECOMPUTED_DEPTH = 0


@contextlib.contextmanager
def recomputed_layer():
    """Marks a decoder layer run under activation checkpointing (its first forward and its
    recomputation in the backward): what it saves for its backward lives only while that
    layer's backward runs, so a weight made per use may enter a compiled region."""
    global _RECOMPUTED_DEPTH
    _RECOMPUTED_DEPTH += 1
    try:
        yield
    finally:
        _RECOMPUTED_DEPTH -= 1


def saves_nothing_past_the_layer() -> bool:
    """Whether nothing the current forward saves for a backward outlives its layer: no
    gradient is being recorded, or the layer is recomputed (:func:`recomputed_layer`)."""
    return not torch.is_grad_enabled() or _RECOMPUTED_DEPTH > 0


def compile_seconds() -> float:
    """Seconds ``torch.compile`` has spent compiling in this process so far: frames (their
    forward graphs) and the backward graphs compiled at their first backward; a step's share
    is ``perf/compile_s`` (0 where nothing compiled; a compile that finds its kernels in
    inductor's disk cache takes less)."""
    from torch._dynamo.utils import cumulative_time_spent_ns as spent

    return (spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0)) / 1e9


def compiled_frames() -> int:
    """Frames ``torch.compile`` has compiled in this process so far, recompilations included
    (a step that compiles after the first ones recompiles: ``perf/compiles``)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


class _TritonBuilds:
    """Triton kernel variants this process has built (compiled, or loaded from Triton's disk
    cache): one per kernel and specialization, counted by Triton's post-compile hook. A step
    that builds one after the first steps paid a compile inside its timed stages (a new row
    count's divisibility, say, where an argument is specialized)."""

    def __init__(self) -> None:
        self.count, self.installed, self.previous = 0, False, None

    def install(self) -> None:
        if self.installed:
            return
        self.installed = True
        try:
            from triton import knobs
        except Exception:  # (no triton, or one without knobs: the metric stays 0)
            return
        self.previous = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.previous(*args, **kwargs) if self.previous is not None else None


TRITON_BUILDS = _TritonBuilds()


def process_totals() -> dict[str, float]:
    """This process's running totals behind the per-step metrics ``perf/compiles``,
    ``perf/compile_s``, ``perf/triton_builds``, ``perf/gc_s`` and ``perf/gc_full`` (a step
    reports its difference)."""
    clock = gc_clock()
    TRITON_BUILDS.install()
    return {"perf/compiles": float(compiled_frames()), "perf/compile_s": compile_seconds(),
            "perf/triton_builds": float(TRITON_BUILDS.count), "perf/gc_s": clock.seconds,
            "perf/gc_full": float(clock.full)}
