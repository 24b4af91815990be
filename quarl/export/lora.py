"""Exports of a LoRA run (``model.lora_rank > 0``), whose checkpoints hold the adapters alone.

* ``peft``: ``adapter_config.json`` + ``adapter_model.safetensors`` in PEFT's layout, for
  ``PeftModel.from_pretrained(<transformers model of model.path>, DIR)``. With UAQ the
  adapters saw inputs scaled by ``s`` (the norms before q/k/v and gate/up carry it), so
  their ``A`` of those linears is multiplied by ``s`` here: the export fits the plain model.
  A run on a low-bit base trained its adapters against the dequantized base; on the
  original bf16 weights they give the trained function up to the base's quantization error.
* ``hf-bf16`` / ``hf-fp32``: the merged model, ``deq(W) + (alpha / r) B A`` for every adapted
  linear, over the base the run trained on: rebuilt from ``model.path`` (or the built-in
  model: the run's warm-start cache, or its seeded random init), UAQ applied as in training,
  the selected linears quantized in the run's scheme (``aligned`` mode), then UAQ removed
  from the merged weights.

Qwen3-MoE runs. Attention adapters (and those of dense MLP layers) export as above. Expert
adapters (target ``experts``, :class:`quarl.model.lora.ExpertsLoRA`) export to PEFT as LoRA on
transformers 5's stacked expert parameters (``target_parameters``: ``mlp.experts.gate_up_proj``
and ``mlp.experts.down_proj``, PEFT's ``ParamWrapper``, one ``A`` / ``B`` per expert, which PEFT
0.21 loads onto transformers 5's ``Qwen3MoeForCausalLM``; :func:`quarl.model.lora.peft_state_dict`
has the layout), and merge into the experts' weights per expert, ``W[e] + (alpha / r) B[e] A[e]``, for
``hf-bf16`` / ``hf-fp32`` (written one tensor per expert, :mod:`quarl.export.hf`). In
``aligned`` mode the merged base of the quantized experts is their dequantized codes
(``QuantExperts``, as ``quantize_model`` makes them), as for the linears.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from quarl.export.hf import PolicyCheckpoint, metadata_header, rescale_uaq, save_plain
from quarl.model.loading import CheckpointError, load_model
from quarl.model.lora import DEFAULT_TARGETS, LoRALinear, add_lora, expert_lora_modules, lora_modules, \
    merged_experts, merged_weight, peft_config, peft_state_dict
from quarl.model.moe import Experts
from quarl.model.transformer import Transformer


def is_lora(ckpt: PolicyCheckpoint) -> bool:
    return int(ckpt.section("model").get("lora_rank") or 0) > 0


def _lora_settings(ckpt: PolicyCheckpoint) -> tuple[int, float, tuple[str, ...]]:
    m = ckpt.section("model")
    rank = int(m["lora_rank"])
    alpha = float(m["lora_alpha"]) if m.get("lora_alpha") is not None else 2.0 * rank
    return rank, alpha, tuple(m.get("lora_targets") or DEFAULT_TARGETS)


def _base_model(ckpt: PolicyCheckpoint) -> Transformer:
    """The run's frozen base in float32, as the trainer built it (before quantization)."""
    from quarl.model.presets import DEMO_PRESETS, build_random_model

    model_dir = ckpt.model_dir
    if model_dir is not None:
        return load_model(model_dir, dtype=torch.float32)
    trainer = ckpt.section("trainer")
    if int(trainer.get("sft_warmup_steps") or 0) > 0:
        cache = ckpt.path.parents[1] / "warmstart"
        if not (cache / "config.json").is_file():
            raise FileNotFoundError(f"the run's base is its warm-started built-in model, cached in {cache}, which is "
                                    "gone; a LoRA checkpoint holds only the adapters, so restore that directory")
        return load_model(cache, dtype=torch.float32)
    builtin = ckpt.section("model").get("builtin") or "small"
    if builtin not in DEMO_PRESETS:
        raise ValueError(f"the run's base is random {builtin} weights made on its device for a benchmark; they "
                         "cannot be rebuilt here, so only --format peft exports this run")
    return build_random_model(ckpt.arch, seed=int(trainer.get("seed") or 0), dtype=torch.float32)


