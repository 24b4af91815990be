"""Export a training checkpoint's policy as a Hugging Face checkpoint directory.

A quarl checkpoint (``RUN_DIR/checkpoints/step_NNNNNN/state.pt``) holds the learner's
state_dict and the run config, not an architecture. The policy is rebuilt from the
config: ``model.path``'s ``config.json`` when the run started from a checkpoint, else
the built-in preset ``model.builtin``. In ``aligned`` mode the linears are
``QATLinear``; their state_dict keys are the plain ``...q_proj.weight`` of ``nn.Linear``,
so one loader serves every mode.

Formats:

* ``hf-bf16`` / ``hf-fp32``: a plain model. UAQ (``quant.uaq_scale`` != 1) is undone
  first, in fp32, so the norms and q/k/v/gate/up weights are the unscaled ones any HF
  tool expects; then cast to the target dtype. ``config.json`` + ``model.safetensors``,
  loadable by ``quarl.load_model`` and ``transformers.AutoModelForCausalLM``. A Qwen3-MoE
  model's experts are written one tensor per expert and projection
  (``model.layers.L.mlp.experts.{e}.gate_proj.weight`` / ``up_proj`` / ``down_proj``: the
  layout of released checkpoints, transformers' default ``save_pretrained`` and vLLM's
  loader; transformers 5 stacks them as it loads), the router as ``model.layers.L.mlp.gate.weight``,
  and ``config.json`` carries the MoE fields (``num_experts``, ``num_experts_per_tok``,
  ``moe_intermediate_size``, ``decoder_sparse_step``, ``mlp_only_layers``, ``norm_topk_prob``,
  ``router_aux_loss_coef``).
* ``quarl-packed``: the low-bit tensors the rollout engine ran on (see
  :mod:`quarl.export.packed`), UAQ kept since the codes were made from scaled weights.
* ``compressed-tensors``: the same low-bit codes in the format vLLM and transformers
  load (see :mod:`quarl.export.compressed`), UAQ folded into the scales.

Every format carries the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``,
the chat template, ``generation_config.json``, ...) copied from ``model.tokenizer`` or
``model.path`` when the run used a local HF directory (runs on the built-in character
tokenizer have none to copy), and :func:`export_metadata`: the training config and the
schemes, in ``quarl_export.json`` and in the safetensors header under ``quarl_export``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from quarl.model.config import TransformerConfig
from quarl.io import atomic_path
from quarl.model.loading import CheckpointError, hf_name, normal_permissions
from quarl.model.presets import preset_config
from quarl.model.transformer import Rotary, Transformer
from quarl.quant import QuantScheme, get_scheme
from quarl.trainer.checkpoint import list_checkpoints, load_checkpoint, policy_weights

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
)
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile / DDP wrappers
METADATA_FILE = "quarl_export.json"
METADATA_KEY = "quarl_export"  # safetensors header entry holding the same JSON


@dataclass
class PolicyCheckpoint:
    """The policy part of one training checkpoint."""

    path: Path
    step: int
    run_config: dict[str, Any]
    arch: TransformerConfig
    state: dict[str, torch.Tensor]  # parameter name -> tensor, as stored (dtype of the learner)

    def section(self, name: str) -> dict[str, Any]:
        value = self.run_config.get(name)
        return value if isinstance(value, dict) else {}

    @property
    def uaq_scale(self) -> float:
        return float(self.section("quant").get("uaq_scale") or 1.0)

    @property
    def model_dir(self) -> Path | None:
        path = self.section("model").get("path")
        return Path(path) if path else None


def find_checkpoint(src: str | Path, step: int | None = None) -> Path:
    """The checkpoint directory ``src`` names: a checkpoint itself, or a run dir's latest (or ``step``)."""
    src = Path(src)
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist")
    if (src / "meta.json").is_file():
        if step is not None and _step_of(src) != step:
            raise ValueError(f"{src} is the checkpoint of step {_step_of(src)}, not --step {step}")
        return src
    found = list_checkpoints(src)
    if not found:
        raise FileNotFoundError(f"{src} has no complete checkpoint (expected {src}/checkpoints/step_NNNNNN/meta.json)")
    if step is None:
        return found[-1]
    for ckpt in found:
        if _step_of(ckpt) == step:
            return ckpt
    raise ValueError(f"{src} has no checkpoint of step {step}; available: {', '.join(str(_step_of(c)) for c in found)}")


