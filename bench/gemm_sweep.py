"""Tile-config sweep for the quantized GEMMs on the Qwen2.5-7B shapes (GPU only).

Times each candidate TileConfig against bf16 (CUDA-graph replays over rotating weight
sets, as quarl.quant.bench does), checks each candidate's output against the reference
once, and writes every timing plus the best config per (kind, M, shape) as JSON. Also
times the fp8 path's two launches apart (activation quantizer, ``_scaled_mm``). The
winners are copied by hand into the rows of quarl/quant/kernels/dispatch.py.

    PYTHONPATH=. python3 bench/gemm_sweep.py --out $OUT/sweep.json [--kinds w4,fp8,int8]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from quarl.quant import bench
from quarl.quant.kernels import dispatch, launch
from quarl.quant.kernels.config import TileConfig
from quarl.quant.kernels.dispatch import Plan
from quarl.quant.ops import quant_linear
from quarl.quant.qweight import quantize_weight
from quarl.quant.reference import reference_linear
from quarl.quant.scheme import get_scheme

SHAPES = [(s.label, s.n, s.k) for s in bench.linear_shapes(bench.MODELS["qwen2.5-7b"], ("engine",))]


def C(*args, kernel: str = "pointer", **kw) -> Plan:
    """A candidate: the kernel (a dispatch plan kernel name) and its Triton tile."""
    return Plan(kernel, None if kernel in ("cublas", "dequant") else TileConfig(*args, **kw))


def _run10_tables():
    """Run-10 sweep, on the engine's shapes (q/k/v and gate/up fused): W8A8 over the
    Triton GEMM's tiles (fp8 through ``int8_gemm_kernel`` on e4m3) against ``_scaled_mm``
    at every M the rollout and learner see, and w4a16 at M = 64 (swap tiles and K split
    against dequant + cuBLAS). (The w4 tables of runs 6 and 9 probed kernels since
    removed; they are in git before the dispatch tables.)"""
    mids = [(64, 64, 128, 4, 4, 0), (64, 128, 128, 4, 4, 0), (64, 128, 64, 4, 5, 0), (64, 256, 128, 8, 3, 0),
            (64, 64, 256, 4, 3, 0), (64, 128, 128, 4, 4, 1)]
    bigs = [(128, 128, 128, 8, 3, 1), (128, 256, 128, 8, 3, 1), (128, 128, 128, 8, 4, 1), (64, 128, 128, 4, 4, 1),
            (128, 128, 64, 4, 4, 1), (256, 128, 128, 8, 3, 1)]
    def tiles(m):
        return mids if m <= 64 else (mids[:2] + bigs if m <= 256 else bigs)
    fp8 = {m: [C(kernel="cublas")] + [C(bm, bn, bk, split_k=sk, num_warps=w, num_stages=st)
                                      for bm, bn, bk, w, st, sk in tiles(m)] for m in (64, 256, 1024, 4096)}
    int8 = {m: [C(bm, bn, bk, split_k=sk, num_warps=w, num_stages=st) for bm, bn, bk, w, st, sk in tiles(m)]
            for m in (64, 256, 1024, 4096)}
    w4 = {64: [C(64, bn, num_warps=w, num_stages=st, waves=wv, kernel="swap")
               for bn, w in ((64, 4), (128, 8)) for st in (3, 4) for wv in (0.5, 1, 2)] + [C(kernel="dequant")]}
    return w4, fp8, int8


W4, FP8, INT8 = _run10_tables()
FAMILY = {"w4": "w4a16", "fp8": "fp8", "int8": "int8"}  # sweep kind -> dispatch table
SPEC = {"w4": ("w4a16", W4), "fp8": ("w8a8-fp8", FP8), "int8": ("w8a8-int8", INT8)}


def make_sets(fmt, m, n, k, dev, l2):
    sc = get_scheme(fmt)
    gen = torch.Generator(device=dev).manual_seed(0)
    sets = bench._n_sets(int(n * k * sc.bits_per_weight / 8 + m * k * 2), l2)
    w = torch.randn(sets * n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    x = torch.randn(sets, m, k, device=dev, dtype=torch.bfloat16, generator=gen)
    big = quantize_weight(w, sc)
    del w
    qws = [bench._slice_qw(big, i, n, k) for i in range(sets)]
    return x, qws


def _warm(items):
    """Compile (by running once) each (kind, M, N, K, cfg) in this process: fills the on-disk
    Triton cache so the timing process only loads kernels."""
    import os

    os.environ.setdefault("PYTHONPATH", ".")
    dev = torch.device("cuda")
    qws, n_ok = {}, 0
    for kind, m, n, k, cfg in items:
        fmt = SPEC[kind][0]
        if (fmt, n, k) not in qws:
            qws[(fmt, n, k)] = quantize_weight(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02, get_scheme(fmt))
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        try:
            with dispatch.overrides(**{FAMILY[kind]: cfg}):
                quant_linear(x, qws[(fmt, n, k)])
            n_ok += 1
        except Exception:
            pass
    torch.cuda.synchronize()
    return n_ok


def warm_compile(kinds, procs, log):
    import multiprocessing as mp

    items = [(kind, m, n, k, cfg) for kind in kinds for m, cfgs in SPEC[kind][1].items() for cfg in cfgs for _, n, k in SHAPES]
    # one item per distinct compile is enough in principle, but the specialisation (M == 1,
    # divisibility, split or not) depends on the shape: warm every item, spread round-robin
    t0 = time.time()
    with mp.get_context("spawn").Pool(procs) as pool:
        done = sum(pool.map(_warm, [items[i::procs] for i in range(procs)]))
    log(f"warm compile: {done}/{len(items)} launches in {time.time() - t0:.0f}s with {procs} processes")


def sweep(kind, budget_s, dev, l2, log, rows):
    fmt, table = SPEC[kind]
    t0 = time.time()
    for m, cfgs in table.items():
        for lbl, n, k in SHAPES:
            if time.time() - t0 > budget_s:
                log(f"{kind}: budget spent")
                return
            base = bench.time_per_call(bench.make_calls("bf16", m, n, k, dev, l2))
            x, qws = make_sets(fmt, m, n, k, dev, l2)
            expect = reference_linear(x[0].float(), qws[0])
            calls = [lambda i=i: quant_linear(x[i], qws[i]) for i in range(len(qws))]
            if kind == "fp8":  # the two launches of the cuBLAS path, apart
                xq, sx = launch.act_quant(x[0], "fp8")
                for name, fn in (
                    ("act_quant_only", [lambda i=i: launch.act_quant(x[i], "fp8") for i in range(len(qws))]),
                    ("scaled_mm_only", [lambda i=i: torch._scaled_mm(xq, qws[i].qdata.t(), scale_a=sx[:, None], scale_b=qws[i].scales[None, :], out_dtype=torch.bfloat16) for i in range(len(qws))]),
                ):
                    t = bench.time_per_call(fn)
                    rows.append(dict(kind=kind, M=m, layer=lbl, N=n, K=k, cfg=name, us=t * 1e6, bf16_us=base * 1e6, speedup=base / t, err=0.0))
            for cfg in [None] + cfgs:
                try:
                    with dispatch.overrides(**({FAMILY[kind]: cfg} if cfg is not None else {})):
                        out = quant_linear(x[0], qws[0])
                        err = float((out.float() - expect).norm() / expect.norm())
                        t = bench.time_per_call(calls)
                except Exception as e:
                    t, err = float("nan"), float("nan")
                    log(f"{kind} M={m} {lbl} {cfg}: {type(e).__name__}: {str(e)[:300]}")
                if not err < 2e-2:
                    log(f"{kind} M={m} {lbl} {cfg}: WRONG rel err {err}")
                    t = float("nan")
                nbytes = n * k * get_scheme(fmt).bits_per_weight / 8 + 2 * m * k + 2 * m * n
                rows.append(dict(kind=kind, M=m, layer=lbl, N=n, K=k, cfg=repr(cfg) if cfg else "default", us=t * 1e6, bf16_us=base * 1e6, speedup=base / t, err=err,
                                 eff_TBps=nbytes / t / 1e12))
            log_best(rows, kind, m, lbl, n, k, base, log)
            del x, qws, calls
            torch.cuda.empty_cache()


def log_best(rows, kind, m, lbl, n, k, base, log):
    """One line per (kind, M, shape): bf16, the default's speedup and the fastest candidate."""
    mine = [r for r in rows if r.get("kind") == kind and r["M"] == m and r["N"] == n and r["K"] == k and r["us"] == r["us"]]
    best = min(mine, key=lambda r: r["us"]) if mine else None
    dflt = next((r for r in mine if r["cfg"] == "default"), None)
    nan = float("nan")
    log(f"{kind} M={m:<5} {lbl:>20} bf16 {base * 1e6:7.1f}us default {dflt['speedup'] if dflt else nan:.2f}x "
        f"best {best['us'] if best else nan:7.1f}us ({best['speedup'] if best else nan:.2f}x) {best['cfg'] if best else ''}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the whole sweep")
    ap.add_argument("--kinds", default="w4,fp8,int8")
    ap.add_argument("--warm-procs", type=int, default=0, help="compile every candidate first in N processes")
    ap.add_argument("--warm-only", action="store_true", help="only fill the Triton cache (e.g. while tests run)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    rows: list[dict] = []
    if args.warm_procs > 0:
        warm_compile(args.kinds.split(","), args.warm_procs, lambda s: print(s, flush=True))
    if args.warm_only:
        return
    share = {"w4": 0.5, "fp8": 0.25, "int8": 0.25}
    total = sum(share[k] for k in args.kinds.split(","))
    share = {k: v / total for k, v in share.items()}
    for kind in args.kinds.split(","):
        sweep(kind, args.budget * share[kind], dev, l2, lambda s: print(s, flush=True), rows)
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
