"""How every GPU benchmark times: the device's ceilings and median CUDA-event times of
calls replayed in a CUDA graph over rotating operand sets (so the weights come from DRAM,
not L2, as in a real model's forward)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from quarl.runtime import median_cuda_time


@dataclass
class Ceilings:
    bandwidth: float  # bytes/s (read + write)
    bf16_flops: float
    fp8_flops: float


def measure_ceilings(device: torch.device) -> Ceilings:
    """Copy bandwidth (512 MiB device to device) and the bf16 / fp8 rates of an 8192^3 product."""
    a = torch.randn(256 * 2**20, device=device, dtype=torch.bfloat16)  # 512 MiB
    b = torch.empty_like(a)
    b.copy_(a)
    t_copy = median_cuda_time(lambda: b.copy_(a), 20)
    del a, b
    n = 8192
    x, y = torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device, dtype=torch.bfloat16)
    x @ y
    t_bf16 = median_cuda_time(lambda: x @ y, 20)
    x8, y8 = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn).t().contiguous().t()
    one_m, one_n = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)

    def fp8():
        return torch._scaled_mm(x8, y8, scale_a=one_m, scale_b=one_n, out_dtype=torch.bfloat16)

    fp8()
    t_fp8 = median_cuda_time(fp8, 20)
    return Ceilings(2 * 512 * 2**20 / t_copy, 2 * n**3 / t_bf16, 2 * n**3 / t_fp8)


def time_per_call(calls: list[Callable[[], object]], reps: int = 20, min_calls: int = 8, graph: bool = True) -> float:
    """Median seconds per call of ``calls`` (rotating sets) replayed in a CUDA graph."""
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
        return median_cuda_time(g.replay, reps) / len(seq)

    def run_all():
        for f in seq:
            f()

    return median_cuda_time(run_all, reps) / len(seq)


def n_sets(bytes_per_set: int, l2: int) -> int:
    """Rotating operand sets of ``bytes_per_set`` each that exceed ``l2`` bytes three times
    (2 to 128 sets)."""
    return int(min(128, max(2, math.ceil(3 * l2 / max(bytes_per_set, 1)))))
