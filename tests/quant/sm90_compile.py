"""Compile kernels that only a GPU runs for Hopper (sm_90) on any machine: the CPU tests run
them through Triton's interpreter, which accepts code the compiler refuses. Run as a script in a
child process (under TRITON_INTERPRET nothing compiles); prints ``{kernel variant: cubin
bytes}`` as JSON. The variants: the fused MoE routing, the rope + KV-store launch with and
without Qwen3's q / k norms and the fp8 cache, and the invariant attention's two decode paths."""

from __future__ import annotations

import json
import sys

from tests.quant.sass_count import _compile

_I32 = "i32"


def _route() -> dict[str, int]:
    from quarl.quant.kernels.moe_route import _route_kernel

    out = {}
    for dt, k, block_k, norm in (("bf16", 8, 8, True), ("fp32", 6, 8, False)):
        sig = {"logits_ptr": f"*{dt}", "w_ptr": f"*{dt}", "ids_ptr": "*i64", "N": _I32, "E": _I32, "stride_l": _I32}
        consts = {"TOP_K": k, "BLOCK_K": block_k, "NORM": norm, "BLOCK_T": 16, "BLOCK_E": 128}
        out[f"route {dt} k={k}"] = len(_compile(_route_kernel, sig, consts, 4, 3))
    return out


def _rope_store() -> dict[str, int]:
    from quarl.rollout.fused import _rope_store_kv_kernel

    out = {}
    for fp8 in (False, True):
        for norm in (False, True):
            cache = "*u8" if fp8 else "*bf16"
            sig = {**dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "qo_ptr"), "*bf16"),
                   "kc_ptr": cache, "vc_ptr": cache, "ks_ptr": "*fp32", "vs_ptr": "*fp32", "slot_ptr": "*i64",
                   "qn_ptr": "*bf16", "kn_ptr": "*bf16", "q_eps": "fp32", "k_eps": "fp32",
                   **dict.fromkeys(("n_q", "n_kv", "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
                                    "stride_vh", "stride_ct", "stride_ot", "stride_oh"), _I32)}
            consts = {"D": 128, "HALF": 64, "BLOCK_HQ": 32, "BLOCK_HKV": 4, "BLOCK_D": 64, "BLOCK_DV": 128,
                      "KV_FP8": fp8, "QK_NORM": norm, "PDL": False}
            out[f"rope_store fp8={fp8} qk_norm={norm}"] = len(_compile(_rope_store_kv_kernel, sig, consts, 4, 3))
    return out


def _attention() -> dict[str, int]:
    from quarl.quant.kernels.invariant_attention import inv_attention_kernel, inv_attention_merge_kernel

    out = {}
    for partial in (False, True):
        acc = "*fp32" if partial else "*bf16"
        sig = {**dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "ks_ptr", "vs_ptr"), "*bf16"), "bt_ptr": "*i32",
               "cu_q_ptr": "*i32", "kv_len_ptr": "*i32", "out_ptr": acc, "ml_ptr": acc, "qk_scale": "fp32",
               **dict.fromkeys(("T", "HQ", "NSPLIT", "stride_qt", "stride_qh", "stride_kb", "stride_kt", "stride_kh",
                                "stride_sb", "stride_st", "stride_bt", "stride_ot", "stride_oh"), _I32)}
        consts = {"GROUP": 6, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_R": 64, "BLOCK_N": 64, "SPLIT": 512, "PAGE": 16,
                  "KV_FP8": False, "PRECISION": "tf32", "INTERP_BF16": False, "PARTIAL": partial}
        out[f"invariant attention partial={partial}"] = len(_compile(inv_attention_kernel, sig, consts, 4, 2))
    sig = {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "kv_len_ptr": "*i32", "out_ptr": "*bf16",
           **dict.fromkeys(("T", "HQ", "NSPLIT", "stride_ot", "stride_oh"), _I32)}
    consts = {"GROUP": 6, "HEAD_DIM": 128, "BLOCK_D": 128, "SPLIT": 512, "BLOCK_G": 16}
    out["invariant attention merge"] = len(_compile(inv_attention_merge_kernel, sig, consts, 4, 1))
    return out


if __name__ == "__main__":
    parts = {"route": _route, "rope_store": _rope_store, "attention": _attention}
    print(json.dumps({k: v for name in (sys.argv[1:] or parts) for k, v in parts[name]().items()}))
