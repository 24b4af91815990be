"""The learner's weights sharded over the ranks with FSDP2 (``trainer.shard_learner``).

Data-parallel ranks each hold the whole policy, its gradients and its optimizer states; a
sharded learner holds ``1/world`` of them instead. :func:`shard_model` wraps each decoder
layer in ``torch.distributed.fsdp.fully_shard`` (its weights gathered just before its
forward and backward, dropped after, its gradients reduce-scattered) and the model in one
more, the root, which holds the embeddings and the LM head: gathered when
``Transformer.hidden_states`` starts (an FSDP forward method) and kept until the backward is
done, since the log-probs use the LM head after the layers.

What stays whole on every rank (replicated, its gradient summed over the ranks as data
parallel sums it): every RMSNorm weight. A layer's block ends with the *next* layer's input
norm (fused into the block's last kernel, as the engine fuses it), which must be readable
while that next layer is still sharded; they are a few thousand numbers per layer.

Master weights: with ``optim.fp32_master`` a 16-bit model's sharded weights are stored in
float32 and gathered in the model's dtype (``MixedPrecisionPolicy``: the gathered values are
the fp32 masters rounded to nearest, what ``MasterWeights.masters_to_model`` writes into an
unsharded model) and their gradients are reduced in float32; the optimizer steps the float32
shards directly. The replicated weights keep their ``MasterWeights``.

Aligned (QAT) linears quantize the gathered weight in each forward (the cached quantized
weight is dropped before every layer's forward, :func:`_fresh_quantization`) and dequantize
it per use with a straight-through gradient that autograd itself carries to the gathered
weight (:func:`~quarl.quant.linear.set_straight_through`: in the compiled regions too), so
FSDP's reduce-scatter finds it when the backward leaves the layer.

The gradient of a rank's loss is that rank's share of the mini-batch loss (the learner
normalises by the totals over all ranks), so the reduce-scatter sums (divide factor 1) as
:meth:`~quarl.distributed.Dist.sum_grads_` does.

Checkpoints: every rank writes its own shards with ``torch.distributed.checkpoint``, under
names that do not depend on sharding or the number of ranks
(:meth:`~quarl.learner.trained.Trained.dcp_tensors`); a whole-tensor state is gathered on
every rank (:func:`full`) and loads back into shards (:func:`load_full_`). Either form
resumes on any number of ranks, sharded or not.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from quarl.distributed import Dist
from quarl.model.transformer import RMSNorm, Transformer
from quarl.quant.linear import invalidate_quantized, set_straight_through
from quarl.quant.qweight import QuantizedWeight, quantize_weights
from quarl.quant.scheme import QuantScheme


def is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)


def shard_model(model: Transformer, dist: Dist, fp32_master: bool = True) -> None:
    """Shard ``model`` over ``dist``'s ranks in place: each decoder layer a unit, the root the
    embeddings and LM head, the norms whole (module docstring); ``fp32_master``: a 16-bit
    model's sharded weights become its float32 masters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    if dist.world == 1:
        raise ValueError("sharding the learner needs several ranks (launch with torchrun --nproc_per_node=N)")
    device = model.embed_tokens.weight.device
    mesh = init_device_mesh(device.type, (dist.world,))
    dtype = model.compute_dtype
    masters = fp32_master and dtype in (torch.bfloat16, torch.float16)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if masters else MixedPrecisionPolicy()
    norms = {p for m in model.modules() if isinstance(m, RMSNorm) for p in m.parameters()}

    def unit(module: nn.Module, params: list[nn.Parameter]) -> nn.Module:
        if masters:  # (each unit just before it is sharded: one unit's float32 copy is ever whole)
            for p in params:
                if p.requires_grad and p not in norms:
                    p.data = p.data.float()
        return fully_shard(module, mesh=mesh, mp_policy=mp, ignored_params=norms & set(module.parameters()))

    units: list[nn.Module] = []
    for layer in model.layers:
        layer.register_forward_pre_hook(_fresh_quantization)
        units.append(unit(layer, list(layer.parameters())))
    # the root: the embeddings and the LM head, gathered when hidden_states starts and kept through
    # the log-probs that follow (the LM head's use, and a tied one's second use of the embeddings)
    in_layers = set(model.layers.parameters())
    units.append(unit(model, [p for p in model.parameters() if p not in in_layers]))
    register_fsdp_forward_method(model, "hidden_states")
    # (newer torch warns that the root's output, a view of the last layer's rows, would lose
    # its pre-backward hook to an in-place op; nothing writes to it in place: the log-probs
    # read it, and the sharded tests check every gradient against one process)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
    set_straight_through(model)
    for u in units:  # a sum: each rank's loss is already its share of the mini-batch's
        u.set_gradient_divide_factor(1.0)
        u.set_force_sum_reduction_for_comms(True)


