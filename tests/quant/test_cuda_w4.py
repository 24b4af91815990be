"""quarl.quant.kernels.cuda_w4's host side on CPU: the activation tensor map of the TMA loop."""

import ctypes

import pytest
import torch

from quarl.quant.kernels import cuda_w4


class _Driver:
    """cuTensorMapEncodeTiled as the driver takes it: records the arguments, fills the map."""

    def __init__(self, err=0):
        self.calls, self.err = [], err

    def cuTensorMapEncodeTiled(self, tmap, dtype, rank, addr, dims, strides, box, estrides, inter, swizzle, l2, oob):
        self.calls.append(dict(addr=ctypes.addressof(tmap), dtype=dtype, rank=rank, ptr=addr.value, dims=list(dims),
                               strides=list(strides), box=list(box), estrides=list(estrides), inter=inter,
                               swizzle=swizzle, l2=l2, oob=oob))
        tmap[0] = 0xABCD
        return self.err


def test_x_tensor_map_asks_the_driver_for_swizzled_64_column_boxes(monkeypatch):
    """A bf16 [M, K] view with a row stride wider than K: dims (K, M) innermost first, the row
    stride in bytes, boxes of 64 columns (128 bytes, the swizzle's span) x the tile's rows, the
    128-byte swizzle, zero fill; the map 64-byte aligned and kept per (address, shape, stride,
    rows), so a second call (a graph capture, a replayed step) does not encode again."""
    drv = _Driver()
    monkeypatch.setattr(torch.cuda._utils, "_get_gpu_runtime_library", lambda: drv)
    monkeypatch.setattr(cuda_w4, "_TMAPS", {})
    base = torch.zeros(37, 1560, dtype=torch.bfloat16)
    x = base[:, :1536]
    tmap = cuda_w4.x_tensor_map(x, 64)
    assert len(drv.calls) == 1
    c = drv.calls[0]
    assert c == dict(addr=ctypes.addressof(tmap), dtype=9, rank=2, ptr=x.data_ptr(), dims=[1536, 37],
                     strides=[1560 * 2], box=[64, 64], estrides=[1, 1], inter=0, swizzle=3, l2=3, oob=0)
    assert ctypes.addressof(tmap) % 64 == 0 and len(tmap) == 16 and tmap[0] == 0xABCD
    assert cuda_w4.x_tensor_map(x, 64) is tmap and len(drv.calls) == 1
    cuda_w4.x_tensor_map(x, 128)  # another tile height: another map
    cuda_w4.x_tensor_map(base[:20, :1536], 64)  # another shape at the same address
    assert [c["box"][1] for c in drv.calls] == [64, 128, 64] and drv.calls[2]["dims"] == [1536, 20]


def test_x_tensor_map_reports_the_driver_error(monkeypatch):
    monkeypatch.setattr(torch.cuda._utils, "_get_gpu_runtime_library", lambda: _Driver(err=1))
    monkeypatch.setattr(cuda_w4, "_TMAPS", {})
    with pytest.raises(RuntimeError,
                       match=r"cuTensorMapEncodeTiled failed for x \(8, 256\) stride 256: CUDA driver error 1"):
        cuda_w4.x_tensor_map(torch.zeros(8, 256, dtype=torch.bfloat16), 64)
    monkeypatch.setattr(torch.cuda._utils, "_get_gpu_runtime_library", lambda: object())
    with pytest.raises(RuntimeError, match="CUDA 12 or later driver"):
        cuda_w4.x_tensor_map(torch.zeros(8, 256, dtype=torch.bfloat16), 64)
