"""Why did the fp8 activation codes differ from torch's cast (GPU-only)? Runs the old
quantizer (fp32 rounding onto the e4m3 grid + Triton's ``.to(tl.float8e4nv)``) next to the
current byte-building one and torch's cast, on the GPU test's inputs; writes JSON.

    PYTHONPATH=. python3 bench/gemm_fp8_diag.py $OUT/fp8_diag.json
"""

import json
import os
import sys

import torch
import triton
import triton.language as tl

from quarl.quant import reference as ref
from quarl.quant.kernels import launch
from quarl.quant.kernels import triton_kernels as tk


@triton.jit
def _old_round_e4m3(v):
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    e_ulp = tl.maximum(e, -6) - 3
    ulp = ((e_ulp + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - e_ulp) << 23).to(tl.float32, bitcast=True)
    r = tk._rne(tl.abs(v) * inv_ulp) * ulp
    return tl.where(v < 0, -r, r)


@triton.jit
def _old_kernel(t_ptr, q_ptr, r_ptr, c_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    msk = offs < n
    t = tl.load(t_ptr + offs, mask=msk, other=0.0)
    r = _old_round_e4m3(t)
    tl.store(r_ptr + offs, r, mask=msk)  # the fp32 value the old kernel rounded to
    tl.store(q_ptr + offs, r.to(tl.float8e4nv), mask=msk)  # old: Triton's fp8 cast of it
    tl.store(c_ptr + offs, t.to(tl.float8e4nv), mask=msk)  # Triton's cast of t directly


DEV = os.environ.get("DIAG_DEVICE", "cuda")  # "cpu" with TRITON_INTERPRET=1: dry run
ROWS = int(os.environ.get("DIAG_ROWS", "300"))


def main():
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        x = (torch.randn(ROWS, 5000, device=DEV) * torch.logspace(-4, 3, ROWS, device=DEV)[:, None]).to(dtype)
        x[7] = 0
        q_new, s = launch.act_quant(x, "fp8")
        q_ref, s_ref = ref.quantize_activations(x, "fp8")
        t = (x.float() / s[:, None]).contiguous()  # same division as the reference
        n = t.numel()
        q_old = torch.empty(n, dtype=torch.float8_e4m3fn, device=DEV)
        q_tri = torch.empty(n, dtype=torch.float8_e4m3fn, device=DEV)
        r_old = torch.empty(n, dtype=torch.float32, device=DEV)
        _old_kernel[(triton.cdiv(n, 1024),)](t, q_old, r_old, q_tri, n, BLOCK=1024)
        ref_b = q_ref.view(torch.uint8).flatten()
        cpu_b = ref.to_e4m3(t.cpu()).view(torch.uint8).flatten().to(DEV)
        r_exact = ref.to_e4m3(r_old).float()  # is the old fp32 rounding itself on the grid / right?
        d = dict(
            scales_equal=bool(torch.equal(s, s_ref)),
            new_vs_torch=int((q_new.view(torch.uint8).flatten() != ref_b).sum()),
            old_vs_torch=int((q_old.view(torch.uint8) != ref_b).sum()),
            old_round_vs_torch_value=int((r_old != q_ref.float().flatten()).sum()),
            old_round_not_on_grid=int((r_exact != r_old).sum()),
            triton_cast_of_t_vs_torch=int((q_tri.view(torch.uint8) != ref_b).sum()),
            torch_cuda_vs_cpu_cast=int((ref_b != cpu_b).sum()),
        )
        bad = (q_old.view(torch.uint8) != ref_b).nonzero().flatten()[:12]
        d["examples"] = [dict(t=float(t.flatten()[i]), r_old=float(r_old[i]), old_byte=int(q_old.view(torch.uint8)[i]),
                              torch_byte=int(ref_b[i]), new_byte=int(q_new.view(torch.uint8).flatten()[i])) for i in bad.tolist()]
        out[str(dtype)] = d
        print(dtype, {k: v for k, v in d.items() if k != "examples"}, d["examples"][:4], flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
