"""``quarl-packed``: the rollout engine's low-bit weights, saved as a checkpoint directory.

Layout of the directory:

* ``model.safetensors``. For every quantized linear ``L`` (the modules the run's
  ``quant.include`` / ``quant.exclude`` picked, ``layers.*`` by default; an MoE block's
  experts ``layers.L.mlp.experts`` are one such module, its projections ``gate_up_proj`` /
  ``down_proj`` each one ``[E * N, K]`` quantized weight under ``model.L.<projection>.qdata`` ...,
  as :class:`~quarl.quant.experts.QuantExperts` holds them) the fields of
  its :class:`~quarl.quant.QuantizedWeight`, stored verbatim under HF-style names:
  ``model.L.qdata`` (codes: int8, float8_e4m3fn, or uint8 with several codes per byte,
  K padded to ``PACK_K``), ``model.L.scales``, ``model.L.zeros`` (asymmetric formats)
  and ``model.L.global_scale`` (nvfp4); bit layouts are those of
  :mod:`quarl.quant.reference`. Every other tensor (embeddings, norms, LM head, biases)
  in bf16 under its usual name.
* ``config.json``: the HF architecture plus ``quantization_config``::

      {"quant_method": "quarl-packed", "format_version": 1, "scheme": "w4a16",
       "scheme_fields": {...QuantScheme fields...}, "modules": ["layers.0.self_attn.q_proj", ...],
       "uaq_scale": 1.5, "dtype": "bfloat16", "step": 120}

The codes are made by :func:`quarl.quant.quantize_weight` from the checkpoint's master
weights in the dtype the learner kept them in: the very tensors the engine was given
after that step. UAQ stays applied (the norms carry ``s``, the linears ``W / s``)
because the codes were made from the scaled weights; ``uaq_scale`` is informational.
:func:`load_packed` rebuilds a model whose quantized linears are
:class:`~quarl.quant.QuantLinear`; ``quarl.load_model`` refuses these directories.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from quarl.export.hf import PolicyCheckpoint, build_policy, metadata_header
from quarl.io import atomic_path
from quarl.model.config import TransformerConfig
from quarl.model.loading import CheckpointError, damaged_file_error
from quarl.model.moe import Experts
from quarl.model.transformer import Rotary, Transformer
from quarl.quant import QuantLinear, QuantScheme, quantize_model
from quarl.quant.experts import QuantExperts
from quarl.quant.reference import bf16_scale

QUANT_METHOD = "quarl-packed"
FORMAT_VERSION = 1
REST_DTYPE = torch.bfloat16
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head") else "model." + name


def quantized_policy(ckpt: PolicyCheckpoint, scheme: QuantScheme) -> tuple[Transformer, list[str]]:
    """The policy with the run's selected linears as ``QuantLinear`` (and MoE experts as
    ``QuantExperts``) in ``scheme`` (quantized from the learner's own dtype: the codes the
    engine got) and their module names."""
    quant = ckpt.section("quant")
    model = build_policy(ckpt, dtype=None)
    modules = quantize_model(model, scheme, QuantLinear, include=quant.get("include") or None,
                             exclude=quant.get("exclude") or ())
    if not modules:
        raise ValueError(f"quant.include={quant.get('include')} / exclude={quant.get('exclude')} select no linear")
    return model, modules


def export_packed(ckpt: PolicyCheckpoint, out: Path, scheme: QuantScheme, metadata: dict[str, Any]) -> list[str]:
    """Write ``ckpt``'s policy as a quarl-packed directory; returns the quantized module names."""
    model, modules = quantized_policy(ckpt, scheme)
    quantized_fields = {f"{m}.{f}" for m in modules for f in model.get_submodule(m)._fields}
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if name not in quantized_fields and t.is_floating_point():
            t = t.to(REST_DTYPE)
        tensors[_hf_name(name)] = t.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={**metadata_header(metadata), "format": "pt"})
    config = ckpt.arch.to_hf_dict()
    config["torch_dtype"] = _DTYPE_NAMES[REST_DTYPE]
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "format_version": FORMAT_VERSION,
        "scheme": scheme.name,
        "scheme_fields": dataclasses.asdict(scheme),
        "modules": modules,
        "uaq_scale": ckpt.uaq_scale,
        "dtype": _DTYPE_NAMES[REST_DTYPE],
        "step": ckpt.step,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return modules


def read_quantization_config(path: str | Path) -> tuple[TransformerConfig, QuantScheme, dict]:
    """The architecture, scheme and ``quantization_config`` of a quarl-packed directory."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    raw = json.loads(cfg_file.read_text())
    qc = raw.get("quantization_config") or {}
    if qc.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"{path} is not a quarl-packed export (quant_method={qc.get('quant_method')!r}); "
                         "use quarl.load_model for plain HF checkpoints")
    if qc.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{path}: quarl-packed format_version {qc['format_version']} is newer than this quarl's")
    scheme = QuantScheme(**qc["scheme_fields"])  # exact fields, even if the name's defaults change later
    return TransformerConfig.from_hf_dict(raw, source=str(cfg_file)), scheme, qc


def load_packed(
    path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> Transformer:
    """Rebuild a quarl-packed export: quantized linears become :class:`QuantLinear`.

    ``dtype`` applies to the high-precision tensors (None: as stored, bf16); the
    quantized fields are loaded as stored, except integer group scales that are not bf16
    values (written before quarl rounded them to bf16, :func:`~quarl.quant.reference.bf16_scale`):
    those are rounded to the nearest bf16, as vLLM does when it loads them and as the w4a16
    wgmma kernel reads them.
    """
    path = Path(path)
    arch, scheme, qc = read_quantization_config(path)
    with torch.device("meta"):
        model = Transformer(arch)
        for name in qc["modules"]:
            linear = model.get_submodule(name)
            parent, _, child = name.rpartition(".")
            if isinstance(linear, Experts):  # an MoE block's experts: the engine's packed stack
                e, n2, h = linear.gate_up_proj.shape
                qlinear = QuantExperts(h, n2 // 2, e, scheme, name=name)
            else:
                qlinear = QuantLinear(linear.in_features, linear.out_features, scheme, linear.bias is not None)
            setattr(model.get_submodule(parent) if parent else model, child, qlinear)
    quantized_fields = {f"{m}.{f}" for m in qc["modules"] for f in model.get_submodule(m)._fields}
    group_scales = scheme.weight_format == "int" and scheme.group_size is not None
    file = path / "model.safetensors"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no model.safetensors")
    state = {}
    try:
        f = safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as e:
        raise damaged_file_error(file, e) from e
    with f:
        for key in f.keys():
            name = key.removeprefix("model.")
            t = f.get_tensor(key)
            if dtype is not None and name not in quantized_fields and t.is_floating_point():
                t = t.to(dtype)
            if group_scales and name in quantized_fields and name.endswith(".scales"):
                t = bf16_scale(t)
            state[name] = t.to(device)
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(f"{path}: tensors do not match config.json: missing {result.missing_keys[:8]}, "
                              f"unexpected {result.unexpected_keys[:8]}")
    for mod in model.modules():
        if isinstance(mod, QuantExperts):  # derived layouts of the loaded buffers
            mod.load_quantized(mod.quantized_weights())
    model.rotary = Rotary(arch).to(device)
    return model.eval().requires_grad_(False)
