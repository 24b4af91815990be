"""Load and save Hugging Face safetensors checkpoints for :class:`Transformer`.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or
shards listed in ``model.safetensors.index.json``. Tensors are read one at a time and
placed straight into a model built on the meta device, so peak host memory is one
copy of the weights.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from quarl.io import atomic_path
from quarl.model.config import ModelConfigError, TransformerConfig
from quarl.model.moe import ExpertLayout
from quarl.model.transformer import Rotary, Transformer

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """The tensors of a checkpoint do not match its config, or a weights file is damaged."""


def damaged_file_error(file: Path, error: Exception) -> CheckpointError:
    """A CheckpointError naming ``file``, what is wrong with it, and the fix."""
    return CheckpointError(
        f"{file} is {_diagnose(file)} ({error}); re-download the checkpoint, or re-save it from the model "
        "that wrote it"
    )


def _diagnose(file: Path) -> str:
    """What is wrong with a safetensors file: ``u64 header length | JSON header | data``."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"truncated ({size} bytes, not even the 8-byte header length)"
        if head.startswith(b"version "):
            return "a Git LFS pointer, not the weights (run `git lfs pull` in the checkout)"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return f"not a safetensors file, or truncated inside its header ({size} bytes, header claims {n})"
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            return "a safetensors file with a corrupt header"
    if 8 + n + end > size:
        return f"truncated ({size} bytes on disk, its header describes {8 + n + end})"
    return "a damaged safetensors file"


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shards that are not on disk: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise CheckpointError(
            f"{path} holds PyTorch .bin weights; quarl reads safetensors only. Convert with "
            "transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"
        )
    raise CheckpointError(f"{path} has config.json but no *.safetensors weights")


def checkpoint_keys(path: Path) -> set[str]:
    """The names of the tensors of the checkpoint at ``path`` (only the headers are read)."""
    keys: set[str] = set()
    for file in checkpoint_files(path):
        with open_weights(file) as f:
            keys.update(f.keys())
    return keys


def hf_name(name: str) -> str:
    """The Hugging Face name of a :class:`Transformer` parameter (decoder tensors under ``model.``)."""
    return name if name.startswith("lm_head") else "model." + name


def checkpoint_config(path: Path) -> TransformerConfig:
    """The architecture in ``path/config.json``; refuses checkpoints that are already quantized."""
    cfg = TransformerConfig.from_dir(path)
    raw = json.loads((path / "config.json").read_text())
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise ModelConfigError(
            f"{path}: checkpoint is quantized ({method}); quarl.load_model expects BF16/FP32 weights. "
            "Load the full-precision checkpoint and pick a scheme with quant.scheme instead"
        )
    return cfg


