"""One launch of the w4 fragment kernel (default dispatch config) and of the tile kernel at
M = 1, for Nsight Compute (see bench/w4_tile_ncu.py)."""
import sys

import torch

from quarl.quant.kernels import cuda_w4, launch
from quarl.quant.qweight import quantize_weight

for n, k in ((37888, 3584), (3584, 3584)):
    qw = quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, "w4a16")
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    launch.wo_gemm(x, qw, None)
    cuda_w4.w4a16_tile_gemm(x, qw, None, cuda_w4.TileKConfig(4, 4, 1, 1, 4, 2.0), counters=launch._counters)
torch.cuda.synchronize()
