"""(Provenance of dispatch_c62667c.json; ran once against a checkout of c62667c, then compacted.)
Capture the kernel and config that c62667c's dispatch picks for a grid of shapes and GPU
generations (run with PYTHONPATH=<c62667c tree>)."""
import json
import sys
from quarl.quant.kernels import launch, cuda_w4

MS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 24, 32, 33, 48, 63, 64, 65, 96, 127, 128, 129, 200, 256, 257, 384, 511, 512,
      513, 1024, 1100, 2047, 2048, 4096, 8192]
NK = [(4608, 3584), (512, 3584), (3584, 3584), (37888, 3584), (18944, 3584), (3584, 18944),
      (2048, 1536), (256, 1536), (1536, 1536), (17920, 1536), (8960, 1536), (1536, 8960),
      (16384, 4096), (32768, 4096), (4096, 12288), (4096, 4096), (1000, 1040), (64, 256), (8192, 8192), (12288, 4096)]

def d(t):
    return {"type": type(t).__name__, **t._asdict()}

def w4_choice(m, n, k, gen):
    """What the old wo_gemm ran for an int4 g128 weight and bf16 x on a GPU of ``gen``."""
    cuda_ok = gen != "none"
    cfg = launch.w4_config(m, n, k)
    if cfg.kernel == "frag":
        if cuda_ok and m <= cuda_w4.MAX_M:
            return d(cuda_w4.FragConfig(nw=cfg.num_warps, blocks_per_sm=cfg.waves or 4.0, stages=cfg.num_stages))
        cfg = launch._w4_triton_config(m, n, k, "swapb")
    if cfg.kernel == "wgmma":
        if cuda_ok and m <= cuda_w4.WGMMA_TOKENS[-1]:
            return d(launch.wgmma_config(m, n, k))
        cfg = launch._w4_triton_config(m, n, k, "swapb")
    if cfg.kernel == "tile":
        if cuda_ok and m <= cuda_w4.TILE_MAX_M:
            return d(launch.w4_tile_config(m, n, k))
        cfg = launch._w4_triton_config(m, n, k, "swapb")
    return d(cfg)

def wo_choice(m, n, k):
    if launch.WO_DEQUANT_MIN_M is not None and m >= launch.WO_DEQUANT_MIN_M:
        return {"type": "dequant"}
    return d(launch.wo_config(m, n, k))

rows = []
for gen in ("sm80", "sm89", "sm90", "none"):
    cuda_w4.wgmma_available = (lambda g=gen: g == "sm90")
    for m in MS:
        for n, k in NK:
            r = {"gen": gen, "m": m, "n": n, "k": k, "w4": w4_choice(m, n, k, gen)}
            if gen == "sm80":  # the other families do not depend on the GPU in c62667c
                r["wo"] = wo_choice(m, n, k)
                r["fp8"] = d(launch.fp8_config(m, n, k))
                r["int8"] = d(launch.int8_config(m, n, k))
                r["w4a8"] = d(launch.w4a8_config(m, n, k))
                for act in ("fp8", "int8"):
                    g = launch.gated_config(m, 2 * n, k, act)
                    r["gated_" + act] = None if g is None else d(g)
                r["act_quant"] = list(launch.act_quant_config(m, k))
            rows.append(r)
json.dump({"commit": "c62667c", "rows": rows}, sys.stdout, indent=None)
