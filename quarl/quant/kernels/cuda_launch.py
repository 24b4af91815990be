"""Launching quarl's NVRTC-compiled CUDA kernels (``torch.cuda._compile_kernel``), as
programmatic dependent launches where :func:`~.device.dependent_launches` asks for them.

torch's launcher (``_CudaKernel.__call__``) calls ``cuLaunchKernel``, which takes no launch
attributes. Inside ``dependent_launches`` on Hopper or later, :func:`launch` calls
``cuLaunchKernelEx`` with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` instead:
the kernel may be scheduled while the one ahead on the stream still runs, and its first
instruction (``wait_ahead`` in the ``.cu`` sources: ``griddepcontrol.wait``) waits until that
one has finished and its writes are visible. Results are those of a plain launch; what is
hidden is the gap between two kernels (a CUDA graph captured inside keeps the edges).
The argument marshalling is torch's: a tensor passes its data pointer, an int a C ``int``,
a float a C ``double``; and a ctypes array passes its bytes by value (a ``CUtensorMap``), which
torch's launcher cannot, so a launch with one always goes through ``cuLaunchKernelEx``.
"""
from __future__ import annotations

import ctypes
from typing import Any, Sequence

import torch

from quarl.quant.kernels.device import dependent

# cuda.h: CUlaunchAttributeID
PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: the id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_ubyte * 64)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""

    _fields_ = [
        ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint),
    ]


def kernel_params(args: Sequence[Any]) -> tuple[ctypes.Array, list]:
    """``void* params[]`` for ``args`` and the C values it points at (keep them alive until
    the launch has returned)."""
    held: list = []
    for a in args:
        if isinstance(a, torch.Tensor):
            held.append(ctypes.c_void_p(a.data_ptr()))
        elif isinstance(a, ctypes.Array):
            held.append(a)
        elif not isinstance(a, (int, float)):
            raise TypeError(f"a kernel argument must be a tensor, an int, a float or a ctypes array, "
                            f"got {type(a).__name__}")
        elif isinstance(a, int):
            held.append(ctypes.c_int(a))
        else:
            held.append(ctypes.c_double(a))
    params = (ctypes.c_void_p * len(held))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in held])
    return params, held


def launch_config(grid: Sequence[int], block: Sequence[int], shared_mem: int, stream: int,
                  attrs: ctypes.Array) -> LaunchConfig:
    return LaunchConfig(*grid, *block, shared_mem, stream, attrs, len(attrs))


def serialization_attrs() -> ctypes.Array:
    """The one attribute of a programmatic dependent launch."""
    attrs = (LaunchAttribute * 1)()
    attrs[0].id = PROGRAMMATIC_STREAM_SERIALIZATION
    ctypes.c_int.from_buffer(attrs[0].value).value = 1  # programmaticStreamSerializationAllowed
    return attrs


def launch(kernel, grid: Sequence[int], block: Sequence[int], args: Sequence[Any], shared_mem: int = 0,
           device: torch.device | None = None) -> None:
    """``kernel(grid=grid, block=block, args=args, shared_mem=shared_mem)`` on the current
    stream, as a programmatic dependent launch where :func:`~.device.dependent` says so for
    ``device`` (default: the first tensor argument's)."""
    if device is None:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    by_value = any(isinstance(a, ctypes.Array) for a in args)
    pdl = dependent(device)
    lib = torch.cuda._utils._get_gpu_runtime_library() if pdl or by_value else None
    if lib is None or not hasattr(lib, "cuLaunchKernelEx"):  # (a driver before CUDA 12: plain launches)
        if by_value:
            raise RuntimeError("a kernel argument passed by value (a tensor map) needs cuLaunchKernelEx: "
                               "a CUDA 12 or later driver")
        kernel(grid=tuple(grid), block=tuple(block), args=list(args), shared_mem=shared_mem)
        return
    if shared_mem >= 48 * 1024 and shared_mem > kernel._max_shared_mem_bytes:
        raise RuntimeError(f"the kernel needs {shared_mem} bytes of shared memory; call set_shared_memory_config first")
    params, held = kernel_params(args)
    attrs = serialization_attrs() if pdl else (LaunchAttribute * 0)()
    cfg = launch_config(grid, block, shared_mem, torch.cuda.current_stream(device).cuda_stream, attrs)
    err = lib.cuLaunchKernelEx(ctypes.byref(cfg), kernel.func, params, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed: CUDA driver error {err}")
    del held
