"""One launch of the wgmma w4 kernel per (M, config), for Nsight Compute:

    ncu --section SpeedOfLight --section WarpStateStats -k regex:w4a16_wgmma python3 bench/w4_wgmma_ncu.py 37888,3584 "64:2,6,2;16:1,4,2"

(a config item is m:nwg,stages,blocks_per_sm[,single,minb[,tail[,cluster]]], flags 0 / 1)
"""
import sys

import torch

from quarl.quant.kernels import cuda_w4
from quarl.quant.kernels.config import WgConfig
from quarl.quant.qweight import quantize_weight

n, k = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "37888,3584").split(","))
qw = quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, "w4a16")
spec = sys.argv[2] if len(sys.argv) > 2 else "64:2,6,2;16:1,4,2"
for item in spec.split(";"):
    m, c = item.split(":")
    nwg, st, bps, *rest = c.split(",")  # [, single (0/1), minb[, tail, cluster]]
    x = torch.randn(int(m), k, device="cuda", dtype=torch.bfloat16)
    extra = tuple(int(v) if i == 1 else bool(int(v)) for i, v in enumerate(rest))
    cuda_w4.wgmma_gemm(x, qw, None, WgConfig(int(nwg), int(st), float(bps), *extra))
torch.cuda.synchronize()
