"""Probe where the CUDA W4A16 fragment kernel's time goes (GPU only; run-9 diagnosis).

Variants of the same kernel on the 7B gate/up and down shapes: no activation loads, no
mma (unpacked words xor-ed instead), coherent instead of read-only weight loads, ring
depths 4 / 8 / 16, warps per block and K split. Times are CUDA-graph replays over
rotating weight sets (quarl.quant.bench.time_per_call).

    PYTHONPATH=. python3 bench/frag_probe.py --out $OUT/frag_probe.json
"""

from __future__ import annotations

import argparse
import json

import torch

from quarl.quant import bench
from quarl.quant.kernels import cuda_w4, launch

SHAPES = [("gate_proj/up_proj", 18944, 3584), ("down_proj", 3584, 18944), ("q_proj/o_proj", 3584, 3584)]
CFGS = [
    cuda_w4.FragConfig(4, 1.0), cuda_w4.FragConfig(4, 1.0, variant=1), cuda_w4.FragConfig(4, 1.0, variant=2),
    cuda_w4.FragConfig(4, 1.0, variant=3), cuda_w4.FragConfig(4, 1.0, variant=4),
    cuda_w4.FragConfig(4, 1.0, stages=4), cuda_w4.FragConfig(4, 1.0, stages=16),
    cuda_w4.FragConfig(8, 1.0), cuda_w4.FragConfig(2, 2.0), cuda_w4.FragConfig(4, 4.0), cuda_w4.FragConfig(8, 4.0),
    cuda_w4.FragConfig(4, 4.0, stages=16), cuda_w4.FragConfig(2, 8.0, stages=16),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,16")
    args = ap.parse_args()
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    rows = []
    for m in map(int, args.ms.split(",")):
        for lbl, n, k in SHAPES:
            base = bench.time_per_call(bench.make_calls("bf16", m, n, k, dev, l2))
            sc = "w4a16"
            gen = torch.Generator(device=dev).manual_seed(0)
            sets = bench._n_sets(n * k // 2, l2)
            big = bench.quantize_weight(torch.randn(sets * n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02, sc)
            qws = [bench._slice_qw(big, i, n, k) for i in range(sets)]
            x = torch.randn(sets, m, k, device=dev, dtype=torch.bfloat16, generator=gen)
            for cfg in CFGS:
                calls = [lambda i=i, c=cfg: cuda_w4.w4a16_frag_gemm(x[i], qws[i], None, c, counters=launch._counters) for i in range(sets)]
                try:
                    t = bench.time_per_call(calls)
                except Exception as e:
                    print(f"{lbl} M={m} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                tb = n * k * 0.5 / t / 1e12
                rows.append(dict(M=m, layer=lbl, N=n, K=k, cfg=cfg._asdict(), us=t * 1e6, bf16_us=base * 1e6, speedup=base / t, weight_TBps=tb))
                print(f"M={m:<3} {lbl:>17} nw={cfg.nw} bps={cfg.blocks_per_sm:<4} st={cfg.stages:<2} var={cfg.variant}: "
                      f"{t * 1e6:6.1f}us {base / t:4.2f}x weights {tb:4.2f} TB/s", flush=True)
            del big, qws, x
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
