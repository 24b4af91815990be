"""Tile-config sweep for the Triton GEMMs on the Qwen2.5-7B shapes (GPU only).

Times each candidate TileConfig (and, for weight-only formats, the dequant + cuBLAS
path) at the M values that the dispatch in quarl/quant/kernels/launch.py distinguishes,
and writes every timing plus the best config per (kernel, M) as JSON. The winners are
copied by hand into launch.py's *_config functions.

    PYTHONPATH=. python3 bench/gemm_sweep.py --out $OUT/sweep.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from quarl.quant import bench
from quarl.quant.kernels import launch
from quarl.quant.kernels.launch import TileConfig as C

SHAPES = [(n, k) for _, n, k, _ in bench.linear_shapes(bench.MODELS["qwen2.5-7b"])]

WO = {
    1: [C(16, bn, num_warps=4, num_stages=4, post_scale=p) for bn in (32, 64, 128) for p in (True, False)],
    16: [C(16, bn, num_warps=w, num_stages=s, post_scale=p) for bn in (32, 64, 128) for w, s in ((4, 3), (4, 4)) for p in (True, False)],
    64: [C(bm, bn, num_warps=4, num_stages=3, split_k=sk) for bm in (32, 64) for bn in (64, 128) for sk in (0, 1)]
    + [C(64, 128, num_warps=8, num_stages=3), C(64, 64, num_warps=4, num_stages=4)],
    256: [C(bm, bn, split_k=1, num_warps=w, num_stages=3) for bm in (64, 128) for bn in (128, 256) for w in (4, 8)],
    1024: [C(128, bn, split_k=1, num_warps=8, num_stages=s) for bn in (128, 256) for s in (3, 4)],
}
INT8 = {
    256: [C(bm, bn, 128, split_k=sk, num_warps=w, num_stages=st) for bm, bn, w, st in ((64, 128, 4, 4), (128, 128, 8, 3), (64, 64, 4, 4)) for sk in (0, 1)],
}
W4A8 = {
    16: [C(16, bn, num_warps=4, num_stages=s) for bn in (64, 128) for s in (3, 4)],
    64: [C(bm, bn, num_warps=4, num_stages=s) for bm in (32, 64) for bn in (64, 128) for s in (3, 4)],
    256: [C(128, bn, split_k=1, num_warps=w, num_stages=3) for bn in (128, 256) for w in (4, 8)],
}


def sweep(kind: str, fmt: str, table: dict, budget_s: float, dev, l2, log) -> list[dict]:
    rows = []
    t0 = time.time()
    for m, cfgs in table.items():
        for n, k in SHAPES:
            base = bench.time_per_call(bench.make_calls("bf16", m, n, k, dev, l2))
            calls = bench.make_calls(fmt, m, n, k, dev, l2)
            cands = [("default", None)] + [(repr(c), c) for c in cfgs]
            if kind == "wo":
                cands.append(("dequant+cublas", "dequant"))
            for name, cfg in cands:
                if time.time() - t0 > budget_s:
                    log(f"{kind}: budget spent")
                    return rows
                launch.CONFIG_OVERRIDES.pop(kind, None)
                launch.WO_DEQUANT_MIN_M = 1 if cfg == "dequant" else None
                if isinstance(cfg, C):
                    launch.CONFIG_OVERRIDES[kind] = lambda *_a, c=cfg: c
                try:
                    t = bench.time_per_call(calls)
                except Exception as e:
                    t = float("nan")
                    log(f"{kind} M={m} {name}: {type(e).__name__}: {str(e)[:200]}")
                rows.append(dict(kind=kind, fmt=fmt, M=m, N=n, K=k, cfg=name, us=t * 1e6, bf16_us=base * 1e6, speedup=base / t))
            launch.CONFIG_OVERRIDES.pop(kind, None)
            launch.WO_DEQUANT_MIN_M = 1024
            best = min((r for r in rows if r["M"] == m and r["N"] == n and r["K"] == k and r["kind"] == kind), key=lambda r: r["us"])
            log(f"{kind} M={m:<5} N={n:<6} K={k:<6} bf16 {base * 1e6:7.1f}us best {best['us']:7.1f}us ({best['speedup']:.2f}x) {best['cfg']}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=200.0, help="seconds for the whole sweep")
    ap.add_argument("--kinds", default="wo,int8,w4a8")
    args = ap.parse_args()
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    rows: list[dict] = []
    kinds = args.kinds.split(",")
    share = {"wo": 0.75, "int8": 0.25, "w4a8": 0.15}
    spec = {"wo": ("w4a16", WO), "int8": ("w8a8-int8", INT8), "w4a8": ("w4a8-int8", W4A8)}
    for kind in kinds:
        fmt, table = spec[kind]
        rows += sweep(kind, fmt, table, args.budget * share[kind], dev, l2, lambda s: print(s, flush=True))
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
