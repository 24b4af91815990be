"""What down_proj's fused activation quantizer adds to the SiLU-and-mul (GPU only): the
time of ``fused.silu_mul(g, u, quant=)`` minus the bf16 ``silu_mul(g, u)``, int8 and fp8,
at the given row counts (CUDA-graph replays over rotating input sets, as ``quarl bench gemm``).

    PYTHONPATH=. python3 bench/silu_quant_extra.py --ms 256,1024,4096 --out $OUT/silu_extra.json
"""
import argparse
import json
import time

import torch

from quarl.quant.bench import git_commit, time_per_call
from quarl.rollout import fused


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="256,1024,4096")
    ap.add_argument("--inter", type=int, default=18944)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for m in (int(v) for v in args.ms.split(",")):
        sets = 3
        gu = torch.randn(sets, m, 2 * args.inter, device="cuda", dtype=torch.bfloat16)
        g = [gu[i, :, : args.inter] for i in range(sets)]
        u = [gu[i, :, args.inter :] for i in range(sets)]
        base = time_per_call([lambda i=i: fused.silu_mul(g[i], u[i]) for i in range(sets)]) * 1e6
        for q in ("int8", "fp8"):
            t = time_per_call([lambda i=i: fused.silu_mul(g[i], u[i], quant=q) for i in range(sets)]) * 1e6
            rows.append(dict(M=m, inter=args.inter, quant=q, bf16_us=base, us=t, extra_us=t - base))
            print(f"M={m:5d} {q:5s} silu_mul {base:7.1f} us, with quantizer {t:7.1f} us (+{t - base:5.1f})", flush=True)
        del gu, g, u
    json.dump(dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), commit=git_commit(),
                   rows=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
