"""What a dispatch row hands out: a kernel name and its config (:class:`Plan`), and how to launch it."""

from __future__ import annotations

from typing import NamedTuple, Union

from quarl.quant.kernels import cuda_w4, w8a8, weight_only
from quarl.quant.kernels.config import FragConfig, TileConfig, TileKConfig, WgConfig

Config = Union[TileConfig, FragConfig, TileKConfig, WgConfig, None]

# weight-only kernels: (x, qw, bias, cfg, repacked) -> y
_WEIGHT_ONLY = {
    "frag": cuda_w4.frag_gemm,
    "tile": cuda_w4.tile_gemm,
    "wgmma": cuda_w4.wgmma_gemm,
    "swap": lambda x, qw, bias, cfg, repacked=None: weight_only.swap_gemm(x, qw, bias, cfg),
    "tiled": lambda x, qw, bias, cfg, repacked=None: weight_only.tiled_gemm(x, qw, bias, cfg),
    "dequant": lambda x, qw, bias, cfg, repacked=None: weight_only.dequant_gemm(x, qw, bias, repacked=repacked),
}
# kernels on quantized activations: (xq, sx, qw, bias, out_dtype, cfg) -> y
_QUANTIZED_INPUT = {
    "pointer": w8a8.pointer_gemm,
    "tma": w8a8.tma_gemm,
    "cublas": w8a8.cublas_gemm,
    "w4a8": w8a8.w4a8_gemm,
}


class Plan(NamedTuple):
    """A kernel (a key of the runner maps above, or ``"gated"``) and its config."""

    kernel: str
    config: Config = None

    def run(self, *args, repacked=None):
        """Weight-only: ``run(x, qw, bias, repacked=cache)``. Quantized input: ``run(xq, sx,
        qw, bias, out_dtype)``. Gated: ``run(xq, sx, qw, out_dtype)`` -> ``(y, amax)`` or None."""
        if self.kernel in _WEIGHT_ONLY:
            return _WEIGHT_ONLY[self.kernel](*args, self.config, repacked=repacked)
        if self.kernel == "gated":
            return w8a8.gated_gemm(*args, self.config)
        return _QUANTIZED_INPUT[self.kernel](*args, self.config)
