"""Instructions in the main loop of a 4-bit GEMM kernel compiled for Hopper (sm_90), on any
machine: Triton compiles without a GPU and its wheel carries ``cuobjdump`` (docs/kernels.md,
"Counting a Triton kernel's instructions without a GPU"). Run as a script (the tests run it in
a child process: under TRITON_INTERPRET the kernels are not compiled):

    python -m tests.quant.sass_count moe BITS BM BN WARPS STAGES SWAP GATED   # grouped_gemm_kernel
    python -m tests.quant.sass_count invariant BM BN WARPS STAGES             # inv_weight_only_kernel, int4 g128

prints a JSON object: ``loop`` (instructions between the loop's backward branch and its target),
``ops`` (their count by opcode) and ``weights_per_thread`` (weights one iteration dequantizes per
thread)."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile

_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


_STRIDES = ("N", "K", "stride_xm", "stride_wn", "stride_sn", "stride_om")  # 16-divisible at real shapes


def _compile(kernel, sig: dict, consts: dict, warps: int, stages: int) -> bytes:
    """The sm_90 cubin of ``kernel`` with the launch's specialization: every pointer and the
    :data:`_STRIDES` integers marked 16-divisible (without it loads are not vectorized)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**sig, **dict.fromkeys(consts, "constexpr")}
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*") or n in _STRIDES}
    src = ASTSource(kernel, sig, consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    return k.asm["cubin"]


def compile_sm90(bits: int, bm: int, bn: int, warps: int, stages: int, swap: bool, gated: bool) -> bytes:
    """The cubin of the grouped kernel for the launch ``grouped_gemm`` makes with bf16 rows."""
    from quarl.quant.kernels.moe_gemm import BK, grouped_gemm_kernel

    w = {4: "*u8", 8: "*fp8e4nv", 16: "*bf16"}[bits]
    sig = {"x_ptr": "*bf16", "off_ptr": "*i32", "w_ptr": w, "s_ptr": "*fp32", "z_ptr": "*fp32",
           "out_ptr": "*bf16", "src_ptr": "*i64", "dst_ptr": "*i64", "rw_ptr": "*bf16",
           **dict.fromkeys(("N", "K", "E", "NCHUNK", "M_TILES", "stride_xm", "stride_wn", "stride_sn",
                            "stride_om"), "i32")}
    consts = {"BITS": bits, "ASYM": False, "G": BK if bits == 4 else 1, "EP": 128, "SWAP": swap, "BM": bm,
              "BN": bn, "GROUP_M": 8, "ROUND_BF16": False, "PACKED_BF16": bits == 4, "GATED": gated,
              "SLOTS": 8 if gated else 0, "SCATTER": False}
    return _compile(grouped_gemm_kernel, sig, consts, warps, stages)


def compile_invariant_sm90(bm: int, bn: int, warps: int, stages: int) -> bytes:
    """The cubin of the batch-invariant weight-only GEMM on symmetric int4 (group 128) with bf16
    rows, one K segment, as ``weight_only_gemm`` launches it."""
    from quarl.quant.kernels.invariant import inv_weight_only_kernel

    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "z_ptr": "*fp32", "gs_ptr": "*fp32",
           "bias_ptr": "*fp32", "out_ptr": "*bf16",
           **dict.fromkeys(("M", "N", "K", "NCHUNK", "SEG_C", "stride_xm", "stride_wn", "stride_sn", "stride_om"),
                           "i32")}
    consts = {"FMT": 0, "BITS": 4, "G": 128, "BM": bm, "BN": bn, "HAS_BIAS": False, "PRECISION": "tf32",
              "INTERP_BF16": False, "SEGMENTED": False, "PARTIAL": False}
    return _compile(inv_weight_only_kernel, sig, consts, warps, stages)


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes (without modifiers) of the longest backward-branch loop of a SASS listing."""
    ins = [(int(m.group(1), 16), m.group(2), line) for line in sass.splitlines() if (m := _INSTR.match(line))]
    best: list[str] = []
    for off, op, line in ins:
        target = re.search(r"0x([0-9a-f]+)", line.split(op, 1)[1]) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < off:
            body = [o for at, o, _ in ins if int(target.group(1), 16) <= at <= off]
            best = max(best, body, key=len)
    return collections.Counter(o.split(".")[0] for o in best)


def cuobjdump() -> str:
    """The ``cuobjdump`` Triton uses (its wheel's, or ``TRITON_CUOBJDUMP_PATH``)."""
    from triton import knobs

    return knobs.nvidia.cuobjdump.path


def count(*args: object) -> dict:
    """This script's JSON for ``args``, run in a child process without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-m", "tests.quant.sass_count", *map(str, args)], env=env, cwd=root,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main(argv: list[str]) -> None:
    kind, args = argv[0], [int(a) for a in argv[1:]]
    if kind == "moe":
        bits, bm, bn, warps, stages, swap, gated = args
        cubin = compile_sm90(bits, bm, bn, warps, stages, bool(swap), bool(gated))
        weights = 128 * bn * (2 if gated else 1) // (32 * warps)  # one K step of BK = 128 columns
    else:
        bm, bn, warps, stages = args
        cubin = compile_invariant_sm90(bm, bn, warps, stages)
        weights = 128 * bn // (32 * warps)  # one packed chunk of 128 columns
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([cuobjdump(), "-sass", f.name], check=True, capture_output=True, text=True).stdout
    ops = loop_opcodes(sass)
    print(json.dumps({"loop": sum(ops.values()), "ops": dict(ops), "weights_per_thread": weights}))


if __name__ == "__main__":
    main(sys.argv[1:])