def lora_policy(ckpt: PolicyCheckpoint) -> Transformer:
    """The trained policy of a LoRA checkpoint: its base (quantized as in training) plus the adapters."""
    from quarl.quant import QuantLinear, get_scheme, quantize_model

    rank, alpha, targets = _lora_settings(ckpt)
    model = _base_model(ckpt)
    uaq = ckpt.uaq_scale
    if uaq != 1.0:
        rescale_uaq(model, uaq)  # quarl.quant.apply_uaq's scaling, MoE layers included
    quant = ckpt.section("quant")
    if quant.get("mode") == "aligned":
        quantize_model(model, get_scheme(quant["scheme"]), QuantLinear, include=quant.get("include"),
                       exclude=quant.get("exclude") or ())
        _dequantized_experts(model)
    add_lora(model, rank, alpha, targets, dtype=torch.float32)
    state = {k: v.float() for k, v in ckpt.state.items()}
    missing = sorted(set(n for n, p in model.named_parameters() if p.requires_grad) - set(state))
    if missing:
        raise CheckpointError(f"{ckpt.path}: adapters missing from the checkpoint: {', '.join(missing[:4])}")
    model.load_state_dict(state, strict=False)
    return model.eval()


def _dequantized_experts(model: nn.Module) -> None:
    """Replace every quantized experts module (``QuantExperts``) by plain :class:`Experts` holding
    its dequantized weights in float32: the base the run's expert adapters trained on, in the
    form the adapters attach to and merge into."""
    from quarl.quant.experts import QuantExperts

    for name, mod in list(model.named_modules()):
        if not isinstance(mod, QuantExperts):
            continue
        plain = Experts(mod.hidden_size, mod.intermediate_size, mod.num_experts)
        for proj, qw in mod.quantized_weights().items():
            w = qw.dequantize(torch.float32).view(mod.num_experts, -1, qw.in_features)
            setattr(plain, proj, nn.Parameter(w, requires_grad=False))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, plain)


def export_peft(ckpt: PolicyCheckpoint, out: Path, metadata: dict) -> None:
    """Write the adapters in PEFT's format (module docstring), in the dtype they trained in."""
    from quarl.quant.uaq import ATTN_INPUTS, MLP_INPUTS

    rank, alpha, targets = _lora_settings(ckpt)
    dtype = next(iter(ckpt.state.values())).dtype
    with torch.device("meta"):
        holder = Transformer(ckpt.arch)
    add_lora(holder, rank, alpha, targets)
    holder.load_state_dict({k: v.float() for k, v in ckpt.state.items()}, strict=False, assign=True)
    uaq = ckpt.uaq_scale
    if uaq != 1.0:
        for name, _, ad in lora_modules(holder):
            if name.rpartition(".")[2] in ATTN_INPUTS + MLP_INPUTS:
                ad.A = nn.Parameter(ad.A.detach() * uaq, requires_grad=False)
        for _, _, ad in expert_lora_modules(holder):  # gate_up_proj's input is the scaled norm's output
            ad.gate_up_proj.A = nn.Parameter(ad.gate_up_proj.A.detach() * uaq, requires_grad=False)
    save_file(peft_state_dict(holder, dtype), str(out / "adapter_model.safetensors"),
              metadata=metadata_header(metadata))
    config = peft_config(holder, str(ckpt.model_dir) if ckpt.model_dir is not None else None)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))


def export_merged(ckpt: PolicyCheckpoint, out: Path, dtype: torch.dtype, metadata: dict) -> None:
    """Write the merged policy (module docstring) as a plain HF checkpoint in ``dtype``."""
    model = lora_policy(ckpt)
    _dense_linears(model)
    save_plain(model, out, dtype, metadata, ckpt.uaq_scale)


def _dense_linears(model: nn.Module) -> None:
    """Replace every adapted or quantized linear by a plain one holding its merged weight, and
    merge the expert adapters into the experts' weights."""
    from quarl.quant import QuantLinear

    for _, mod, _ in list(expert_lora_modules(model)):
        if not isinstance(mod, Experts):
            raise TypeError(f"cannot merge LoRA into experts of type {type(mod).__name__}")
        for proj, w in merged_experts(mod, torch.float32).items():
            setattr(mod, proj, nn.Parameter(w, requires_grad=False))
        mod.lora = None

    for name, mod in list(model.named_modules()):
        if isinstance(mod, (QuantLinear, LoRALinear)):
            dense = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
            dense.weight = nn.Parameter(merged_weight(mod, torch.float32), requires_grad=False)
            if mod.bias is not None:
                dense.bias = nn.Parameter(mod.bias.detach().float(), requires_grad=False)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, dense)
