"""Run-13 sweep (GPU only): the MLP's gate/up -> down input on the 7B shape (hidden 3584,
intermediate 18944), three ways, timed as the engine runs them at each M:

* bf16: ``F.linear`` gate_up, then the SiLU-and-mul kernel;
* plain W8A8: the GEMM on codes (default dispatch), then SiLU-and-mul writing y and row-max
  partials, then the partials quantizer (``fused.silu_mul(..., quant=)``);
* gated W8A8: one GEMM with SiLU-and-mul in its epilogue, then the partials quantizer, for
  several tiles of ``w8a8_tma_kernel`` (GATED).

Every gated candidate's codes are checked against the plain path's bit for bit once.
Timings: CUDA-graph replays over rotating weight sets (quarl.quant.bench.time_per_call).

    PYTHONPATH=. python3 bench/gated_sweep.py --out $OUT/gated_sweep.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from quarl.quant import bench
from quarl.quant.kernels import launch
from quarl.quant.kernels import dispatch, w8a8
from quarl.quant.kernels.config import TileConfig as C
from quarl.quant.qweight import quantize_weight
from quarl.quant.scheme import get_scheme
from quarl.rollout import fused

HIDDEN, INTER = 3584, 18944
MS = (17, 32, 64, 128, 256, 512)
# (bm, bn, bk, warps, stages, resident programs per SM)
GATED = [(64, 64, 128, 4, 4, 2), (64, 64, 128, 4, 3, 3), (64, 32, 128, 4, 4, 3), (64, 32, 128, 4, 6, 3),
         (64, 64, 64, 4, 6, 2), (64, 64, 128, 8, 4, 2), (64, 128, 128, 8, 3, 1), (128, 64, 128, 8, 3, 1),
         (128, 128, 128, 8, 3, 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    args = ap.parse_args()
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    rows: list[dict] = []
    meta = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%S"), git_commit=bench.git_commit(),
                torch=torch.__version__, hidden=HIDDEN, inter=INTER)
    n, k = 2 * INTER, HIDDEN
    for m in map(int, args.ms.split(",")):
        sets = bench._n_sets(n * k + m * k, l2)
        xb = torch.randn(sets, m, k, device=dev, dtype=torch.bfloat16)
        wb = torch.randn(sets * n, k, device=dev, dtype=torch.bfloat16) * 0.02

        def bf16(i):
            gu = F.linear(xb[i], wb[i * n : (i + 1) * n])
            return fused.silu_mul(gu[:, :INTER], gu[:, INTER:])

        t_bf16 = bench.time_per_call([lambda i=i: bf16(i) for i in range(sets)])
        print(f"M={m:<4} bf16 gate_up + silu_mul {t_bf16 * 1e6:8.1f} us", flush=True)
        rows.append(dict(M=m, fmt="bf16", cfg="F.linear + silu_mul", us=t_bf16 * 1e6))
        for fmt in ("w8a8-fp8", "w8a8-int8"):
            sc = get_scheme(fmt)
            big = quantize_weight(wb, sc)
            qws = [bench._slice_qw(big, i, n, k) for i in range(sets)]
            xs = [launch.act_quant(xb[i], sc.act_format) for i in range(sets)]

            def plain(i):
                gu = launch.linear_quantized_input(*xs[i], qws[i], None, torch.bfloat16)
                return fused.silu_mul(gu[:, :INTER], gu[:, INTER:], quant=sc.act_format)

            q0, s0 = plain(0)
            t_plain = bench.time_per_call([lambda i=i: plain(i) for i in range(sets)])
            default = dispatch.gated_plan(sc.act_format, m, n, k)
            print(f"M={m:<4} {fmt} plain GEMM + silu_mul + quantizer {t_plain * 1e6:8.1f} us ({t_bf16 / t_plain:.2f}x bf16); "
                  f"gated default {default}", flush=True)
            rows.append(dict(M=m, fmt=fmt, cfg="plain", us=t_plain * 1e6, bf16_us=t_bf16 * 1e6))
            for bm, bn, bk, w, st, wv in GATED:
                cfg = C(bm, bn, bk, num_warps=w, num_stages=st, waves=wv)
                name = f"gated {bm}x{bn}x{bk} w{w} s{st} p{wv}"

                def gated(i, cfg=cfg):
                    y, amax = w8a8.gated_gemm(*xs[i], qws[i], torch.bfloat16, cfg)
                    return launch.act_quant_from_partials(y, amax, sc.act_format)

                t, err = bench.time_checked_codes(gated, (q0, s0), sets)
                if err:
                    print(f"M={m:<4} {fmt} {name}: {err}", flush=True)
                rows.append(dict(M=m, fmt=fmt, cfg=name, us=t * 1e6, bf16_us=t_bf16 * 1e6, plain_us=t_plain * 1e6))
                print(f"M={m:<4} {fmt} {name:32} {t * 1e6:8.1f} us ({t_bf16 / t:.2f}x bf16, {t_plain / t:.2f}x plain)", flush=True)
            del big, qws, xs
            torch.cuda.empty_cache()
        del xb, wb
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
