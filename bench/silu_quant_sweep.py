"""Run-14 sweep (GPU only): the MLP's SiLU-and-mul with down_proj's per-token quantizer
fused (``fused.silu_mul(g, u, quant=)``), at prefill / learner row counts, three ways:

* bf16: the SiLU-and-mul alone (what the bf16 engine runs; the quantizer's extra is
  measured against it);
* two kernels: SiLU-and-mul writing y and row-max partials, then the partials quantizer
  (the path up to ``SILU_QUANT_ROWS_MIN`` rows);
* persistent: ``_silu_mul_quant_rows_kernel`` (y through an L2-resident scratch row per
  program) for a grid of (programs per SM, block, warps).

Every candidate's codes are checked against ``act_quant(silu_mul(g, u))`` bit for bit once.
Timings: CUDA-graph replays over rotating input sets (quarl.quant.bench.time_per_call).

    PYTHONPATH=. python3 bench/silu_quant_sweep.py --out $OUT/silu_quant_sweep.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from quarl.quant import bench
from quarl.quant.kernels import launch
from quarl.rollout import fused

MS = (512, 1024, 4096)
# (programs per SM, block, warps)
PERSISTENT = [(4, 4096, 16), (4, 4096, 8), (6, 4096, 8), (8, 4096, 8), (2, 8192, 16), (4, 2048, 4), (8, 2048, 4),
              (16, 1024, 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--inter", type=int, default=18944)
    args = ap.parse_args()
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    inter = args.inter
    rows: list[dict] = []
    meta = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%S"), git_commit=bench.git_commit(),
                torch=torch.__version__, inter=inter, rows_min=fused.SILU_QUANT_ROWS_MIN, default=fused.SILU_QUANT_ROWS_CONFIG)
    for m in map(int, args.ms.split(",")):
        sets = bench._n_sets(2 * m * inter * 2, l2)
        x = torch.randn(sets, m, 2 * inter, device=dev, dtype=torch.bfloat16) * 3
        g = [x[i, :, :inter] for i in range(sets)]
        u = [x[i, :, inter:] for i in range(sets)]
        t_bf16 = bench.time_per_call([lambda i=i: fused.silu_mul(g[i], u[i]) for i in range(sets)])
        print(f"M={m:<5} bf16 silu_mul {t_bf16 * 1e6:8.1f} us", flush=True)
        rows.append(dict(M=m, fmt="bf16", cfg="silu_mul", us=t_bf16 * 1e6))
        for fmt in ("fp8", "int8"):
            q0, s0 = launch.act_quant(fused.silu_mul(g[0], u[0]), fmt)

            cands = [("two kernels", lambda i: fused.silu_mul(g[i], u[i], quant=fmt, persistent=False))] + [
                (f"persistent p{p} b{b} w{w}", lambda i, p=p, b=b, w=w: fused._silu_mul_quant_rows(g[i], u[i], fmt, p, b, w))
                for p, b, w in PERSISTENT]
            for name, fn in cands:
                t, err = bench.time_checked_codes(fn, (q0, s0), sets)
                if err:
                    print(f"M={m:<5} {fmt} {name}: {err}", flush=True)
                rows.append(dict(M=m, fmt=fmt, cfg=name, us=t * 1e6, bf16_us=t_bf16 * 1e6, extra_us=(t - t_bf16) * 1e6))
                print(f"M={m:<5} {fmt} {name:28} {t * 1e6:8.1f} us (extra over bf16 {(t - t_bf16) * 1e6:+7.1f} us)", flush=True)
        del x, g, u
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
