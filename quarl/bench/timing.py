"""How every GPU benchmark times: the device's ceilings and median CUDA-event times of
calls replayed in a CUDA graph over rotating operand sets (so the weights come from DRAM,
not L2, as in a real model's forward).

A GPU at its power limit lowers its clocks within tens of milliseconds of a compute-bound
load (an H200 at 700 W: 1980 MHz for the first 50-80 ms of bf16 GEMMs, then 1450-1650), so
a compute-bound timing depends on what ran just before it. :func:`time_per_call` can pin
the state (``power``): ``"burst"`` times a few replays right after the GPU has cooled down
(no power-cap clock reason, clocks free), ``"sustained"`` times after half a second of
the same load (the cap's steady state, as in a long run); ``None`` times as it finds it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from statistics import median
from typing import Callable

import torch

from quarl.runtime import median_cuda_time


@dataclass
class Ceilings:
    bandwidth: float  # bytes/s (read + write)
    bf16_flops: float
    fp8_flops: float


def measure_ceilings(device: torch.device, power: str | None = None, gate: "PowerGate | None" = None) -> Ceilings:
    """Copy bandwidth (512 MiB device to device) and the bf16 / fp8 rates of an 8192^3 product
    (with ``power``, each timed in that power state, :func:`time_per_call`)."""
    a = torch.randn(256 * 2**20, device=device, dtype=torch.bfloat16)  # 512 MiB
    b = torch.empty_like(a)
    b.copy_(a)

    def timed(fn) -> float:
        return time_per_call([fn], reps=20, min_calls=1, graph=False, power=power, gate=gate)

    t_copy = timed(lambda: b.copy_(a))
    a = b = None  # (frees the copy's buffers before the GEMMs' own)
    n = 8192
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    t_bf16 = timed(lambda: x @ y)
    x8, y8 = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn).t().contiguous().t()
    one_m, one_n = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)

    def fp8():
        return torch._scaled_mm(x8, y8, scale_a=one_m, scale_b=one_n, out_dtype=torch.bfloat16)

    t_fp8 = timed(fp8)
    return Ceilings(2 * 512 * 2**20 / t_copy, 2 * n**3 / t_bf16, 2 * n**3 / t_fp8)


POWER_MODES = ("burst", "sustained")
SLOWDOWN_REASONS = ~0x1  # every clock-event reason but idle (ClockWatch's bitmask)


@dataclass
class PowerGate:
    """Brings the GPU to a known power state before a timing, from ``nvidia-smi`` readings
    (:class:`~quarl.bench.common.ClockWatch`'s, of GPU ``gpu``: nvidia-smi's index; None, that
    of the current CUDA device, :func:`nvidia_smi_index`). ``burst_s``: seconds of load
    a burst times (under the 50-80 ms an H200 ran unclamped); ``settle_s``: load before a
    sustained timing; ``rest_s`` / ``timeout_s``: the shortest and longest cool-down (without
    ``nvidia-smi``, a cool-down is ``fallback_s`` of sleep)."""

    gpu: int | None = None
    burst_s: float = 0.03
    bursts: int = 3
    settle_s: float = 0.5
    rest_s: float = 0.6
    timeout_s: float = 6.0
    fallback_s: float = 1.5
    watch: object = None
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.perf_counter
    timer: Callable[[Callable[[], object]], float] | None = None  # seconds of one call (CUDA events)

    def reading(self) -> dict | None:
        """This GPU's reading now (``sm_mhz``, ``power_w``, ``reasons`` ...), or None."""
        if self.watch is None:
            from quarl.bench.common import ClockWatch

            self.watch = ClockWatch()
        if self.watch.command is None:
            return None
        if self.gpu is None:
            self.gpu = nvidia_smi_index(torch.device("cuda", torch.cuda.current_device()))
        rows = [r for r in self.watch.sample() if r["gpu"] == self.gpu]
        return rows[0] if rows else None

    def cool_down(self) -> dict | None:
        """Idle until no clock-event reason but idle is active (at least ``rest_s``, at most
        ``timeout_s``); the last reading (None without readings)."""
        self.sleep(self.rest_s)
        waited = self.rest_s
        while True:
            r = self.reading()
            if r is None:
                self.sleep(max(0.0, self.fallback_s - self.rest_s))
                return None
            if not r["reasons"] & SLOWDOWN_REASONS or waited >= self.timeout_s:
                return r
            self.sleep(0.1)
            waited = round(waited + 0.1, 6)

    def time(self, replay: Callable[[], object], power: str, reps: int, info: dict | None = None) -> float:
        """Median seconds of ``replay()`` in state ``power`` (one of :data:`POWER_MODES`): a
        burst is ``bursts`` cool-downs, each followed by one untimed replay and timed ones up to
        ``burst_s`` of load (at least one, ``ceil(reps / bursts)`` at most); sustained is ``settle_s``
        of replays, then ``reps`` timed ones. ``info`` gets the state's reading (before a burst's
        first replay, after the sustained timing) and the replays timed."""
        timer = self.timer or _event_seconds
        if power not in POWER_MODES:
            raise ValueError(f"power state {power!r}: use one of {', '.join(POWER_MODES)}")
        times: list[float] = []
        if power == "burst":
            each = max(1, -(-reps // self.bursts))
            for b in range(self.bursts):
                r = self.cool_down()
                if b == 0 and info is not None:
                    info.update(reading=r)
                replay()
                load, mine = 0.0, len(times) + each
                while load < self.burst_s and len(times) < mine:
                    times.append(timer(replay))
                    load += times[-1]
        else:
            t_end = self.clock() + self.settle_s
            while self.clock() < t_end:
                timer(replay)
            times = [timer(replay) for _ in range(reps)]
            if info is not None:
                info.update(reading=self.reading())
        if info is not None:
            info.update(power=power, replays=len(times))
        return median(times)


def nvidia_smi_index(device: torch.device) -> int:
    """``nvidia-smi``'s index of a CUDA device: its place in ``CUDA_VISIBLE_DEVICES`` where
    that lists indices, else its own."""
    import os

    idx = device.index if device.index is not None else torch.cuda.current_device()
    vis = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if idx < len(vis) and vis[idx].isdigit():
        return int(vis[idx])
    return idx


def _event_seconds(fn: Callable[[], object]) -> float:
    return median_cuda_time(fn, 1)


def time_per_call(calls: list[Callable[[], object]], reps: int = 20, min_calls: int = 8, graph: bool = True,
                  power: str | None = None, gate: PowerGate | None = None, info: dict | None = None) -> float:
    """Median seconds per call of ``calls`` (rotating sets) replayed in a CUDA graph; with
    ``power``, timed in that power state by ``gate`` (:class:`PowerGate`; ``info`` gets its
    reading)."""
    seq = calls * max(1, math.ceil(min_calls / len(calls)))
    for f in calls:  # compile / autotune / handle creation outside the timing
        f()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for f in calls:
                f()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(g):
            for f in seq:
                f()
        g.replay()
        torch.cuda.synchronize()
        replay = g.replay
    else:
        def replay():
            for f in seq:
                f()

    if power is not None:
        return (gate or PowerGate()).time(replay, power, reps, info) / len(seq)
    return median_cuda_time(replay, reps) / len(seq)


def n_sets(bytes_per_set: int, l2: int) -> int:
    """Rotating operand sets of ``bytes_per_set`` each that exceed ``l2`` bytes three times
    (2 to 128 sets)."""
    return int(min(128, max(2, math.ceil(3 * l2 / max(bytes_per_set, 1)))))