def reshard(module: nn.Module) -> None:
    """Every sharded unit of ``module`` back in shards: a root stays gathered after a forward
    without gradients (its weights then take memory through the rollout). Nothing for a
    module that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _fresh_quantization(layer: nn.Module, args) -> None:
    """Before a sharded layer's forward: its aligned linears quantize the weight about to be
    gathered (the cache keyed on a weight's storage cannot see a new gather's values)."""
    invalidate_quantized(layer)


def full(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor (gathered from the ranks: every rank must call this), in ``dtype``;
    a replicated tensor as it is."""
    if dtype is not None:
        t = t.to(dtype)
    return t.full_tensor() if is_sharded(t) else t


@torch.no_grad()
def load_full_(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy the whole tensor ``value`` into ``target``: into its shard when sharded (every rank
    holds ``value``: no communication)."""
    if is_sharded(target):
        value = distribute_tensor(value.to(device=target.device, dtype=target.dtype), target.device_mesh,
                                  target.placements, src_data_rank=None)
        target.to_local().copy_(value.to_local())
    else:
        target.copy_(value)


def as_sharded_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole tensor ``value`` as a DTensor placed as ``like`` is (optimizer states)."""
    return distribute_tensor(value.to(device=like.device), like.device_mesh, like.placements, src_data_rank=None)


@torch.no_grad()
def clip_grad_norm_(params: list[torch.Tensor], max_norm: float, dist: Dist) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over sharded and replicated gradients together: the
    squares of the shards summed over the ranks, those of the replicated gradients (equal on
    every rank) once. Returns the total norm (float32, 0-d)."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g.to_local() for g in grads if is_sharded(g)]
    replicated = [g for g in grads if not is_sharded(g)]
    device = (sharded or replicated)[0].device if grads else torch.device("cpu")
    sq = torch.zeros(2, dtype=torch.float32, device=device)
    for i, part in enumerate((sharded, replicated)):
        for g in part:
            sq[i] += g.float().pow(2).sum()
    sharded_sq = dist.sum_tensor_(sq[:1].clone())
    total = (sharded_sq[0] + sq[1]).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in sharded + replicated:
        g.mul_(coef.to(g.dtype))
    return total


@torch.no_grad()
def published_quantized(weights: dict[str, torch.Tensor], scheme: QuantScheme, dist: Dist,
                        dtype: torch.dtype) -> dict[str, QuantizedWeight]:
    """Sharded weights quantized as the engine loads them: each rank quantizes its own rows of
    each weight (in ``dtype``, the gathered weights' dtype) and the ranks exchange the packed
    row blocks, so what travels is the low-bit tensors, not the weights. Every scale is per
    row or per group of a row, so the result is bit for bit the quantization of the whole
    weight. A stacked MoE projection ``[E, N, K]`` (sharded by experts) is quantized as its
    ``[E * N, K]`` view, each expert's rows as a block. A scheme with a per-tensor scale
    (nvfp4) gathers each weight in ``dtype`` and quantizes it whole (a replicated weight is
    whole already)."""
    whole = [n for n in weights if scheme.per_tensor_scale or not is_sharded(weights[n])]
    out = dict(zip(whole, quantize_weights([_rows(full(weights[n], dtype)) for n in whole], scheme)))
    names = [n for n in weights if n not in out]
    shards = [_rows(weights[n].to_local().to(dtype)) for n in names]
    # (a rank whose shard of a small weight is empty quantizes a row of zeros and sends none)
    local = quantize_weights([w if len(w) else w.new_zeros(1, w.shape[1]) for w in shards], scheme)
    for n, w, qw in zip(names, shards, local):
        full_shape = weights[n].shape
        per_item = math.prod(full_shape[1:-1])  # rows of one index of the sharded dim (an expert's N)
        per = math.ceil(full_shape[0] / dist.world) * per_item
        out[n] = _gather_rows(qw, len(w), full_shape[0] * per_item, dist, per)
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A weight as ``[rows, K]`` (a stacked ``[E, N, K]`` as ``[E * N, K]``)."""
    return t.reshape(-1, t.shape[-1])


def _gather_rows(qw: QuantizedWeight, mine: int, rows: int, dist: Dist, per: int) -> QuantizedWeight:
    """The whole ``[rows, K]`` quantized weight from every rank's first ``mine`` rows of
    ``qw`` (FSDP's shards: ``per`` rows each, the last ones shorter or empty)."""
    tensors = {}
    for field, t in qw.tensors().items():
        padded = t.new_zeros((per, *t.shape[1:]))
        padded[:mine] = t[:mine]
        parts = [torch.empty_like(padded) for _ in range(dist.world)]
        torch.distributed.all_gather(parts, padded)
        tensors[field] = torch.cat(parts)[:rows]
    return QuantizedWeight(qw.scheme, (rows, qw.in_features), **tensors)
