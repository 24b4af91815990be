"""Run-10 check on the GPU: the engine's fused RMSNorm / rotary / SiLU kernels (and their fused
quantizers) against torch and act_quant, counting differing elements (0 expected)."""
import torch, torch.nn.functional as F
from quarl.rollout.fused import rope, rmsnorm, silu_mul
from quarl.model.transformer import apply_rotary, RMSNorm
from quarl.quant.kernels import launch
torch.manual_seed(0)
DEV="cuda"
q = torch.randn(37, 12, 128, device=DEV, dtype=torch.bfloat16)
cos, sin = torch.randn(37, 128, device=DEV, dtype=torch.bfloat16), torch.randn(37, 128, device=DEV, dtype=torch.bfloat16)
ref = apply_rotary(q[None], cos[None], sin[None])[0]
print("rope n_diff", int((rope(q, cos, sin) != ref).sum()))
x = torch.randn(70, 3584, device=DEV, dtype=torch.bfloat16) * 4
norm = RMSNorm(3584, 1e-6).to(DEV).to(torch.bfloat16)
with torch.no_grad():
    norm.weight.normal_(1.0, 0.2)
    print("rmsnorm n_diff", int((rmsnorm(x, norm.weight, 1e-6) != norm(x)).sum()), "of", x.numel())
g, u = torch.randn(70, 18944, device=DEV, dtype=torch.bfloat16) * 3, torch.randn(70, 18944, device=DEV, dtype=torch.bfloat16)
print("silu n_diff", int((silu_mul(g, u) != F.silu(g) * u).sum()), "of", g.numel())
for fmt in ("int8", "fp8"):
    qq, s = rmsnorm(x, norm.weight, 1e-6, quant=fmt)
    qr, sr = launch.act_quant(rmsnorm(x, norm.weight, 1e-6), fmt)
    q2, s2 = silu_mul(g, u, quant=fmt); q2r, s2r = launch.act_quant(silu_mul(g, u), fmt)
    print(fmt, "rmsnorm codes diff", int((qq.view(torch.uint8) != qr.view(torch.uint8)).sum()), "scales eq", bool(torch.equal(s, sr)),
          "silu codes diff", int((q2.view(torch.uint8) != q2r.view(torch.uint8)).sum()), bool(torch.equal(s2, s2r)))
