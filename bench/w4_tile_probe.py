"""Where the block-tiled w4 kernel spends its time: the same launch with parts removed.

Variants (text edits of ``cuda_w4._SOURCE``, compiled under the same kernel name):
full; nomma (dequant kept, the tensor-core MMAs replaced by a cheap use of the operands);
noact (activation copies skipped); nowgt (weight copies skipped); nodq (MMAs on the raw
words, no unpack). Results are wrong for every variant but "full"; only the time matters.

    PYTHONPATH=. python3 bench/w4_tile_probe.py --out /tmp/probe.json
"""

import argparse
import json
import time

import torch

from quarl.quant.bench import _n_sets, _slice_qw, git_commit, time_per_call
from quarl.quant.kernels import cuda_w4, launch
from quarl.quant.qweight import quantize_weight

MMA = ("          mma16816(tmp[mt][2 * i], a[mt], b0, b1);\n"
       "          mma16816(tmp[mt][2 * i + 1], a[mt], b2, b3);\n")
EDITS = {
    "full": [],
    "nomma": [(MMA, "          tmp[mt][2 * i][0] += __uint_as_float((b0 ^ b1 ^ a[mt][0] ^ a[mt][3]) & 0x3f000000u);\n"
                    "          tmp[mt][2 * i + 1][1] += __uint_as_float((b2 ^ b3 ^ a[mt][1] ^ a[mt][2]) & 0x3f000000u);\n")],
    "noact": [("      cp_async16(sbase + adst[i], asrc[i]", "      if (0) cp_async16(sbase + adst[i], asrc[i]")],
    "nowgt": [("cp_async16(sbase + wdst[i], wsrc[i]", "if (0) cp_async16(sbase + wdst[i], wsrc[i]")],
    "nodq": [("        const u32 b0 = sub_z(lop_q(w), nz[2 * i]), b1 = sub_z(lop_q(w >> 4), nz[2 * i]);\n"
              "        const u32 b2 = sub_z(lop_q(w >> 8), nz[2 * i + 1]), b3 = sub_z(lop_q(w >> 12), nz[2 * i + 1]);\n",
              "        const u32 b0 = w, b1 = w ^ nz[2 * i], b2 = w >> 4, b3 = w ^ nz[2 * i + 1];\n")],
}
SHAPES = {"gate_up_proj (fused)": (37888, 3584), "qkv_proj (fused)": (4608, 3584), "down_proj": (3584, 18944)}
CONFIGS = {8: [(4, 4, 1, 1, 4, 2.0)], 64: [(4, 4, 4, 1, 5, 1.0), (2, 4, 2, 2, 6, 2.0), (4, 4, 2, 2, 4, 2.0)]}


def compile_variant(edits, cfg):
    src = cuda_w4._SOURCE
    for a, b in edits:
        assert a in src, a
        src = src.replace(a, b)
    name = f"w4a16_tile<{cfg.sw}, {cfg.nt}, {cfg.mt}, {cfg.wm}, {cfg.stages}, false>"
    kern = torch.cuda._compile_kernel(src, name, nvcc_options=["-std=c++17"])
    kern.set_shared_memory_config(cfg.smem_bytes())
    return kern


def launch_variant(kern, cfg, x, qw):
    m, k = x.shape
    n = qw.shape[0]
    fw = cuda_w4.frag_weight(qw)
    groups, np_ = fw.scales.shape
    cols = -(-(np_ // 64) // cfg.sw)
    sms = launch.num_sms(x.device)
    split = max(1, min(-(-int(cfg.blocks_per_sm * sms) // cols), groups))
    gpb = -(-groups // split)
    split = -(-groups // gpb)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = launch._counters(x.device, cols) if split > 1 else out
    kern(grid=(cols, split, 1), block=(cfg.warps * 32, 1, 1), shared_mem=cfg.smem_bytes(),
         args=[x, fw.qdata, fw.scales, fw.scales, out, out, part, cnt, m, n, k, x.stride(0), out.stride(0),
               np_, groups, gpb, split, 0])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for label, (n, k) in SHAPES.items():
        sets = _n_sets(int(n * k * 0.53), l2)
        big = quantize_weight(torch.randn(sets * n, k, device="cuda", dtype=torch.bfloat16) * 0.02, "w4a16")
        qws = [_slice_qw(big, i, n, k) for i in range(sets)]
        for m, cfgs in CONFIGS.items():
            x = torch.randn(sets, m, k, device="cuda", dtype=torch.bfloat16)
            for c in cfgs:
                cfg = cuda_w4.TileKConfig(*c)
                line = []
                for var, edits in EDITS.items():
                    kern = compile_variant(edits, cfg)
                    calls = [lambda i=i: launch_variant(kern, cfg, x[i], qws[i]) for i in range(sets)]
                    t = time_per_call(calls) * 1e6
                    rows.append(dict(layer=label, n=n, k=k, M=m, cfg=list(c), variant=var, us=t))
                    line.append(f"{var} {t:6.1f}")
                print(f"{label:>22} M={m:3d} {c}: " + "  ".join(line), flush=True)
    json.dump(dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                   commit=git_commit(), rows=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
