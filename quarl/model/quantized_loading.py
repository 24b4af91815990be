"""Load a BF16/FP32 Hugging Face checkpoint straight into the engine's packed linears.

:func:`load_quantized_model` gives the model that ``load_model`` followed by
``quantize_model(model, scheme, QuantLinear, include, exclude)`` gives, bit for bit, without
ever holding the full-precision linears on the device: the model is built on the meta
device, the safetensors shards are read one tensor at a time, and each selected linear's
weight is moved to the device alone, quantized there by
:func:`~quarl.quant.qweight.quantize_weight` (the quantizer the engine and learner use) and
dropped, its packed tensors becoming the :class:`~quarl.quant.QuantLinear`'s buffers. The
device's peak is the packed model, the unquantized tensors (embeddings, norms, LM head,
biases) and one linear's weight with the quantizer's temporaries: a 32B model in w4a16 needs
~18 GB, not its 64 GB of BF16.

With ``cache_dir`` the packed model is also written to disk, and later calls with the same
inputs read it back instead of quantizing. An entry is ``cache_dir/<key>/``:
``packed-NNNNN.safetensors`` shards (every persistent tensor of the model under its module
name, as it was on the device) and ``manifest.json`` (format version, scheme, the quantized
module names, the shard list). ``<key>`` hashes everything the result depends on
(:func:`packed_cache_key`); an entry is written under a temporary name and renamed into
place, so it is either complete or absent, and a damaged one (a truncated shard) is
reported with a warning and rebuilt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from quarl.model.loading import (
    CheckpointError,
    checkpoint_config,
    checkpoint_files,
    checkpoint_keys,
    checkpoint_plan,
    hf_name,
    load_model,
    normal_permissions,
    open_weights,
)
from quarl.model.config import TransformerConfig
from quarl.model.moe import ExpertLayout, Experts
from quarl.model.transformer import Rotary, Transformer
from quarl.quant.experts import PROJECTIONS, QuantExperts
from quarl.quant.linear import DEFAULT_INCLUDE, QuantLinear, selected_experts, selected_linears
from quarl.quant.qweight import quantize_weight
from quarl.quant.scheme import QuantScheme, get_scheme

# 2: int-group scales are bf16 values (reference.bf16_scale); 3: MoE experts packed (QuantExperts)
CACHE_FORMAT_VERSION = 3
CACHE_SHARD_BYTES = 1 << 31  # host memory a cache write or read holds at once
_MANIFEST = "manifest.json"

log = logging.getLogger(__name__)


def load_quantized_model(
    path: str | Path,
    scheme: QuantScheme | str,
    dtype: torch.dtype | None = torch.bfloat16,
    device: str | torch.device = "cpu",
    include: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    cache_dir: str | Path | None = None,
) -> Transformer:
    """The checkpoint at ``path`` with its selected linears as :class:`QuantLinear` in ``scheme``
    (and its selected MoE experts as :class:`~quarl.quant.experts.QuantExperts`, each expert
    quantized on its own, from either checkpoint layout: one layer's stacked projection at a
    time is in full precision on the device).

    Equal, tensor for tensor, to ``m = load_model(path, dtype, device); quantize_model(m, scheme,
    QuantLinear, include, exclude)``, but no more than one linear's full-precision weight is on
    ``device`` at a time (module docstring). ``include`` / ``exclude`` are ``quantize_model``'s
    ``fnmatch`` patterns over module names (default ``("layers.*",)``); ``dtype`` is that of the
    weights as the quantizer sees them and of every tensor left unquantized. A scheme that
    quantizes no weights (``bf16``) gives ``load_model``'s model (and uses no cache).

    ``cache_dir``: read the packed model from there when an entry for these inputs exists, else
    build it and write one. ``model.quantized_from_cache`` says which happened.
    """
    path, scheme, device = Path(path), get_scheme(scheme), torch.device(device)
    dtype = dtype or torch.float32
    include = tuple(DEFAULT_INCLUDE if include is None else include)
    exclude = tuple(exclude)
    if not scheme.quantizes_weights:
        model = load_model(path, dtype, device)
        model.quantized_from_cache = False
        return model
    cfg = checkpoint_config(path)
    entry = None
    if cache_dir is not None:
        entry = Path(cache_dir) / packed_cache_key(path, scheme, dtype, device, include, exclude)
        model = _read_cache_entry(entry, cfg, scheme, dtype, device)
        if model is not None:
            log.info("packed %s model read from %s", scheme.name, entry)
            model.quantized_from_cache = True
            return model
    model, modules = _stream_quantized(path, cfg, scheme, dtype, device, include, exclude)
    if entry is not None:
        _write_cache_entry(model, entry, scheme, modules, source=path)
        log.info("packed %s model written to %s", scheme.name, entry)
    model.quantized_from_cache = False
    return model


def _meta_model(cfg: TransformerConfig, dtype: torch.dtype) -> Transformer:
    with torch.device("meta"):
        return Transformer(cfg).to(dtype)


def _selected(model: Transformer, include: tuple[str, ...], exclude: tuple[str, ...]) -> list[str]:
    """The module names ``quantize_model`` swaps: linears, then MoE experts."""
    return selected_linears(model, include, exclude) + selected_experts(model, include, exclude)


def _pack_linears(model: Transformer, names: Iterable[str], scheme: QuantScheme, dtype: torch.dtype) -> None:
    """Swap the meta model's linears ``names`` for meta :class:`QuantLinear` in ``scheme``, and
    its MoE experts among ``names`` for meta :class:`~quarl.quant.experts.QuantExperts`."""
    for name in names:
        mod = model.get_submodule(name)
        parent, _, child = name.rpartition(".")
        if type(mod) is Experts:
            packed = QuantExperts(mod.down_proj.shape[1], mod.intermediate_size, mod.num_experts, scheme, "meta",
                                  dtype, name)
        elif type(mod) is nn.Linear:
            packed = QuantLinear(mod.in_features, mod.out_features, scheme, mod.bias is not None, "meta", dtype)
        else:
            raise CheckpointError(f"{name} is a {type(mod).__name__}, not a linear of {model.config.model_type}")
        setattr(model.get_submodule(parent) if parent else model, child, packed)


def _place_packed(model: nn.Module, name: str, value: torch.Tensor, scheme: QuantScheme) -> None:
    """Quantize ``value`` (a linear's weight, or a stacked expert projection ``[E, N, K]``, each
    expert on its own: its ``[E * N, K]`` view) and make the packed tensors the buffers of
    the module ``name`` stands for (the linear, or the experts' projection)."""
    packed = quantize_weight(value.reshape(-1, value.shape[-1]), scheme)
    module = name.removesuffix(".weight")
    for field, t in packed.tensors().items():
        _place(model, f"{module}.{field}", t)


def _place(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Make ``value`` the parameter or buffer ``name`` of ``model`` (a parameter keeps its
    ``requires_grad``), replacing the meta tensor there."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    old = getattr(owner, leaf)
    if tuple(old.shape) != tuple(value.shape) or old.dtype != value.dtype:
        raise CheckpointError(f"{name}: {tuple(value.shape)} {value.dtype} where the model has "
                              f"{tuple(old.shape)} {old.dtype}")
    if isinstance(old, nn.Parameter):
        value = nn.Parameter(value, requires_grad=old.requires_grad)
    setattr(owner, leaf, value)


def _stream_quantized(path: Path, cfg: TransformerConfig, scheme: QuantScheme, dtype: torch.dtype,
                      device: torch.device, include: tuple[str, ...],
                      exclude: tuple[str, ...]) -> tuple[Transformer, list[str]]:
    """Read the checkpoint tensor by tensor into the packed model (module docstring)."""
    model = _meta_model(cfg, dtype)
    # an MoE checkpoint's experts: stacked as the model holds them, or one tensor per expert
    experts = ExpertLayout(checkpoint_keys(path) if cfg.is_moe else (),
                           {hf_name(n): tuple(p.shape) for n, p in model.named_parameters()})
    plan = checkpoint_plan(path, cfg, experts.expected)
    modules = _selected(model, include, exclude)
    _pack_linears(model, modules, scheme, dtype)
    quantized_weights = {f"{m}.weight" for m in modules} | {f"{m}.{p}" for m in modules for p in PROJECTIONS}
    for file, keys in plan:
        with open_weights(file) as f:
            for key in keys:
                tensor = f.get_tensor(key).to(device=device, dtype=dtype)
                # a stacked expert projection comes once all of its experts are read (one
                # layer's at a time: ExpertLayout); anything else as it is
                for whole, value in experts.take(key, tensor):
                    name = whole.removeprefix("model.")
                    if name in quantized_weights:
                        _place_packed(model, name, value, scheme)
                    else:
                        _place(model, name, value)
                    del value
                del tensor  # the one full-precision weight on the device goes before the next is read
    model.rotary = Rotary(cfg).to(device)
    return model.eval(), modules


def packed_cache_key(path: Path, scheme: QuantScheme, dtype: torch.dtype, device: torch.device,
                     include: tuple[str, ...], exclude: tuple[str, ...]) -> str:
    """The name of the cache entry for these inputs: a hash of the cache format version,
    ``config.json``'s text, each weights file's (and the shard index's) name, size and
    modification time, the scheme's fields, ``include`` / ``exclude``, ``dtype`` and the
    device type (the quantizer runs there)."""
    files = checkpoint_files(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [index, *files]
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    inputs = {
        "format_version": CACHE_FORMAT_VERSION,
        "config": (path / "config.json").read_text(),
        "files": stats,
        "scheme": dataclasses.asdict(scheme),
        "include": include,
        "exclude": exclude,
        "dtype": str(dtype),
        "device": device.type,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


def _write_cache_entry(model: Transformer, entry: Path, scheme: QuantScheme, modules: list[str],
                       source: Path) -> None:
    """Write ``model``'s persistent tensors to ``entry`` (module docstring), through a
    temporary directory renamed into place. A concurrent writer that renamed its copy first
    wins (the two are equal). A failed write (a full disk) is a warning: the model is loaded."""
    tmp = entry.parent / f".{entry.name}.tmp-{os.getpid()}"
    try:
        _write_entry_files(model, tmp, scheme, modules, source)
    except OSError as e:
        warnings.warn(f"could not write the packed-model cache entry {entry} ({e})", stacklevel=3)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    try:
        os.replace(tmp, entry)
    except OSError:  # another process's entry is there now
        shutil.rmtree(tmp, ignore_errors=True)


def _write_entry_files(model: Transformer, tmp: Path, scheme: QuantScheme, modules: list[str], source: Path) -> None:
    """The files of a cache entry, in the fresh directory ``tmp``: shards of at most about
    ``CACHE_SHARD_BYTES`` (one shard's tensors are copied to the host at a time), then the manifest."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards: list[str] = []
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    state = model.state_dict()
    for i, (name, t) in enumerate(state.items()):
        chunk[name] = t.detach().cpu().contiguous()
        size += t.numel() * t.element_size()
        if size >= CACHE_SHARD_BYTES or i == len(state) - 1:
            shards.append(f"packed-{len(shards):05d}.safetensors")
            save_file(chunk, str(tmp / shards[-1]), metadata={"format": "pt"})
            chunk, size = {}, 0
    manifest = {"format_version": CACHE_FORMAT_VERSION, "scheme": scheme.name, "modules": modules,
                "files": shards, "source": str(source)}
    (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1))
    normal_permissions(tmp)


def _read_cache_entry(entry: Path, cfg: TransformerConfig, scheme: QuantScheme, dtype: torch.dtype,
                      device: torch.device) -> Transformer | None:
    """The packed model stored at ``entry``, or None when there is none. A damaged entry is
    reported with a warning, removed, and read as absent."""
    if not entry.exists():
        return None
    try:
        manifest = json.loads((entry / _MANIFEST).read_text())
        if manifest["format_version"] != CACHE_FORMAT_VERSION or manifest["scheme"] != scheme.name:
            raise ValueError(f"manifest says format {manifest['format_version']}, scheme {manifest['scheme']}")
        model = _meta_model(cfg, dtype)
        _pack_linears(model, manifest["modules"], scheme, dtype)
        missing = set(model.state_dict())
        for shard in manifest["files"]:
            with open_weights(entry / shard) as f:
                for name in f.keys():
                    if name not in missing:
                        raise ValueError(f"{shard} holds {name}, which the model has not or had already")
                    _place(model, name, f.get_tensor(name).to(device))
                    missing.discard(name)
        if missing:
            raise ValueError(f"tensors missing: {', '.join(sorted(missing)[:5])}")
    except (CheckpointError, SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"damaged packed-model cache entry {entry} ({e}); quantizing the checkpoint again",
                      stacklevel=3)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    model.rotary = Rotary(cfg).to(device)
    return model.eval()


def random_quantized_model(
    cfg: TransformerConfig,
    scheme: QuantScheme | str,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    include: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    std: float = 0.02,
) -> Transformer:
    """Random weights of ``cfg`` (``build_random_model``'s distribution: normal(0, std), unit
    norms, zero biases) with the selected linears packed in ``scheme``, made one linear at a
    time on ``device`` as :func:`load_quantized_model` does: benchmark shapes whose bf16 weights
    would not fit (a 32B model's 65 GB) never exist whole. Draws from a generator on
    ``device``, so the values differ from ``build_random_model``'s."""
    scheme, device = get_scheme(scheme), torch.device(device)
    model = _meta_model(cfg, dtype)
    modules = _selected(model, tuple(DEFAULT_INCLUDE if include is None else include), tuple(exclude))
    if scheme.quantizes_weights:
        _pack_linears(model, modules, scheme, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in list(model.named_parameters()):
        if name.endswith("norm.weight"):
            _place(model, name, torch.ones(p.shape, dtype=dtype, device=device))
        elif name.endswith("bias"):
            _place(model, name, torch.zeros(p.shape, dtype=dtype, device=device))
        else:
            _place(model, name, (torch.randn(p.shape, generator=gen, device=device) * std).to(dtype))
    if scheme.quantizes_weights:
        for module in modules:
            mod = model.get_submodule(module)
            shapes = {f"{module}.{p}": getattr(mod, p).shape for p in PROJECTIONS} if isinstance(mod, QuantExperts) \
                else {f"{module}.weight": (mod.out_features, mod.in_features)}
            for name, shape in shapes.items():
                w = (torch.randn(shape, generator=gen, device=device) * std).to(dtype)
                _place_packed(model, name, w, scheme)
                del w
    model.rotary = Rotary(cfg).to(device)
    return model.eval()
