"""What the kernels need to know about the GPU: its SM count and its generation's row set."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

# Row sets of the dispatch tables. "sm80" also stands for every other mma.sync GPU that is
# not sm90 (sm86, sm100, sm120); "none": no CUDA w4 kernel can run (no NVRTC, a pre-sm80
# GPU, a CPU tensor under the Triton interpreter, fp16 activations).
GENS = ("sm80", "sm89", "sm90", "none")


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=1)
def nvrtc_available() -> bool:
    """NVRTC compilation through torch is there and the GPU has mma.sync bf16 (sm80+)."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "_compile_kernel"):
        return False
    return torch.cuda.get_device_capability()[0] >= 8


@functools.lru_cache(maxsize=8)
def _cuda_gen(device: torch.device) -> str:
    if not nvrtc_available():
        return "none"
    cap = torch.cuda.get_device_capability(device)
    if cap == (9, 0):
        return "sm90"
    if cap == (8, 9):
        return "sm89"
    return "sm80" if cap[0] >= 8 else "none"


def gpu_gen(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """The row set for activations of ``dtype`` on ``device`` (the CUDA w4 kernels take bf16)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return "none"
    return _cuda_gen(device)


# ---------------------------------------------------------------- dependent launches
# a plain global, not a ContextVar: kernels launched inside torch.compile regions (the
# learner's) read it while being traced, and a module global traces as a constant
_DEPENDENT = False


@contextlib.contextmanager
def dependent_launches(on: bool = True) -> Iterator[None]:
    """Inside the block, quarl's Triton kernels (``pdl``) and its NVRTC-compiled CUDA kernels
    (:func:`~.cuda_launch.launch`) are launched as programmatic dependent launches (Hopper and
    later): a kernel may be scheduled while the one ahead of it on the stream still runs, and
    waits in its first instruction until that one has finished and its writes are visible
    (``griddepcontrol.wait``), so results are unchanged and only the launch latency between
    two kernels is hidden. The engine turns it on around its decode
    forward (``EngineConfig.dependent_launches``); a CUDA graph captured inside keeps it."""
    global _DEPENDENT
    before, _DEPENDENT = _DEPENDENT, on
    try:
        yield
    finally:
        _DEPENDENT = before


@functools.lru_cache(maxsize=8)
def _has_grid_dependency_control(device: torch.device) -> bool:
    """Compute capability 9 or more (asked once per device: every decode kernel's launch asks)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def dependent(device: torch.device) -> bool:
    """Whether a kernel launched now on ``device`` goes as a programmatic dependent launch:
    inside :func:`dependent_launches`, on a GPU of compute capability 9 or more."""
    return _DEPENDENT and _has_grid_dependency_control(device)


def pdl(device: torch.device) -> dict:
    """Launch options of a quarl Triton kernel on ``device``: ``PDL`` (the kernel's constexpr
    that waits on the kernel ahead) and Triton's ``launch_pdl``, both on only inside
    :func:`dependent_launches` on a GPU that has them."""
    if not dependent(device):
        return {"PDL": False}  # (passed, not left to the kernel's default: inductor's launcher for a
        # user kernel in a compiled region miscounts its arguments when a constexpr is left out)
    return {"PDL": True, "launch_pdl": True}
