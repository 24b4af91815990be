"""quarl.quant.kernels.cuda_w4's host side on CPU: the activation tensor map of the TMA loop, the stream-K launch."""

import ctypes

import pytest
import torch

from quarl.quant.kernels import cuda_w4
from quarl.quant.qweight import quantize_weight


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
    with pytest.raises(RuntimeError, match=r"cuTensorMapEncodeTiled failed for x \(8, 256\) stride 256: CUDA driver error 1"):
        cuda_w4.x_tensor_map(torch.zeros(8, 256, dtype=torch.bfloat16), 64)
    monkeypatch.setattr(torch.cuda._utils, "_get_gpu_runtime_library", lambda: object())
    with pytest.raises(RuntimeError, match="CUDA 12 or later driver"):
        cuda_w4.x_tensor_map(torch.zeros(8, 256, dtype=torch.bfloat16), 64)


def test_the_stream_k_launch_takes_a_block_a_sm_and_partials_for_the_cut_tiles(monkeypatch):
    """The host side of ``WgConfig.streamk`` on CPU: the stream-K entry, one block a SM (or
    ``blocks_per_sm`` of them), the producer's warpgroup, groups a tile as gpb, the most
    pieces of a tile as split with a partials stretch of that many tiles a token tile and the
    counters; no partials where no tile is cut; the gated output N / 2 wide."""
    from quarl.quant.kernels import splitk
    from quarl.quant.kernels.config import WgConfig

    built, launched = [], []
    monkeypatch.setattr(cuda_w4, "_wgmma_kernel", lambda *a: built.append(a) or "kernel")
    monkeypatch.setattr(cuda_w4, "launch", lambda kern, grid, block, args, smem: launched.append((grid, block, args)))
    monkeypatch.setattr(cuda_w4, "num_sms", lambda dev: 132)
    monkeypatch.setattr(cuda_w4, "x_tensor_map", lambda x, rows: f"tmap{rows}")
    n, k, m = 3584, 1024, 1000  # 28 column blocks x 4 token tiles of 256, 8 groups: 896 units on 132 blocks
    qw = quantize_weight(torch.randn(n, k) * 0.02, "w4a16")
    x = torch.randn(m, k, dtype=torch.bfloat16)
    cfg = WgConfig(2, 3, 1.0, prescale=True, tile=256, tma=True, producer=True, streamk=True)
    out = cuda_w4.wgmma_gemm(x, qw, None, cfg)
    assert out.shape == (m, n) and built[-1][15] is True and built[-1][14] is True
    (grid, block, args), = launched
    sk = splitk.stream_k(28 * 4, 8, 132)
    assert grid == (132, 1, 1) and block == (384, 1, 1) and sk.pieces > 1
    part, cnt = args[6], args[7]
    assert part.dtype == torch.float32 and part.numel() == 4 * sk.pieces * 256 * n and cnt.dtype == torch.int32
    assert (args[15], args[16], args[18]) == (8, sk.pieces, 0) and args[-1] == "tmap256"
    # one block a tile: no tile cut, no partials; gated: N / 2 columns
    launched.clear()
    whole = cfg._replace(blocks_per_sm=112 / 132)
    got = cuda_w4.wgmma_gemm(x, qw, None, whole, gated=True)
    (grid, _, args), = launched
    assert grid == (112, 1, 1) and args[6] is args[5] and got.shape == (m, n // 2) and built[-1][11] is True
    with pytest.raises(ValueError, match="streamk=True runs the producer loop"):
        cfg._replace(producer=False).check(m)
    with pytest.raises(ValueError, match="streamk=True runs the producer loop"):
        cfg._replace(halves=True, stages=6).check(m)
