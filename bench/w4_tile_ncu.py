"""One launch of the block-tiled w4 kernel per (M, config), for Nsight Compute:

    ncu --section SpeedOfLight --section WarpStateStats -k regex:w4a16 python3 bench/w4_tile_ncu.py
"""
import sys

import torch

from quarl.quant.kernels import cuda_w4, launch
from quarl.quant.qweight import quantize_weight

n, k = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "37888,3584").split(","))
qw = quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, "w4a16")
CFGS = [(64, (4, 4, 4, 1, 5, 1.0)), (64, (4, 4, 2, 2, 4, 2.0)), (8, (4, 4, 1, 1, 4, 2.0))]
if len(sys.argv) > 2:  # "M:sw,nt,mt,wm,stages,bps;..."
    CFGS = [(int(a), tuple(float(v) if i == 5 else int(v) for i, v in enumerate(b.split(","))))
            for a, b in (item.split(":") for item in sys.argv[2].split(";"))]
for m, c in CFGS:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    cuda_w4.w4a16_tile_gemm(x, qw, None, cuda_w4.TileKConfig(*c), counters=launch._counters)
torch.cuda.synchronize()
