"""Keeping the engine's weights equal to the learner's, per training mode.

- ``bf16``: the learner's tensors are copied into the engine.
- ``rollout``: the learner's full-precision linears are quantized at publish time (the
  FlashRL/QuRL setting: the sampler sees ``Q(theta)``, the learner ``theta``).
- ``aligned`` (QaRL): the learner's linears are :class:`QATLinear`; their forward
  already made the packed tensors, and those exact tensors are published.

Each publish also measures how the low-bit weights moved (docs/design.md metric names):
``quant/update_visible_frac`` (codes changed since the last publish),
``quant/rel_update`` (QuRL eq. 13) and ``quant/rel_quant_err`` (QuRL eq. 14). On big
models these are estimated on up to four decoder layers (first, two middle, last).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from quarl.config import QuantConfig
from quarl.distributed import Dist
from quarl.learner.sharded import full, is_sharded, published_quantized
from quarl.model.lora import adapter_state_dict, add_lora
from quarl.model.transformer import Transformer
from quarl.quant import (
    QATLinear,
    QuantLinear,
    QuantMode,
    publish_model,
    quantize_model,
    quantize_weights,
    rel_quant_err,
    rel_update,
    update_visible_frac,
)
from quarl.quant.experts import PROJECTIONS, PackedExperts, QATExperts
from quarl.quant.linear import selected_experts, selected_linears
from quarl.quant.scheme import get_scheme
from quarl.rollout import Engine, EngineConfig


def build_engine_and_publisher(
    learner_model: Transformer, quant: QuantConfig, engine_config: EngineConfig, lora: LoRASettings | None = None,
    dist: Dist = Dist(), kv_cache: bool = True, record_routes: bool = False,
) -> tuple[Engine, "Publisher | LoRAPublisher"]:
    """The one place where the quantization mode shapes the models.

    The engine gets a copy of ``learner_model`` in ``quant.scheme`` (bf16 in ``bf16``
    mode); in ``aligned`` mode the learner's selected linears become :class:`QATLinear`
    over the same parameters, and with an fp8 KV cache (``engine_config.kv_cache_dtype``)
    the learner's attention rounds K/V as that cache does (``learner_model.kv_quant``).
    In ``bf16`` / ``rollout`` mode the learner stays full precision: the fp8 cache is then
    part of the rollout-only mismatch. The publisher keeps the engine equal to the learner.
    With ``lora`` the base is frozen and shared instead (:func:`build_lora_engine`).
    ``quant.exact``: both models get ``exact`` (the engine's block size and fp8 cache, which the
    learner's exact forward mirrors, :mod:`quarl.quant.kernels.invariant_model`) before the
    engine's copy is made; the learner then mirrors an fp8 cache in every mode.
    ``kv_cache=False``: the engine's KV cache is sized and made later
    (``engine.reallocate_kv_cache()``, once the learner has freed what it will free).
    ``record_routes``: the engine records the experts of an MoE model's rollouts.
    """
    if quant.exact:
        _set_exact(learner_model, engine_config, quant.exact_update)
    if lora is not None:
        return build_lora_engine(learner_model, quant, engine_config, lora, kv_cache, record_routes)
    engine = Engine(_engine_copy(learner_model, quant), scheme=quant.scheme, config=engine_config,
                    include=quant.include, exclude=quant.exclude, kv_cache=kv_cache, record_routes=record_routes)
    if quant.mode.learner_quantized:
        quantize_model(learner_model, quant.scheme, QATLinear, include=quant.include, exclude=quant.exclude)
    learner_model.kv_quant = learner_kv_quant(quant.mode, engine_config.kv_cache_dtype, quant.exact)
    return engine, Publisher(learner_model, engine, quant.mode, dist)


@dataclasses.dataclass(frozen=True)
class LoRASettings:
    rank: int
    alpha: float
    targets: tuple[str, ...]


def build_lora_engine(model: Transformer, quant: QuantConfig, engine_config: EngineConfig,
                      lora: LoRASettings, kv_cache: bool = True,
                      record_routes: bool = False) -> tuple[Engine, "LoRAPublisher"]:
    """A LoRA run (docs/lora.md): ``model``'s selected linears become
    frozen :class:`QuantLinear` in ``quant.scheme`` (left plain in ``bf16`` mode, or kept if
    they already are: a base loaded quantized), every parameter is frozen, and the target
    linears get adapters. The engine's model shares every frozen tensor with the learner's:
    after the engine has fused its projections, the learner's linears are pointed at the
    engine's buffers, so one copy of the base exists. Only the adapters are the engine's own,
    refreshed by the publisher. The learner's base linears run :class:`_FrozenQuantMatmul`
    (``learner_path``): the engine's weights, a gradient to their input, none to them. In exact
    mode (``model.exact`` set) both sides run every LoRA layer through
    :func:`~quarl.quant.kernels.invariant_model.exact_lora` on the (shared, fused) base."""
    if quant.scheme.quantizes_weights or quant.scheme.quantizes_activations:
        quantize_model(model, quant.scheme, QuantLinear, include=quant.include, exclude=quant.exclude)
    add_lora(model, lora.rank, lora.alpha, lora.targets)
    engine_model = _copy_sharing_frozen(model)
    if (engine_config.fused_kernels or model.exact is not None) and next(model.parameters()).is_cuda:
        from quarl.rollout.fused import fuse_projections, supports_fused

        if supports_fused(engine_model):
            # fused before the engine sizes its KV cache from the free memory, and the learner moved
            # onto the fused buffers at once: the unfused copies of q/k/v and gate/up are gone by then
            fuse_projections(engine_model)
            share_frozen(model, engine_model)
    engine = Engine(engine_model, scheme=quant.scheme, config=engine_config, include=quant.include,
                    exclude=quant.exclude, kv_cache=kv_cache, record_routes=record_routes)
    share_frozen(model, engine.model)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.learner_path = True
    model.kv_quant = "fp8" if engine_config.kv_cache_dtype == "fp8" else None
    return engine, LoRAPublisher(model, engine)


def _set_exact(model: Transformer, engine_config: EngineConfig, update: str = "recompute") -> None:
    """``quant.exact``: ``model.exact`` (the engine's block size and fp8 cache, which the learner's
    exact forward mirrors, and ``quant.exact_update``), set before the engine's copy is made so
    that both carry it."""
    from quarl.quant.kernels.invariant_model import ExactMode

    model.exact = ExactMode(engine_config.block_size, engine_config.kv_cache_dtype == "fp8", update)


def _engine_copy(model: nn.Module, quant: QuantConfig) -> nn.Module:
    """The engine's copy of the learner's model. Where the engine's scheme packs weights, the
    tensors of the linears and experts it packs are the learner's own in the copy, not copies:
    the engine quantizes them and swaps those modules out at once (reading, never writing
    them), so no second full-precision copy of the model exists even briefly (a 30B MoE's
    61 GB in bf16 twice would not fit one 80 GB GPU)."""
    if not get_scheme(quant.scheme).quantizes_weights:
        return copy.deepcopy(model)
    packed = selected_linears(model, quant.include, quant.exclude) + selected_experts(model, quant.include,
                                                                                      quant.exclude)
    shared = [t for name in packed for t in model.get_submodule(name).parameters(recurse=False)]
    return copy.deepcopy(model, memo={id(t): t for t in shared})


def _copy_sharing_frozen(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose frozen tensors are ``model``'s own (not copies). Its own
    function so that no list of those tensors outlives it: once the engine fuses its copy and
    the learner is moved onto the fused buffers, nothing may keep the unfused ones alive while
    the engine sizes its KV cache from the free memory."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    packed = (QuantLinear, PackedExperts)
    frozen += [b for m in model.modules() if isinstance(m, packed) for b in m.buffers(recurse=False)]
    return copy.deepcopy(model, memo={id(t): t for t in frozen})


@torch.no_grad()
def share_frozen(learner: nn.Module, engine_model: nn.Module) -> None:
    """Point ``learner``'s frozen tensors at ``engine_model``'s where the engine re-made them
    (its fused q/k/v and gate/up buffers, whose row blocks became its modules' tensors): the
    same values, one copy. Trainable tensors (the adapters) stay the learner's own."""
    engine_mods = dict(engine_model.named_modules())
    for name, mod in learner.named_modules():
        twin = engine_mods.get(name)
        if twin is None:
            continue
        for pname, p in list(mod.named_parameters(recurse=False)):
            other = getattr(twin, pname, None)
            if not p.requires_grad and isinstance(other, torch.Tensor) and other is not p:
                setattr(mod, pname, other if isinstance(other, nn.Parameter) else nn.Parameter(other, False))
        if isinstance(mod, (QuantLinear, PackedExperts)):
            for f in mod._fields:
                setattr(mod, f, getattr(twin, f))


class LoRAPublisher:
    """Keeps the engine's adapters equal to the learner's: a publish copies the adapter tensors
    (``A`` and ``B`` of every adapted linear) into the engine's in place; the base is shared
    and never moves."""

    def __init__(self, learner_model: nn.Module, engine: Engine) -> None:
        self.learner_model = learner_model
        self.engine = engine
        self.last_bytes = 0

    @torch.no_grad()
    def published(self) -> dict[str, torch.Tensor]:
        return {n: full(t) for n, t in adapter_state_dict(self.learner_model).items()}  # (sharded: gathered)

    @torch.no_grad()
    def publish(self) -> dict[str, float]:
        pub = self.published()
        self.engine.load_weights(pub)
        self.last_bytes = sum(t.numel() * t.element_size() for t in pub.values())
        return {"publish/bytes": float(self.last_bytes)}


def learner_kv_quant(mode: QuantMode, kv_cache_dtype: str, exact: bool = False) -> str | None:
    """The learner's K/V rounding: the engine's fp8 cache format in ``aligned`` mode (and in
    exact mode, whatever the mode), else none."""
    return "fp8" if (mode.learner_quantized or exact) and kv_cache_dtype == "fp8" else None


def _metric_layers(num_layers: int) -> set[int]:
    return {0, num_layers // 3, (2 * num_layers) // 3, num_layers - 1}


class Publisher:
    """Keeps the engine's weights equal to the learner's (module docstring). A sharded learner
    (:mod:`quarl.learner.sharded`) publishes whole weights to every rank's engine: low-bit
    weights quantized shard by shard and gathered packed, the others gathered in the model's
    dtype (every rank publishes: the gathers are collectives)."""

    def __init__(self, learner_model: nn.Module, engine: Engine, mode: QuantMode, dist: Dist = Dist()) -> None:
        self.dist = dist
        self.mode = mode
        self.engine = engine
        self.scheme = engine.scheme if mode.engine_quantized else None
        self.learner_model = learner_model
        self.quantized = [n + ".weight" for n, m in engine.model.named_modules() if isinstance(m, QuantLinear)]
        keep = _metric_layers(len(learner_model.layers))
        self.tracked = [n for n in self.quantized if int(n.split(".")[1]) in keep]
        self._prev_codes: dict | None = None
        self._prev_weights: dict | None = None

    @torch.no_grad()
    def published(self) -> dict:
        if any(is_sharded(p) for p in self.learner_model.parameters()):
            return self._published_sharded()
        if self.mode.learner_quantized:
            return publish_model(self.learner_model)
        out = {n: p.detach() for n, p in self.learner_model.named_parameters()}
        if self.quantized:
            out.update(zip(self.quantized, quantize_weights([out[n] for n in self.quantized], self.scheme)))
        return out

    def _published_sharded(self) -> dict:
        params = dict(self.learner_model.named_parameters())
        dtype = self.learner_model.compute_dtype
        if self.mode.learner_quantized:
            # every quantized master by published name: a linear's weight, an MoE block's projections
            qat = {}
            for n, m in self.learner_model.named_modules():
                if isinstance(m, QATLinear):
                    qat[f"{n}.weight"] = (m.scheme, m.weight)
                elif isinstance(m, QATExperts):
                    qat.update((f"{n}.{proj}", (m.scheme, getattr(m, proj))) for proj in PROJECTIONS)
            quantized = {}
            for scheme in {sc for sc, _ in qat.values()}:
                weights = {n: w.detach() for n, (sc, w) in qat.items() if sc == scheme}
                quantized.update(published_quantized(weights, scheme, self.dist, dtype))
        else:
            quantized = published_quantized({n: params[n].detach() for n in self.quantized}, self.scheme, self.dist,
                                            dtype) if self.quantized else {}
        out = {n: full(p.detach(), dtype if is_sharded(p) else None) for n, p in params.items() if n not in quantized}
        out.update(quantized)
        return out

    @torch.no_grad()
    def publish(self) -> dict[str, float]:
        pub = self.published()
        self.engine.load_weights(pub)
        if self.scheme is None or not self.tracked:
            return {}
        params = dict(self.learner_model.named_parameters())
        qws = {n: pub[n] for n in self.tracked}
        dtype = self.learner_model.compute_dtype  # (a sharded learner's weights: gathered in it)
        weights = {n: full(params[n].detach(), dtype if is_sharded(params[n]) else None) for n in self.tracked}
        metrics = {"quant/rel_quant_err": rel_quant_err(weights, qws)}
        if self._prev_codes is not None:
            metrics["quant/update_visible_frac"] = update_visible_frac(self._prev_codes, qws)
            metrics["quant/rel_update"] = rel_update(weights, self._prev_weights)
        self._prev_codes = {n: q.clone() for n, q in qws.items()}
        self._prev_weights = {n: w.clone() for n, w in weights.items()}
        return metrics