def _step_of(ckpt: Path) -> int:
    return int(ckpt.name.split("_")[1])


def read_policy(ckpt: str | Path) -> PolicyCheckpoint:
    """Load ``ckpt``'s policy weights and the architecture they belong to."""
    ckpt = Path(ckpt)
    state = load_checkpoint(ckpt, map_location="cpu")
    try:
        weights = policy_weights(ckpt, state)
    except (KeyError, TypeError):
        raise CheckpointError(f"{ckpt}: state.pt has no learner.model state_dict") from None
    run_config = state.get("config")
    if not isinstance(run_config, dict):
        raise CheckpointError(f"{ckpt}: state.pt has no run config; cannot tell which architecture it holds")
    weights = {_strip_wrappers(k): v for k, v in weights.items()}
    step = int(state.get("step", _step_of(ckpt)))
    return PolicyCheckpoint(ckpt, step, run_config, _architecture(run_config), weights)


def _strip_wrappers(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.removeprefix(prefix)
    return name


def _architecture(run_config: dict[str, Any]) -> TransformerConfig:
    model = run_config.get("model") or {}
    if model.get("path"):
        path = Path(model["path"])
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"the run started from model.path={path}, whose config.json is gone; the architecture "
                "is read from it, so restore that directory (or a copy with the same config.json)"
            )
        return TransformerConfig.from_dir(path)
    return preset_config(model.get("builtin") or "small")


def build_policy(ckpt: PolicyCheckpoint, dtype: torch.dtype | None = None) -> Transformer:
    """A :class:`Transformer` holding ``ckpt``'s weights (in ``dtype``; None = as stored), UAQ as trained."""
    with torch.device("meta"):
        model = Transformer(ckpt.arch)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in ckpt.state.items()}
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shaped = [f"{k}: {tuple(state[k].shape)} vs {tuple(expected[k].shape)}"
              for k in sorted(set(state) & set(expected)) if state[k].shape != expected[k].shape]
    if missing or unexpected or shaped:
        problems = [f"{label}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
                    for label, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", shaped))
                    if names]
        raise CheckpointError(f"{ckpt.path}: policy weights do not fit {ckpt.arch.model_type} "
                              f"({ckpt.arch.num_hidden_layers} layers): " + " | ".join(problems))
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = Rotary(ckpt.arch)
    return model.eval().requires_grad_(False)


def engine_scheme(ckpt: PolicyCheckpoint, scheme: str | QuantScheme | None, fmt: str) -> QuantScheme:
    """The scheme a low-bit export ``fmt`` writes: ``scheme`` if given, else the run's ``quant.scheme``."""
    if scheme is not None:
        return get_scheme(scheme)
    quant = ckpt.section("quant")
    if quant.get("mode", "bf16") == "bf16":
        raise ValueError(
            f"this run's rollouts were not quantized (quant.mode=bf16), so there are no engine weights "
            f"to export as {fmt}; use --format hf-bf16, or pass --scheme NAME to quantize it anyway"
        )
    return get_scheme(quant.get("scheme"))


def export_metadata(ckpt: PolicyCheckpoint, fmt: str, scheme: QuantScheme | None, uaq: str) -> dict[str, Any]:
    """What an export says about itself: format, step, the weights' scheme, how UAQ was
    treated (``removed`` / ``folded`` / ``applied`` / ``none``), the tokenizer and the run config."""
    import quarl

    quant, model = ckpt.section("quant"), ckpt.section("model")
    return {
        "quarl_version": quarl.__version__,
        "format": fmt,
        "step": ckpt.step,
        "checkpoint": str(ckpt.path),
        "scheme": scheme.name if scheme is not None else None,
        "scheme_fields": dataclasses.asdict(scheme) if scheme is not None else None,
        "trained_with": {"mode": quant.get("mode"), "scheme": quant.get("scheme"), "uaq_scale": ckpt.uaq_scale},
        "uaq": uaq if ckpt.uaq_scale != 1.0 else "none",
        "tokenizer": model.get("tokenizer") or model.get("path") or "builtin",
        "run_config": ckpt.run_config,
    }


