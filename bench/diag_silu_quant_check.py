import torch
from quarl.quant import bench
from quarl.rollout import fused
dev = torch.device("cuda")
for m in (1024, 4096):
    for fmt in ("fp8", "int8"):
        e = [bench.producer_extra_seconds("silu_mul", fmt, m, 18944, dev, 20, True) * 1e6 for _ in range(3)]
        print(m, fmt, "bench extra us", [round(v, 1) for v in e], flush=True)
    for scale in (1.0, 3.0):
        x = torch.randn(m, 2 * 18944, device=dev, dtype=torch.bfloat16) * scale
        g, u = x[:, :18944], x[:, 18944:]
        tp = bench.time_per_call([lambda: fused.silu_mul(g, u)])
        for fmt in ("fp8", "int8"):
            t = bench.time_per_call([lambda: fused.silu_mul(g, u, quant=fmt)])
            t2 = bench.time_per_call([lambda: fused._silu_mul_quant_rows(g, u, fmt, 4, 4096, 16)])
            print(m, fmt, f"x{scale}", "plain", round(tp * 1e6, 1), "quant", round(t * 1e6, 1), "direct", round(t2 * 1e6, 1), flush=True)
