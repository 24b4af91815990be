"""The on-disk cache of NVRTC's binaries on a real GPU: a w4a16 kernel loaded from the cache
computes the same bits as the one just compiled, and loading it compiles nothing."""

import pytest
import torch

from quarl.quant import quant_linear, quantize_weight
from quarl.quant.kernels import cuda_w4, nvrtc_cache


def _clear_loaded_kernels():
    for builder in (cuda_w4._frag_kernel, cuda_w4._tile_kernel, cuda_w4._wgmma_kernel):
        builder.cache_clear()


@pytest.mark.parametrize("m", [1, 64, 128])
def test_a_kernel_loaded_from_the_cache_gives_the_bits_of_the_one_compiled(tmp_path, monkeypatch, m):
    monkeypatch.setenv(nvrtc_cache.ENV, str(tmp_path))
    _clear_loaded_kernels()
    qw = quantize_weight(torch.randn(4608, 3584, device="cuda") * 0.02, "w4a16")
    x = torch.randn(m, 3584, device="cuda", dtype=torch.bfloat16)
    compiled = quant_linear(x, qw)
    files = sorted(tmp_path.glob("*.cubin"))
    assert files and all(nvrtc_cache.read_entry(f) is not None for f in files)

    def no_nvrtc(*args):
        raise AssertionError(f"compiled again: {args[1]}")

    _clear_loaded_kernels()
    monkeypatch.setattr(nvrtc_cache, "_nvrtc", no_nvrtc)
    assert torch.equal(quant_linear(x, qw), compiled)
    assert sorted(tmp_path.glob("*.cubin")) == files
    _clear_loaded_kernels()