def metadata_header(metadata: dict[str, Any]) -> dict[str, str]:
    """``metadata`` as a safetensors header entry (its values must be strings)."""
    return {METADATA_KEY: json.dumps(metadata, default=str)}


def export_hf(ckpt: PolicyCheckpoint, out: Path, dtype: torch.dtype, metadata: dict[str, Any]) -> None:
    """Write the plain (UAQ removed) policy as ``config.json`` + ``model.safetensors`` in ``dtype``."""
    # undo UAQ in fp32: one rounding, at the final cast
    save_plain(build_policy(ckpt, torch.float32), out, dtype, metadata, ckpt.uaq_scale)


def save_plain(model: Transformer, out: Path, dtype: torch.dtype, metadata: dict[str, Any], uaq_scale: float) -> None:
    """Write ``model`` (float32, UAQ ``uaq_scale`` as trained, plain linears and experts) with UAQ
    removed, as ``config.json`` + ``model.safetensors`` in ``dtype``, the experts one tensor per
    expert (module docstring)."""
    if uaq_scale != 1.0:
        rescale_uaq(model, 1.0 / uaq_scale)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, p in model.named_parameters():
        for key, t in hf_tensors(name, p.detach()):
            tensors[key] = t.to(dtype).contiguous().cpu()
    with atomic_path(out / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={**metadata_header(metadata), "format": "pt"})
        normal_permissions(tmp)
    config = model.config.to_hf_dict()
    config["torch_dtype"] = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    (out / "config.json").write_text(json.dumps(config, indent=2))


EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


def expert_pieces(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """``(module name, weight)`` of each expert's linear in a stacked expert parameter
    (``layers.L.mlp.experts.gate_up_proj [E, 2I, H]`` -> ``layers.L.mlp.experts.{e}.gate_proj``
    ``[I, H]`` and ``.up_proj``; ``down_proj [E, H, I]`` -> ``.{e}.down_proj``), in expert order;
    None for any other tensor. quarl names (no ``model.`` prefix), views of ``tensor``."""
    prefix, _, proj = name.rpartition(".")
    if not prefix.endswith(".mlp.experts") or proj not in ("gate_up_proj", "down_proj"):
        return None
    if proj == "down_proj":
        return [(f"{prefix}.{e}.down_proj", tensor[e]) for e in range(tensor.shape[0])]
    half = tensor.shape[1] // 2
    return [(f"{prefix}.{e}.{part}", tensor[e, rows]) for e in range(tensor.shape[0])
            for part, rows in (("gate_proj", slice(0, half)), ("up_proj", slice(half, None)))]


def hf_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The HF checkpoint tensors of quarl parameter ``name``: itself under its HF name, or a
    stacked expert parameter as one ``...experts.{e}.{gate,up,down}_proj.weight`` per expert."""
    pieces = expert_pieces(name, tensor)
    if pieces is None:
        return [(hf_name(name), tensor)]
    return [(f"{hf_name(module)}.weight", t) for module, t in pieces]


@torch.no_grad()
def rescale_uaq(model: nn.Module, scale: float) -> None:
    """UAQ's invariant scaling by ``scale`` on a model of plain (float) weights, MoE layers
    included (:func:`quarl.quant.apply_uaq`); ``1 / s`` removes UAQ ``s``."""
    from quarl.quant.uaq import apply_uaq

    apply_uaq(model, scale)


def copy_tokenizer(ckpt: PolicyCheckpoint, out: Path) -> list[str]:
    model = ckpt.section("model")
    source = model.get("tokenizer") or model.get("path")
    if not source or not Path(source).is_dir():
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, out / name)
            copied.append(name)
    return copied
