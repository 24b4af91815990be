"""Profiling one call: the GPU kernels it ran (torch.profiler) or where the host's time went
(cProfile), as a text table (``quarl bench train --profile``, ``quarl bench learner``)."""

from __future__ import annotations

import collections
import contextlib
import warnings
from pathlib import Path
from typing import Iterator

import torch

from quarl.bench.common import gaps_lines, idle_gaps

PROFILES = ("kernels", "host")
PROFILED_STAGES = ("learner", "publish")


def profile_call(fn, label: str, top: int = 30, what: str = "kernels"):
    """``fn()`` profiled: its result and a text table.

    ``kernels``: under torch.profiler (GPU activity only, the least host overhead), the GPU
    kernels by total time (ms, share, launches, name) headed by the wall, the busy time and
    the device syncs ``fn`` made (with their source lines); on a CPU, ops by self time.
    ``host``: under cProfile, where the host's time goes (functions by cumulative time),
    headed by the host time and the wall including the wait for the GPU. A learner whose
    busy share is low is bound by the host: read the ``host`` table next."""
    import time

    if what not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {what!r}")
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    if what == "host":
        return _profile_host(fn, label, top, sync)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof, \
            _counting_syncs(cuda) as syncs:
        t0 = time.perf_counter()
        result = fn()
        sync()
        wall = time.perf_counter() - t0
    kernels: dict[str, list[float]] = {}
    gaps = None
    if cuda:
        kernels = gpu_kernels(prof)
        gaps = idle_gaps([(e.name[:60], e.time_range.start, e.time_range.end) for e in prof.events()
                          if e.device_type.name == "CUDA"])
    else:
        for e in prof.key_averages():
            kernels[e.key[:100]] = [e.self_cpu_time_total, e.count]
    busy = sum(t for t, _ in kernels.values()) / 1e6
    kind = "GPU kernels" if cuda else "CPU ops (self)"
    lines = [f"{label}: wall {wall:.3f} s under the profiler, {kind} {busy:.3f} s "
             f"({busy / wall:.0%} busy), {sum(n for _, n in kernels.values())} launches"]
    if cuda:
        lines.append(f"  device syncs: {sum(syncs.values())}"
                     + "".join(f", {n}x {site}" for site, n in syncs.most_common(5)))
        lines.extend(gaps_lines(gaps))
    for kname, (t, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {t / 1e3:9.1f} ms {t / 1e4 / max(busy, 1e-12):5.1f}% {n:6d}x  {kname}")
    return result, "\n".join(lines)


def gpu_kernels(prof) -> dict[str, list[float]]:
    """The GPU kernels a torch.profiler run saw: ``name -> [total us, launches]``."""
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            k = kernels.setdefault(e.name[:100], [0.0, 0])
            k[0] += e.device_time
            k[1] += 1
    return kernels


@contextlib.contextmanager
def _counting_syncs(cuda: bool) -> Iterator[collections.Counter]:
    """Device syncs made inside the block, by source line (``torch.cuda``'s sync debug mode)."""
    sites: collections.Counter = collections.Counter()
    if not cuda:
        yield sites
        return
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites.update(f"{Path(w.filename).name}:{w.lineno}" for w in log if "synchroniz" in str(w.message))


def _profile_host(fn, label: str, top: int, sync):
    import cProfile
    import io
    import pstats
    import time

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    result = fn()
    host = time.perf_counter() - t0
    sync()
    prof.disable()
    wall = time.perf_counter() - t0
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    rows = [ln for ln in buf.getvalue().splitlines() if ln.strip() and ln.lstrip()[:1].isdigit()]
    head = f"{label}: host {host:.3f} s under cProfile, wall {wall:.3f} s with the wait for the device"
    return result, "\n".join([head, "  ncalls  tottime  percall  cumtime  percall filename:lineno(function)"] + rows)
