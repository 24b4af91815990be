"""Exact mode's MoE block: router, experts and the top-k combine, batch-invariant.

A token's output of a :class:`~quarl.model.moe.SparseMoeBlock` must not depend on the other
tokens of the step, yet its experts' GEMMs run on rows grouped with every other token routed
to the same expert (a few at decode, thousands in the learner). What fixes each step:

* router logits through the invariant dense GEMM (:func:`.invariant.dense_gemm`); the softmax,
  top-k and renormalisation of :func:`~quarl.model.moe.route` act on one row each (the block's
  ``route_tokens``, so routing replay and recording work as ever);
* each projection of all experts through the grouped kernel of :mod:`.moe_gemm` at one fixed
  tile (:func:`exact_tile`, never chosen from the row count): a program owns ``BM`` rows of one
  expert and walks K in the same 64-column steps, so a row's products are summed in one order
  whichever rows share its tile. Dense bf16 experts (:func:`.moe_gemm.grouped_gemm_dense`),
  int4 groups and W8A8 (rows quantized per token first, as the engine's experts see them) go
  through the same kernel;
* SiLU-and-mul and the routing weights elementwise; the sum over the k slots in a fixed order
  (``run_experts(slot_order=True)``).

The learner runs the same forward under autograd; its backward is the ordinary one, recomputed
(:class:`~.invariant_autograd.Recomputed`): the router's GEMM, and each projection's grouped GEMM
over the (dequantized) weight, straight-through to a :class:`~quarl.quant.experts.QATExperts`
master. Covered: :class:`~quarl.model.moe.Experts` (bf16 / fp16), the engine's
:class:`~quarl.quant.experts.QuantExperts` and the learner's ``QATExperts`` in w4a16, w4a16-asym,
w8a8-int8 and w8a8-fp8; experts with LoRA adapters raise.
"""

from __future__ import annotations

import torch
from torch import nn

from quarl.model.moe import Experts, SparseMoeBlock, grouped_linear, run_experts
from quarl.quant.experts import QATExperts, QuantExperts, grouped_quant_linear, seen_rows
from quarl.quant.kernels.act_quant import interpreting
from quarl.quant.kernels.invariant_autograd import invariant_or_recomputed
from quarl.quant.kernels.moe_gemm import MoeConfig, grouped_gemm, grouped_gemm_dense
from quarl.quant.kernels.moe_rules import moe_kernel_supports


def exact_tile(x: torch.Tensor) -> MoeConfig:
    """The one grouped-GEMM tile of exact mode: a function of the device kind only (the
    interpreter takes small tiles), never of the rows. Not tuned."""
    return MoeConfig(32, 64, 4, 1) if interpreting(x) else MoeConfig(64, 64, 4, 3)


def exact_moe_block(block: SparseMoeBlock, x: torch.Tensor, linear) -> torch.Tensor:
    """``block(x)`` (x ``[..., H]``) over the batch-invariant kernels (module doc); ``linear(x,
    weight)``: exact mode's differentiable dense GEMM (for the router)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    weights, ids = block.route_tokens(linear(flat, block.gate.weight), x.dtype)
    return exact_experts(block.experts, flat, ids, weights).view(shape)


def exact_experts(experts: nn.Module, x: torch.Tensor, expert_ids: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """``experts(x, expert_ids, weights)`` with every projection through the grouped kernel at
    :func:`exact_tile` and the slots summed in a fixed order."""
    if getattr(experts, "lora", None) is not None:
        raise NotImplementedError("exact mode has no path for LoRA adapters on experts (model.lora_targets "
                                  "names experts): adapt the attention projections only")
    num, inter = experts.num_experts, experts.intermediate_size
    if isinstance(experts, Experts):
        def fast(rows, w, offsets, name):
            return grouped_gemm_dense(rows, offsets, w.to(rows.dtype), exact_tile(rows))

        def ref(rows, w, offsets, name):
            return grouped_linear(rows, w.to(rows.dtype), offsets)
    elif isinstance(experts, (QuantExperts, QATExperts)):
        if not moe_kernel_supports(experts.scheme):
            raise NotImplementedError(f"exact mode's experts run int4 group and 8-bit schemes, not "
                                      f"{experts.scheme.name}")
        qws = experts.quantized_weights()

        def fast(rows, w, offsets, name):
            qw = qws[name]
            return grouped_gemm(seen_rows(rows, qw.scheme.act_format, rows.dtype), offsets, qw, num,
                                exact_tile(rows))

        def ref(rows, w, offsets, name):
            return grouped_quant_linear(rows, qws[name], offsets, num, master=w)
    else:
        raise NotImplementedError(f"exact mode runs Experts, QuantExperts and QATExperts, not "
                                  f"{type(experts).__name__}")

    def project(rows: torch.Tensor, name: str, offsets: torch.Tensor) -> torch.Tensor:
        # the weight a gradient may reach (none for the engine's frozen QuantExperts)
        w = None if isinstance(experts, QuantExperts) else getattr(experts, name)
        inputs = (rows,) if w is None else (rows, w)
        return invariant_or_recomputed(lambda r, p=None: fast(r, p, offsets, name),
                                       lambda r, p=None: ref(r, p, offsets, name), *inputs)

    return run_experts(x, expert_ids, weights, num, inter, project, slot_order=True)
