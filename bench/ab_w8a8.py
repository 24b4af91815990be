"""A/B of the W8A8 GEMM default dispatch between two checkouts (GPU only): run it once per
checkout (``PYTHONPATH=<checkout>``), interleaved, and compare the printed lines.

    PYTHONPATH=. python3 bench/ab_w8a8.py --label new --ms 256,1024,4096 --out $OUT/ab.jsonl
"""

from __future__ import annotations

import argparse
import json

import torch

from quarl.quant import bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--ms", default="256,1024,4096")
    ap.add_argument("--formats", default="w8a8-int8,w8a8-fp8")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    shapes = [(s.label, s.n, s.k) for s in bench.linear_shapes(bench.MODELS["qwen2.5-7b"], ("engine",))]
    with open(args.out, "a") as f:
        for m in map(int, args.ms.split(",")):
            for label, n, k in shapes:
                base = bench.time_per_call(bench.make_calls("bf16", m, n, k, dev, l2))
                for fmt in args.formats.split(","):
                    t = bench.time_per_call(bench.make_calls_quantized_input(fmt, m, n, k, dev, l2))
                    row = dict(label=args.label, M=m, layer=label, format=fmt, us=t * 1e6, bf16_us=base * 1e6, speedup=base / t)
                    print(json.dumps(row), flush=True)
                    f.write(json.dumps(row) + "\n")
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
