"""Where the w4a16 wgmma kernel's time goes on the 7B shapes: a timing-probe build.

The kernel compiled with ``-DW4_TRACE`` stores, for thread 0 of every block, %globaltimer
and %clock64 at entry, when the first group has landed, after the main loop, after the
split-K partials are stored and after the split-K finish (``cuda_w4`` source). For each
(shape, M) the script launches it on rotating weight sets (beyond L2) one at a time and
reports the median launch's span and its parts; next to it the untraced kernel's time in a
CUDA graph (as ``quarl bench gemm`` times it), an empty kernel's time in a graph (the
per-node floor), and the time against K at N = 3584 (slope: bytes, intercept: fixed cost)
for bf16 and the w4 dispatch.

    PYTHONPATH=. python3 bench/w4_trace.py --out /tmp/w4_trace.json
"""

import argparse
import json
import statistics
import time

import torch

from quarl.quant.bench import _n_sets, git_commit, time_per_call
from quarl.quant.kernels import cuda_w4, launch
from quarl.quant.ops import quant_linear
from quarl.quant.qweight import quantize_weight

SHAPES = {"q/o": (3584, 3584), "qkv": (4608, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
_TRACE: list = []
_plain_kernel = cuda_w4._wgmma_kernel


def _traced_kernel(*args, **kw):
    kern = _plain_kernel(*args, defines=("W4_TRACE",))

    def call(grid, block, shared_mem, args):
        n = grid[0] * grid[1] * grid[2]
        buf = torch.zeros(n, 12, dtype=torch.int64, device="cuda")
        _TRACE.append(buf)
        kern(grid=grid, block=block, shared_mem=shared_mem, args=[*args, buf])

    return call


def operands(m, n, k, l2, sets=None):
    sets = sets or _n_sets(n * k // 2 + m * k * 2, l2)
    g = torch.Generator(device="cuda").manual_seed(0)
    qws = [quantize_weight(torch.randn(n, k, device="cuda", generator=g) * 0.02, "w4a16") for _ in range(sets)]
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(sets)]
    return xs, qws


def summarize(buf: torch.Tensor) -> dict:
    t = buf.cpu().tolist()
    gt0 = min(r[0] for r in t)
    ends = [r[4] if r[4] else r[3] for r in t]
    span = max(ends) - gt0
    ck = lambda r, i: r[5 + i]
    first = [ck(r, 1) - ck(r, 0) for r in t]
    loop = [ck(r, 2) - ck(r, 1) for r in t]
    store = [ck(r, 3) - ck(r, 2) for r in t]
    fin = [ck(r, 4) - ck(r, 3) for r in t if r[4]]
    entry = sorted(r[0] - gt0 for r in t)
    last_end = sorted(e - gt0 for e in ends)
    # ns per clock from the blocks' own globaltimer / clock64 pairs (long blocks only)
    rates = [(e - r[0]) / (ck(r, 4 if r[4] else 3) - ck(r, 0)) for r, e in zip(t, ends) if e - r[0] > 2000]
    q = lambda v, p: sorted(v)[min(len(v) - 1, int(p * len(v)))] if v else 0
    return dict(
        blocks=len(t), sms=len({r[10] for r in t}), span_us=span / 1e3,
        ns_per_clk=statistics.median(rates) if rates else None,
        entry_us=[q(entry, p) / 1e3 for p in (0.5, 0.9, 1.0)],
        end_us=[q(last_end, p) / 1e3 for p in (0.1, 0.5, 0.9, 1.0)],
        first_clk=[q(first, p) for p in (0.1, 0.5, 0.9)], loop_clk=[q(loop, p) for p in (0.1, 0.5, 0.9)],
        store_clk=[q(store, p) for p in (0.5, 0.9)], finish_clk=[q(fin, p) for p in (0.5, 0.9, 1.0)] if fin else [],
    )


def trace_shape(label, n, k, m, l2):
    xs, qws = operands(m, n, k, l2)
    calls = [lambda i=i: quant_linear(xs[i], qws[i], None) for i in range(len(qws))]
    t_graph = time_per_call(calls) * 1e6
    cuda_w4._wgmma_kernel = _traced_kernel
    try:
        for f in calls:
            f()
        torch.cuda.synchronize()
        _TRACE.clear()
        for f in calls * 2:
            f()
            torch.cuda.synchronize()
        t_traced = time_per_call(calls) * 1e6
        runs = [summarize(b) for b in _TRACE[: 2 * len(calls)]]
    finally:
        cuda_w4._wgmma_kernel = _plain_kernel
    runs.sort(key=lambda r: r["span_us"])
    med = runs[len(runs) // 2]
    row = dict(layer=label, n=n, k=k, M=m, cfg=repr(tuple(launch.wgmma_config(m, n, k))), kernel=launch.w4_config(m, n, k).kernel,
               graph_us=t_graph, graph_traced_us=t_traced, spans_us=[r["span_us"] for r in runs], median=med)
    print(f"{label:>8} M={m:3d} {row['kernel']} graph {t_graph:6.1f}us (traced {t_traced:6.1f}) span med {med['span_us']:6.1f}us "
          f"blocks {med['blocks']} on {med['sms']} SMs | entry p50/p90/max {med['entry_us']} | end p10/50/90/max {med['end_us']} "
          f"| clk first {med['first_clk']} loop {med['loop_clk']} store {med['store_clk']} finish {med['finish_clk']} "
          f"ns/clk {med['ns_per_clk']}", flush=True)
    del xs, qws
    torch.cuda.empty_cache()
    return row


def empty_kernel_us() -> dict:
    kern = torch.cuda._compile_kernel('extern "C" __global__ void nop(int* p) { if (p[0] == 12345) p[1] = 1; }', "nop")
    buf = torch.zeros(2, dtype=torch.int32, device="cuda")
    out = {}
    for blocks in (1, 132, 264):
        out[blocks] = time_per_call([lambda b=blocks: kern(grid=(b, 1, 1), block=(128, 1, 1), args=[buf])]) * 1e6
    print(f"empty kernel in a graph, us by blocks: {out}", flush=True)
    return out


def k_sweep(l2) -> list[dict]:
    rows = []
    for m in (1, 16, 64):
        for k in (1792, 3584, 7168, 14336):
            n = 3584
            xs, qws = operands(m, n, k, l2)
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(_n_sets(n * k * 2, l2))]
            t_w4 = time_per_call([lambda i=i: quant_linear(xs[i], qws[i], None) for i in range(len(qws))]) * 1e6
            t_bf = time_per_call([lambda i=i: torch.nn.functional.linear(xs[i % len(xs)], ws[i]) for i in range(len(ws))]) * 1e6
            rows.append(dict(M=m, n=n, k=k, w4_us=t_w4, bf16_us=t_bf, kernel=launch.w4_config(m, n, k).kernel))
            print(f"K sweep N={n} M={m:3d} K={k:6d}: w4 {t_w4:6.1f}us ({rows[-1]['kernel']}) bf16 {t_bf:6.1f}us", flush=True)
            del xs, qws, ws
            torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    res = dict(device=props.name, date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), commit=git_commit(), torch=torch.__version__)
    res["empty_kernel_us"] = empty_kernel_us()
    res["trace"] = []
    for m in (int(v) for v in args.ms.split(",")):
        for label in args.shapes.split(","):
            n, k = SHAPES[label]
            if launch.w4_config(m, n, k).kernel != "wgmma":  # trace the wgmma kernel on every shape
                launch.CONFIG_OVERRIDES["w4"] = lambda m_, n_, k_: launch.TileConfig(m_, 0, kernel="wgmma")
            try:
                res["trace"].append(trace_shape(label, n, k, m, l2))
            finally:
                launch.CONFIG_OVERRIDES.pop("w4", None)
    res["k_sweep"] = k_sweep(l2)
    json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
