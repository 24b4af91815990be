"""Correctness check, then a sweep, of the wgmma w4a16 kernel (``cuda_w4.wgmma_gemm``).

First every (M, shape, scheme, config) of a small grid against the float64 reference and the
fragment kernel (stops on the first mismatch), then the 7B shapes at the given M: bf16
(cuBLAS), the current default w4a16 dispatch and each wgmma block shape, timed like ``quarl
bench gemm`` (rotating weight sets beyond L2, replayed in a CUDA graph, median of CUDA events).

    PYTHONPATH=. python3 bench/w4_wgmma_sweep.py --out /tmp/w4_wgmma.json
"""

import argparse
import json
import math
import time

import torch

from quarl.quant import reference_linear
from quarl.quant.bench import git_commit
from quarl.quant.kernels import cuda_w4
from quarl.quant.kernels.config import WgConfig
from quarl.quant.qweight import quantize_weight

import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location("w4_tile_sweep", pathlib.Path(__file__).with_name("w4_tile_sweep.py"))
_tile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tile)

CANDIDATES = [tuple(float(v) if "." in v else int(v) for v in c.split(",")) for c in __import__("os").environ.get(
    "WGMMA_CANDIDATES", "1,3;1,4;2,3;2,4;2,6").split(";")]
CLUSTER = tuple(v == "1" for v in __import__("os").environ.get("CLUSTER", "0").split(","))  # "0,1": both
BPS = tuple(float(v) for v in __import__("os").environ.get("BPS", "1,2,4").split(","))


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def check() -> list[dict]:
    rows = []
    torch.manual_seed(0)
    for name in ("w4a16", "w4a16-asym"):
        for n, k in ((3584, 3584), (1000, 1041), (704, 18944)):
            qw = quantize_weight(torch.randn(n, k, device="cuda") * 0.02, name)
            for m in (1, 8, 9, 16, 17, 33, 64):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
                expect = reference_linear(x.float(), qw, bias.float(), exact=True)
                for nwg, st, single, minb, tail in ((1, 3, False, 1, False), (2, 6, False, 1, False), (1, 3, True, 4, False),
                                                    (4, 4, True, 1, False), (1, 3, True, 4, True), (3, 4, True, 1, True)):
                    for bps in (0.3, 0.1, 2) if tail else (0.25, 2, 8):
                        cfg = WgConfig(nwg, st, bps, single, minb, tail)
                        a = cuda_w4.wgmma_gemm(x, qw, bias, cfg)
                        b = cuda_w4.wgmma_gemm(x, qw, bias, cfg)
                        e = rel(a, expect)
                        rows.append(dict(name=name, n=n, k=k, m=m, cfg=tuple(cfg), err=e, det=bool(torch.equal(a, b))))
                        if not (e < 5e-3 and torch.equal(a, b)):
                            print("MISMATCH", rows[-1], flush=True)
                            d = (a.float() - expect.float()).abs()
                            print("max err by token", d.amax(1)[:16].tolist())
                            print("max err by row (first 128)", d.amax(0)[:128].tolist())
                            return rows
    print(f"check: {len(rows)} cases ok, max rel err {max(r['err'] for r in rows):.2e}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="64,16,32,8")
    ap.add_argument("--budget", type=float, default=300.0)
    ap.add_argument("--skip-check", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    checks = [] if args.skip_check else check()
    ok = all(r["err"] < 5e-3 and r["det"] for r in checks)
    # a candidate "nwg,stages[,single,minb[,tail[,blocks_per_sm]]]" is swept at every BPS, or
    # at its own blocks_per_sm when it names one
    def configs(m):
        out = []
        for c in CANDIDATES:
            flags = dict(zip(("single", "minb", "tail"), c[2:5]))
            flags = {f: (bool(v) if f != "minb" else v) for f, v in flags.items()}
            for bps in (c[5:] or BPS):
                for cl in CLUSTER:
                    out.append(WgConfig(c[0], c[1], float(bps), **flags, cluster=cl))
        return out
    rows = _tile.sweep([int(v) for v in args.ms.split(",")], args.budget, t0, configs, cuda_w4.wgmma_gemm, "wgmma") if ok else []
    json.dump(dict(device=props.name, date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), commit=git_commit(),
                   torch=torch.__version__, checks=checks, rows=rows), open(args.out, "w"), indent=1)
    for m in sorted({r["M"] for r in rows}):
        sel = [r for r in rows if r["M"] == m and "engine" in r["counts"]]
        layers = {r["layer"] for r in sel}
        bf = {r["layer"]: r["us"] for r in sel if r["cfg"] == "bf16"}
        de = {r["layer"]: r["us"] for r in sel if r["cfg"].startswith("default")}
        best = {}
        for r in sel:
            if r["cfg"].startswith("(") and r["us"] == r["us"]:
                best[r["layer"]] = min(best.get(r["layer"], math.inf), r["us"])
        if len(best) == len(layers):
            g_def = math.exp(sum(math.log(bf[l] / de[l]) for l in layers) / len(layers))
            g_best = math.exp(sum(math.log(bf[l] / best[l]) for l in layers) / len(layers))
            print(f"M={m}: engine-shape geomean over bf16: default {g_def:.2f}x, best wgmma per shape {g_best:.2f}x")


if __name__ == "__main__":
    main()
