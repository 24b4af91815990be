"""Where the CUDA W4A16 fragment kernel's time goes (GPU only; run-9 diagnosis).

Times kernel variants on the 7B shapes: the real kernel over warps per block / ring depth /
K split, and probes that keep the memory traffic but drop the arithmetic (flags 2), read
the same bytes in step-major instead of slab-major order (flags 1, wrong values: access
pattern only), or both. CUDA-graph replays over rotating weight sets, as in
quarl.quant.bench.

    PYTHONPATH=. python3 bench/frag_probe.py --out $OUT/frag_probe.json
"""

from __future__ import annotations

import argparse
import json

import torch

from quarl.quant import bench
from quarl.quant.kernels import cuda_w4, launch

SHAPES = [("gate_proj/up_proj", 18944, 3584), ("down_proj", 3584, 18944), ("q_proj/o_proj", 3584, 3584), ("k_proj/v_proj", 512, 3584)]
F = cuda_w4.FragConfig
CFGS = [F(nw, bps, st) for nw, st in ((4, 4), (4, 8), (8, 4), (8, 8), (2, 8)) for bps in (1.0, 2.0, 4.0)]
CFGS += [F(4, 2.0, 8, flags=f) for f in (1, 2, 3)] + [F(8, 2.0, 8, flags=f) for f in (1, 2, 3)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="16,1")
    args = ap.parse_args()
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    rows = []
    for m in map(int, args.ms.split(",")):
        for lbl, n, k in SHAPES:
            base = bench.time_per_call(bench.make_calls("bf16", m, n, k, dev, l2))
            gen = torch.Generator(device=dev).manual_seed(0)
            sets = bench._n_sets(n * k // 2, l2)
            big = bench.quantize_weight(torch.randn(sets * n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02, "w4a16")
            qws = [bench._slice_qw(big, i, n, k) for i in range(sets)]
            x = torch.randn(sets, m, k, device=dev, dtype=torch.bfloat16, generator=gen)
            best = None
            for cfg in CFGS:
                if cfg.flags and n * k < 2**26:  # probes on gate/up and down only
                    continue
                calls = [lambda i=i, c=cfg: cuda_w4.w4a16_frag_gemm(x[i], qws[i], None, c, counters=launch._counters) for i in range(sets)]
                try:
                    t = bench.time_per_call(calls)
                except Exception as e:
                    print(f"{lbl} M={m} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                tb = n * k * 0.5 / t / 1e12
                rows.append(dict(M=m, layer=lbl, N=n, K=k, cfg=cfg._asdict(), us=t * 1e6, bf16_us=base * 1e6, speedup=base / t, weight_TBps=tb))
                if cfg.flags == 0 and (best is None or t < best[0]):
                    best = (t, cfg)
                print(f"M={m:<3} {lbl:>17} nw={cfg.nw} bps={cfg.blocks_per_sm:<4} st={cfg.stages} flags={cfg.flags}: "
                      f"{t * 1e6:6.1f}us {base / t:4.2f}x weights {tb:4.2f} TB/s", flush=True)
            print(f"BEST M={m} {lbl}: {best[0] * 1e6:.1f}us {base / best[0]:.2f}x {best[1]}", flush=True)
            del big, qws, x
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
