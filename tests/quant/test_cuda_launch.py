"""quarl.quant.kernels.cuda_launch: the driver structs as cuda.h lays them out, torch's argument
marshalling, and which launcher runs (the launch itself is tested on the GPU: tests_gpu/quant)."""

import ctypes

import pytest
import torch

from quarl.quant.kernels import cuda_launch
from quarl.quant.kernels.cuda_launch import LaunchAttribute, LaunchConfig, kernel_params, launch, serialization_attrs
from quarl.quant.kernels.device import dependent_launches


def test_driver_structs_have_cuda_h_layout():
    # CUlaunchAttribute: id (4) + pad (4) + a 64-byte union; CUlaunchConfig on a 64-bit host
    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(LaunchConfig) == 56
    assert (LaunchConfig.sharedMemBytes.offset, LaunchConfig.hStream.offset, LaunchConfig.attrs.offset,
            LaunchConfig.numAttrs.offset) == (24, 32, 40, 48)
    a = serialization_attrs()
    assert len(a) == 1 and a[0].id == 6
    assert ctypes.c_int.from_buffer(a[0].value).value == 1 and not any(a[0].value[4:])


def test_kernel_params_point_at_torch_style_values():
    t = torch.arange(4)
    params, held = kernel_params([t, 7, -3, True, 0.25])
    assert len(params) == 5
    assert ctypes.c_void_p.from_address(params[0]).value == t.data_ptr()
    assert [ctypes.c_int.from_address(params[i]).value for i in (1, 2, 3)] == [7, -3, 1]
    assert ctypes.c_double.from_address(params[4]).value == 0.25
    with pytest.raises(TypeError, match="tensor, an int, a float or a ctypes array"):
        kernel_params(["x"])


def test_a_ctypes_array_is_passed_by_value():
    """A tensor map (128 opaque bytes) goes into the kernel's parameters as its bytes: the
    parameter points at the array itself."""
    tmap = (ctypes.c_uint64 * 16)(*range(100, 116))
    params, held = kernel_params([3, tmap])
    assert params[1] == ctypes.addressof(tmap)
    assert list((ctypes.c_uint64 * 16).from_address(params[1])) == list(range(100, 116))


class _Kernel:
    def __init__(self):
        self.calls, self.func, self._max_shared_mem_bytes = [], ctypes.c_void_p(1234), 100_000

    def __call__(self, **kw):
        self.calls.append(kw)


def test_plain_launch_outside_the_block_or_before_hopper(monkeypatch):
    k = _Kernel()
    t = torch.zeros(2)
    launch(k, (3, 2, 1), (128, 1, 1), [t, 5], 1024)
    with dependent_launches():  # a CPU tensor: no grid dependency control
        launch(k, (3, 2, 1), (128, 1, 1), [t, 5])
    assert [c["grid"] for c in k.calls] == [(3, 2, 1)] * 2
    assert k.calls[0] == {"grid": (3, 2, 1), "block": (128, 1, 1), "args": [t, 5], "shared_mem": 1024}


def _fake_driver(monkeypatch, dependent: bool, record) -> None:
    """``cuLaunchKernelEx`` calls ``record(config, func, params, extra)`` (its return: the
    driver's error code); the current stream's handle is 0xABC0."""

    class _Lib:
        def cuLaunchKernelEx(self, cfg_ref, func, params, extra):
            return record(ctypes.cast(cfg_ref, ctypes.POINTER(LaunchConfig)).contents, func, params, extra)

    class _Stream:
        cuda_stream = 0xABC0

    monkeypatch.setattr(cuda_launch, "dependent", lambda device: dependent)
    monkeypatch.setattr(torch.cuda._utils, "_get_gpu_runtime_library", lambda: _Lib())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())


def test_dependent_launch_goes_through_cuLaunchKernelEx(monkeypatch):
    seen = {}

    def record(cfg, func, params, extra):
        seen.update(grid=(cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ),
                    block=(cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ),
                    smem=cfg.sharedMemBytes, stream=cfg.hStream, n=cfg.numAttrs, attr=cfg.attrs[0].id,
                    allowed=ctypes.c_int.from_buffer(cfg.attrs[0].value).value, func=func.value, extra=extra,
                    args=[ctypes.c_int.from_address(p).value for p in params[1:]])
        return seen.get("err", 0)

    _fake_driver(monkeypatch, True, record)
    k = _Kernel()
    launch(k, (5, 1, 1), (256, 1, 1), [torch.zeros(1), 9, 11], 65536, device=torch.device("cpu"))
    assert not k.calls
    assert seen == {"grid": (5, 1, 1), "block": (256, 1, 1), "smem": 65536, "stream": 0xABC0, "n": 1, "attr": 6,
                    "allowed": 1, "func": 1234, "extra": None, "args": [9, 11]}
    with pytest.raises(RuntimeError, match="shared memory"):
        launch(k, (1, 1, 1), (32, 1, 1), [9], 200_000, device=torch.device("cpu"))
    seen["err"] = 1
    with pytest.raises(RuntimeError, match="cuLaunchKernelEx failed: CUDA driver error 1"):
        launch(k, (1, 1, 1), (32, 1, 1), [9], device=torch.device("cpu"))


def test_a_by_value_argument_takes_cuLaunchKernelEx_without_the_dependency_attribute(monkeypatch):
    """Outside ``dependent_launches`` a launch with a tensor map still goes through the driver
    (torch's launcher cannot pass it), with no launch attribute; a driver without
    cuLaunchKernelEx is a clear error, not a launch with wrong arguments."""
    seen = {}

    def record(cfg, func, params, extra):
        seen.update(n=cfg.numAttrs, first=ctypes.c_int.from_address(params[0]).value,
                    tmap=list((ctypes.c_uint64 * 16).from_address(params[1])))
        return 0

    _fake_driver(monkeypatch, False, record)
    k = _Kernel()
    tmap = (ctypes.c_uint64 * 16)(*range(16))
    launch(k, (1, 1, 1), (32, 1, 1), [7, tmap], device=torch.device("cpu"))
    assert not k.calls and seen == {"n": 0, "first": 7, "tmap": list(range(16))}
    monkeypatch.setattr(torch.cuda._utils, "_get_gpu_runtime_library", lambda: object())
    with pytest.raises(RuntimeError, match="by value .* cuLaunchKernelEx"):
        launch(k, (1, 1, 1), (32, 1, 1), [7, tmap], device=torch.device("cpu"))


def test_a_driver_without_cuLaunchKernelEx_gets_plain_launches(monkeypatch):
    monkeypatch.setattr(cuda_launch, "dependent", lambda device: True)
    monkeypatch.setattr(torch.cuda._utils, "_get_gpu_runtime_library", lambda: object())
    k = _Kernel()
    launch(k, (2, 1, 1), (64, 1, 1), [3], device=torch.device("cpu"))
    assert k.calls == [{"grid": (2, 1, 1), "block": (64, 1, 1), "args": [3], "shared_mem": 0}]
