"""Run-12/13 sweep (GPU only): the W8A8 activation quantizer and the TMA GEMM on the engine's
7B shapes (run 13 added split-K candidates, TMA and pointer, at M = 128-512).

1. ``act_quant`` alone (per-token int8 / e4m3 codes, the hardware e4m3 conversion since run
   12) at M = 64 ... 4096 for K = 3584 and 18944, with its effective bandwidth (bf16 read +
   codes written) next to the device-to-device copy rate.
2. The GEMM alone on pre-quantized activations (what the engine runs after its fused
   RMSNorm / SiLU-and-mul quantizers) for int8 and fp8: the current default, ``_scaled_mm``
   (fp8) and ``w8a8_tma_kernel`` configs, against bf16 ``F.linear`` timed the same way.

Every candidate's output is checked against the first one's (relative error < 1e-2) once.
Timings: CUDA-graph replays over rotating weight sets (quarl.quant.bench.time_per_call).

    PYTHONPATH=. python3 bench/w8a8_sweep.py --out $OUT/w8a8_sweep.json [--budget 300]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from quarl.quant import bench
from quarl.quant.kernels import dispatch, launch
from quarl.quant.kernels.config import TileConfig
from quarl.quant.kernels.dispatch import Plan
from quarl.quant.qweight import quantize_weight
from quarl.quant.scheme import get_scheme

from gemm_sweep import log_best  # bench/ is the script's directory: sys.path[0]


def C(*args, kernel: str = "pointer", **kw) -> Plan:
    """A candidate: the kernel (a dispatch plan kernel name) and its Triton tile."""
    return Plan(kernel, None if kernel == "cublas" else TileConfig(*args, **kw))

SHAPES = [(s.label, s.n, s.k) for s in bench.linear_shapes(bench.MODELS["qwen2.5-7b"], ("engine",))]
MS = (64, 256, 1024, 4096)
# (bm, bn, bk, warps, stages, resident programs per SM)
TMA = [(128, 128, 128, 8, 4, 1), (128, 256, 128, 8, 3, 1), (128, 128, 128, 4, 4, 1), (64, 128, 128, 4, 4, 2),
       (64, 64, 128, 4, 5, 3), (128, 64, 128, 4, 4, 2), (256, 128, 128, 8, 3, 1), (128, 128, 256, 8, 3, 1)]

# (bm, bn, bk, warps, stages, resident programs per SM, K splits)
TMA_SPLIT = [(128, 128, 128, 8, 4, 1, 2), (128, 128, 128, 8, 4, 1, 3), (128, 128, 128, 8, 4, 1, 4),
             (128, 128, 128, 4, 4, 1, 2), (64, 128, 128, 4, 4, 2, 2), (128, 64, 128, 4, 4, 2, 2), (128, 256, 128, 8, 3, 1, 4)]

# run 17: (bm, bn, bk, warps, stages, resident programs per SM) with the tail split, and
# (..., split_k) with Triton's warp-specialized item loop
TMA_TAIL = [(128, 128, 128, 8, 4, 1), (128, 256, 128, 8, 3, 1), (128, 128, 128, 4, 4, 1), (64, 128, 128, 4, 4, 2),
            (128, 64, 128, 4, 4, 2)]


# act_quant (columns per block, warps): one pass for K = 3584 (4096), two passes below that
ACT_CFGS = {3584: [(4096, 4), (4096, 16), (2048, 4), (1024, 2), (1024, 4)],
            18944: [(2048, 4), (8192, 8), (8192, 16), (1024, 4), (32768, 32)]}


def candidates(kind: str, m: int) -> list[tuple[str, C | None]]:
    out: list[tuple[str, C | None]] = [("default", None)]
    if kind == "fp8":
        out.append(("cublas", C(0, 0, kernel="cublas")))
    for bm, bn, bk, w, st, wv in TMA:
        if m <= 64 and bm > 64:
            continue
        out.append((f"tma {bm}x{bn}x{bk} w{w} s{st} p{wv}", C(bm, bn, bk, num_warps=w, num_stages=st, waves=wv, kernel="tma")))
    if 128 <= m <= 512:  # run 13: split K over 128 x 128 tiles (too few tiles to fill the GPU at these M)
        for bm, bn, bk, w, st, wv, sp in TMA_SPLIT:
            out.append((f"tma split{sp} {bm}x{bn}x{bk} w{w} s{st} p{wv}",
                        C(bm, bn, bk, split_k=sp, num_warps=w, num_stages=st, waves=wv, kernel="tma")))
        for sp in (2, 4):
            out.append((f"ptr split{sp} 128x128x128 w8 s3", C(128, 128, 128, split_k=sp, num_warps=8, num_stages=3)))
    if m >= 256:  # run 17: tail split (whole tiles for the full waves, the partial wave split along K)
        for bm, bn, bk, w, st, wv in TMA_TAIL:
            out.append((f"tma tail {bm}x{bn}x{bk} w{w} s{st} p{wv}",
                        C(bm, bn, bk, split_k=-1, num_warps=w, num_stages=st, waves=wv, kernel="tma")))
    return out


def gemm_call(kind, xq, sx, qw, cfg):
    plan = cfg if cfg is not None else dispatch.pick(qw, xq.shape[0], xq.device)
    return lambda: plan.run(xq, sx, qw, None, torch.bfloat16)


def sweep_act_quant(dev, bw, rows, log):
    for k in (3584, 18944):
        for m in MS:
            x = torch.randn(8, m, k, device=dev, dtype=torch.bfloat16)
            for act in ("int8", "fp8"):
                for block, warps in [(None, None)] + ACT_CFGS[k]:
                    with dispatch.overrides(**({"act_quant": (block, warps)} if block is not None else {})):
                        q, s = launch.act_quant(x[0], act)
                    if block is not None and not (torch.equal(q.view(torch.int8), q0.view(torch.int8)) and torch.equal(s, s0)):
                        log(f"act_quant {act} M={m} K={k} {block}x{warps}: WRONG")
                        continue
                    q0, s0 = q, s
                    with dispatch.overrides(**({"act_quant": (block, warps)} if block is not None else {})):
                        t = bench.time_per_call([lambda i=i: launch.act_quant(x[i], act) for i in range(8)])
                    nbytes = 3 * m * k + 4 * m
                    cfg = "default" if block is None else f"{block}x{warps}"
                    rows.append(dict(part="act_quant", act=act, M=m, K=k, cfg=cfg, us=t * 1e6, eff_TBps=nbytes / t / 1e12,
                                     floor_us=nbytes / bw * 1e6))
                    log(f"act_quant {act:4} M={m:<5} K={k:<6} {cfg:>9} {t * 1e6:7.1f} us  {nbytes / t / 1e12:5.2f} TB/s (floor {nbytes / bw * 1e6:6.1f} us)")


def sweep_gemm(kind, dev, l2, budget, rows, log, ms=MS):
    fmt = {"fp8": "w8a8-fp8", "int8": "w8a8-int8"}[kind]
    sc = get_scheme(fmt)
    t0 = time.time()
    for m in ms:
        for lbl, n, k in SHAPES:
            if time.time() - t0 > budget:
                log(f"{kind}: budget spent")
                return
            base = bench.time_per_call(bench.make_calls("bf16", m, n, k, dev, l2))
            sets = bench._n_sets(n * k + m * k, l2)
            w = torch.randn(sets * n, k, device=dev, dtype=torch.bfloat16) * 0.02
            big = quantize_weight(w, sc)
            del w
            qws = [bench._slice_qw(big, i, n, k) for i in range(sets)]
            xs = [launch.act_quant(torch.randn(m, k, device=dev, dtype=torch.bfloat16), sc.act_format) for _ in range(sets)]
            expect = None
            for name, cfg in candidates(kind, m):
                try:
                    out = gemm_call(kind, *xs[0], qws[0], cfg)().float()
                    if expect is None:
                        expect = out
                    err = float((out - expect).norm() / expect.norm())
                    if not err < 1e-2:
                        raise RuntimeError(f"rel err {err:.3g} against the default")
                    t = bench.time_per_call([gemm_call(kind, *xs[i], qws[i], cfg) for i in range(sets)])
                except Exception as e:  # noqa: BLE001 - a failing candidate is a result
                    log(f"{kind} M={m} {lbl} {name}: {type(e).__name__}: {str(e)[:200]}")
                    t, err = float("nan"), float("nan")
                rows.append(dict(part="gemm", kind=kind, M=m, layer=lbl, N=n, K=k, cfg=name, us=t * 1e6, bf16_us=base * 1e6,
                                 speedup=base / t, err=err))
            log_best(rows, kind, m, lbl, n, k, base, log)
            del qws, big, xs
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=300.0)
    ap.add_argument("--parts", default="act,fp8,int8")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="GEMM rows to sweep")
    args = ap.parse_args()
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    ceil = bench.measure_ceilings(dev)
    rows: list[dict] = []
    meta = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%S"), git_commit=bench.git_commit(),
                torch=torch.__version__, bandwidth=ceil.bandwidth)

    def log(s):
        print(s, flush=True)

    def save():
        with open(args.out, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)

    parts = args.parts.split(",")
    if "act" in parts:
        sweep_act_quant(dev, ceil.bandwidth, rows, log)
        save()
    kinds = [p for p in parts if p in ("fp8", "int8")]
    for kind in kinds:
        sweep_gemm(kind, dev, l2, args.budget / max(len(kinds), 1), rows, log, tuple(map(int, args.ms.split(","))))
        save()


if __name__ == "__main__":
    main()
