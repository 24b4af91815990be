"""Sweep of the block-tiled CUDA w4a16 kernel (``cuda_w4.tile_gemm``) on the 7B shapes.

For each shape and M: bf16 (cuBLAS), the current default w4a16 dispatch, and every
candidate block shape of the tiled kernel, timed like ``quarl bench gemm`` (rotating
weight sets beyond L2, replayed in a CUDA graph, median of CUDA-event times).

    PYTHONPATH=. python3 bench/w4_tile_sweep.py --out /tmp/w4_tile.json
"""

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from quarl.quant import quant_linear
from quarl.quant.bench import MODELS, _n_sets, _slice_qw, git_commit, linear_shapes, time_per_call
from quarl.quant.kernels import cuda_w4, dispatch
from quarl.quant.kernels.config import TileKConfig
from quarl.quant.kernels.w4_layout import RepackCache
from quarl.quant.qweight import quantize_weight

CANDIDATES = {
    16: [(4, 4, 1, 1, 4), (4, 4, 1, 1, 6), (4, 8, 1, 1, 4), (8, 4, 1, 1, 4), (2, 4, 1, 1, 6)],
    32: [(4, 4, 2, 1, 4), (4, 4, 2, 1, 6), (2, 4, 2, 1, 6), (8, 4, 2, 1, 4)],
    64: [(4, 4, 4, 1, 4), (4, 4, 4, 1, 5), (2, 4, 4, 1, 6), (4, 4, 2, 2, 4), (4, 4, 2, 2, 5),
         (2, 4, 2, 2, 6), (4, 8, 2, 2, 4)],
}
BPS = (1, 2, 4)


def calls_for(m, n, k, l2, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    sets = _n_sets(int(n * k * 0.53 + m * k * 2), l2)
    w = torch.randn(sets * n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    x = torch.randn(sets, m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    big = quantize_weight(w, "w4a16")
    qws = [_slice_qw(big, i, n, k) for i in range(sets)]
    bsets = _n_sets(n * k * 2, l2)
    wb = w[: bsets * n]
    bf16 = [lambda i=i: F.linear(x[i % sets], wb[i * n : (i + 1) * n]) for i in range(bsets)]
    repacked = [RepackCache() for _ in range(sets)]  # as each QuantLinear owns its kernel layouts
    default = [lambda i=i: quant_linear(x[i], qws[i], None, repacked[i]) for i in range(sets)]
    return x, qws, bf16, default, repacked


def sweep(ms, budget, t0, configs, gemm, label) -> list[dict]:
    """bf16, the default dispatch and ``gemm(x, qw, None, cfg)`` for each ``cfg`` in
    ``configs(m)`` on the 7B shapes at each M (rows of us); stops after ``budget`` seconds."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    shapes = linear_shapes(MODELS["qwen2.5-7b"])
    rows = []
    for m in ms:
        for s in shapes:
            if time.time() - t0 > budget:
                break
            x, qws, bf16, default, repacked = calls_for(m, s.n, s.k, l2)
            base = dict(layer=s.label, n=s.n, k=s.k, M=m, counts=s.counts)
            t_bf16 = time_per_call(bf16) * 1e6
            t_def = time_per_call(default) * 1e6
            cfg_def = dispatch.pick(qws[0], m, x.device)
            rows.append(dict(base, cfg="bf16", us=t_bf16))
            rows.append(dict(base, cfg=f"default:{cfg_def.kernel}", us=t_def))
            best = (math.inf, None)
            for cfg in configs(m):
                calls = [lambda i=i, cfg=cfg: gemm(x[i], qws[i], None, cfg, repacked[i]) for i in range(len(qws))]
                try:
                    t = time_per_call(calls) * 1e6
                except Exception as e:  # a config the device cannot launch: record, go on
                    print(f"  {s.label} M={m} {cfg}: {type(e).__name__}: {e}")
                    t = math.nan
                rows.append(dict(base, cfg=repr(tuple(cfg)), us=t))
                if t < best[0]:
                    best = (t, cfg)
            print(f"{s.label:>22} M={m:3d} bf16 {t_bf16:7.1f}us default({cfg_def.kernel}) {t_bf16 / t_def:5.2f}x "
                  f"best {label} {t_bf16 / best[0]:5.2f}x {tuple(best[1])}", flush=True)
            del x, qws, bf16, default, repacked
            torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="8,16,32,48,64")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds; stops sweeping after")
    args = ap.parse_args()
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)

    def configs(m):
        cands = CANDIDATES[16 if m <= 16 else 32 if m <= 32 else 64]
        return [TileKConfig(*c, float(bps)) for c in cands for bps in BPS]

    rows = sweep([int(v) for v in args.ms.split(",")], args.budget, t0, configs, cuda_w4.tile_gemm, "tile")
    json.dump(dict(device=props.name, date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), commit=git_commit(),
                   torch=torch.__version__, rows=rows), open(args.out, "w"), indent=1)
    # best single config per M bucket (geomean over the engine shapes)
    for m in sorted({r["M"] for r in rows}):
        sel = [r for r in rows if r["M"] == m and "engine" in r["counts"] and r["cfg"].startswith("(")]
        geo = {}
        for cfg in {r["cfg"] for r in sel}:
            ts = [r["us"] for r in sel if r["cfg"] == cfg]
            if all(t == t for t in ts) and len(ts) == len({r["layer"] for r in sel}):
                geo[cfg] = math.exp(sum(map(math.log, ts)) / len(ts))
        if geo:
            best = min(geo, key=geo.get)
            ref = [r["us"] for r in rows if r["M"] == m and "engine" in r["counts"] and r["cfg"].startswith("default")]
            print(f"M={m}: best single tile config {best} geomean {geo[best]:.1f}us; default geomean "
                  f"{math.exp(sum(map(math.log, ref)) / len(ref)):.1f}us")


if __name__ == "__main__":
    main()