def open_weights(file: Path):
    """``safe_open`` on CPU, with a damaged file reported as a :class:`CheckpointError` naming it."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as e:
        raise damaged_file_error(file, e) from e


def checkpoint_plan(
    path: Path, cfg: TransformerConfig, expected: dict[str, tuple[int, ...]]
) -> list[tuple[Path, list[str]]]:
    """Which file holds each tensor of ``expected`` (HF name -> shape), grouped by file in the
    order the files list them. Only the safetensors headers are read. Raises one
    :class:`CheckpointError` naming every missing, unexpected or mis-shaped tensor (the last two
    with their file)."""
    where: dict[str, Path] = {}
    unexpected: list[str] = []
    mis_shaped: dict[str, str] = {}
    for file in checkpoint_files(path):
        with open_weights(file) as f:
            for key in f.keys():
                if key.endswith(_IGNORED_SUFFIXES):
                    continue
                if key == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue  # some tied checkpoints still store a copy
                if cfg.is_moe and key not in expected:
                    _refuse_router_variant(path, key, file)
                if key not in expected:
                    unexpected.append(f"{key} (in {file.name})")
                    continue
                shape = tuple(f.get_slice(key).get_shape())
                if shape != tuple(expected[key]):
                    mis_shaped[key] = f"{key}: checkpoint {shape} vs model {tuple(expected[key])} (in {file.name})"
                    continue
                where[key] = file
    missing = sorted(set(expected) - set(where) - set(mis_shaped))
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected[:10])}{' ...' if len(unexpected) > 10 else ''}")
    if mis_shaped:
        problems.append("mis-shaped tensors: " + "; ".join(list(mis_shaped.values())[:10]))
    if problems:
        raise CheckpointError(f"{path} does not match its config.json ({cfg.model_type}): " + " | ".join(problems))
    by_file: dict[Path, list[str]] = {}
    for key, file in where.items():
        by_file.setdefault(file, []).append(key)
    return list(by_file.items())


# MoE tensors of routers and blocks other than Qwen3-MoE's (softmax top-k over ``gate.weight``,
# routed experts only): what each one is, for the error that names it
_ROUTER_VARIANTS = {
    "gate.bias": "a router bias",
    "gate.e_score_correction_bias": "a score-correction bias on the router (DeepSeek-V3's sigmoid routing)",
    "shared_expert.": "a shared expert (Qwen2-MoE's)",
    "shared_expert_gate.": "a gated shared expert (Qwen2-MoE's)",
    "shared_experts.": "shared experts (DeepSeek's)",
}


def _refuse_router_variant(path: Path, key: str, file: Path) -> None:
    """A :class:`CheckpointError` naming the layer when ``key`` is a tensor of a router or MoE
    block that Qwen3-MoE does not have (the model would otherwise run without it and route
    differently from the model that was trained)."""
    layer, sep, rest = key.partition(".mlp.")
    if not sep:
        return
    for prefix, what in _ROUTER_VARIANTS.items():
        if rest.startswith(prefix):
            raise CheckpointError(
                f"{path}: {layer}.mlp has {what} ({key} in {file.name}); quarl's qwen3_moe block routes with "
                "a softmax top-k over mlp.gate.weight alone and has no such tensor. This checkpoint is another MoE "
                "family declared as qwen3_moe: fix model_type in its config.json (quarl runs Qwen3-MoE routers only), "
                "or remove the tensor if it is unused (all zeros)")


def load_model(
    path: str | Path, dtype: torch.dtype | None = torch.float32, device: str | torch.device = "cpu"
) -> Transformer:
    """Build the transformer described by ``path/config.json`` and load its weights."""
    path = Path(path)
    cfg = checkpoint_config(path)
    dtype = dtype or torch.float32
    with torch.device("meta"):
        model = Transformer(cfg)
    # an MoE checkpoint's experts: stacked as the model holds them, or one tensor per expert
    experts = ExpertLayout(checkpoint_keys(path) if cfg.is_moe else (),
                           {hf_name(n): tuple(p.shape) for n, p in model.named_parameters()})
    plan = checkpoint_plan(path, cfg, experts.expected)
    state: dict[str, torch.Tensor] = {}
    for file, keys in plan:
        with open_weights(file) as f:
            for key in keys:
                for name, tensor in experts.take(key, f.get_tensor(key).to(device=device, dtype=dtype)):
                    state[name.removeprefix("model.")] = tensor
    model.load_state_dict(state, strict=False, assign=True)
    model.rotary = Rotary(cfg).to(device)
    return model.eval()


def save_model(
    model: Transformer, path: str | Path, dtype: torch.dtype | None = None, metadata: dict[str, str] | None = None
) -> None:
    """Write ``model`` as a HF checkpoint directory (config.json + model.safetensors).

    ``metadata`` joins ``{"format": "pt"}`` in the safetensors header."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, p in model.named_parameters():
        t = p.detach()
        tensors[hf_name(name)] = (t.to(dtype) if dtype is not None else t).contiguous().cpu()
    with atomic_path(path / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={**(metadata or {}), "format": "pt"})
        normal_permissions(tmp)
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2))


def normal_permissions(path: Path) -> None:
    """Give ``path`` (and what it holds) the mode a plain ``open``/``mkdir`` would: 0644/0755 under umask 022.

    safetensors' ``save_file`` and ``tempfile.mkdtemp`` create private (0600/0700)
    entries, which other users of a shared checkpoint directory could not read.
    """
    umask = os.umask(0)
    os.umask(umask)
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)
