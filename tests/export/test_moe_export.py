"""`quarl export` of Qwen3-MoE runs: hf-bf16 / hf-fp32 with one tensor per expert, compressed-tensors
with per-expert quantized linears, and PEFT adapters (attention and stacked-expert LoRA)."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import quarl
from quarl.export import export_checkpoint
from quarl.export.compressed import decompress_weight, fold_uaq, quantization_scheme
from quarl.export.hf import find_checkpoint, read_policy, rescale_uaq
from quarl.export.lora import lora_policy
from quarl.model.lora import adapter_state_dict, add_lora
from quarl.model.moe import SparseMoeBlock
from quarl.model.presets import build_random_model
from quarl.quant import QATLinear, QuantizedWeight, QuantLinear, get_scheme, quantize_model, quantize_weight
from quarl.trainer.checkpoint import save_checkpoint
from tests.export.test_compressed_tensors import _bits, _stored
from tests.hf_models import make_moe_checkpoint, moe_hf_config
from tests.model.test_lora import _randomize_adapters
from tests.model.test_moe_lora import randomize_expert_adapters

IDS = torch.tensor([[5, 17, 99, 3, 42, 64, 7, 120], [1, 2, 3, 4, 5, 6, 7, 8]])
EXPORTED = ("w4a16", "w4a16-asym", "w4a8-int8", "w8a8-int8", "w8a8-fp8", "mxfp4")  # nvfp4: experts excluded


def _original() -> torch.nn.Module:
    model = build_random_model("moe-tiny", seed=1, std=0.1)
    with torch.no_grad():  # norms away from 1 so that UAQ (which scales them) is visible
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def _save_run(run_dir: Path, state: dict, model_cfg: dict, quant: dict, step: int = 3) -> Path:
    config = {"model": {"path": None, "builtin": None, "tokenizer": None, **model_cfg},
              "quant": {"mode": "bf16", "scheme": "bf16", "uaq_scale": 1.0, "include": ["layers.*"], "exclude": [],
                        **quant},
              "algo": {"loss": "tbpo"}}
    save_checkpoint(run_dir, step, {"step": step, "learner": {"model": state, "optimizer": {}}, "config": config})
    return run_dir


def _full_run(run_dir: Path, model: torch.nn.Module, model_cfg: dict, mode: str = "bf16", scheme: str = "bf16",
              uaq: float = 1.0, exclude: tuple[str, ...] = ()) -> Path:
    """A full fine-tune's checkpoint as the trainer writes it: UAQ applied, QATLinear / QATExperts when aligned."""
    policy = copy.deepcopy(model)
    if uaq != 1.0:
        rescale_uaq(policy, uaq)
    if mode == "aligned":
        quantize_model(policy, scheme, QATLinear, exclude=exclude)
    return _save_run(run_dir, policy.state_dict(), model_cfg,
                     {"mode": mode, "scheme": scheme, "uaq_scale": uaq, "exclude": list(exclude)})


def _keys(out: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _hf(out: Path, **kwargs):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager",
                                                    **kwargs).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ----------------------------------------------------------------------------------------- hf
@pytest.mark.parametrize("uaq", [1.0, 1.5])
def test_hf_export_has_per_expert_tensors_and_transformers_gives_our_logits(tmp_path, uaq):
    original = _original()
    run = _full_run(tmp_path / "run", original, {"builtin": "moe-tiny"}, uaq=uaq)
    export_checkpoint(run, tmp_path / "fp32", "hf-fp32")
    config = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe"
    assert {k: config[k] for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                                   "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef")} == \
        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
         "decoder_sparse_step": 1, "mlp_only_layers": [1], "router_aux_loss_coef": 0.0}
    keys = _keys(tmp_path / "fp32")
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in keys)  # nothing stacked
    for layer in (0, 2):
        e = original.layers[layer].mlp.experts
        torch.testing.assert_close(keys[f"model.layers.{layer}.mlp.gate.weight"],  # the router, UAQ removed
                                   original.layers[layer].mlp.gate.weight.detach())
        for x in range(8):
            prefix = f"model.layers.{layer}.mlp.experts.{x}"
            torch.testing.assert_close(keys[f"{prefix}.gate_proj.weight"], e.gate_up_proj[x, :32].detach())
            torch.testing.assert_close(keys[f"{prefix}.up_proj.weight"], e.gate_up_proj[x, 32:].detach())
            torch.testing.assert_close(keys[f"{prefix}.down_proj.weight"], e.down_proj[x].detach())
    assert "model.layers.1.mlp.gate_proj.weight" in keys  # the dense layer's MLP
    assert len([k for k in keys if ".experts." in k]) == 2 * 8 * 3
    with torch.no_grad():
        want = original(IDS)
        assert _rel(_hf(tmp_path / "fp32")(IDS).logits, want) < 1e-5
        assert _rel(quarl.load_model(tmp_path / "fp32")(IDS), want) < 1e-5  # quarl's loader reads it back

    export_checkpoint(run, tmp_path / "bf16", "hf-bf16")
    assert all(t.dtype == torch.bfloat16 for t in _keys(tmp_path / "bf16").values())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with torch.no_grad():  # the same bf16 weights in both, run in float32
        ours = quarl.load_model(tmp_path / "bf16", dtype=torch.float32)(IDS)
        assert _rel(_hf(tmp_path / "bf16")(IDS).logits, ours) < 1e-5


# ---------------------------------------------------------------------------- compressed-tensors
@pytest.fixture(scope="module")
def moe_base(tmp_path_factory):
    """A Qwen3-MoE checkpoint whose experts have whole int4 groups (H = I = 128); layer 1 dense."""
    path = tmp_path_factory.mktemp("moe-base")
    make_moe_checkpoint(path, moe_hf_config(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                                            head_dim=32), seed=2)
    return path


def _unscaled(qw: QuantizedWeight, s: float) -> QuantizedWeight:
    t = dict(qw.tensors())
    if qw.scheme.scale_format == "fp32":
        t["scales"] = qw.scales * s
    else:
        assert s == 1.0
    return QuantizedWeight(qw.scheme, qw.shape, **t)


def _aligned_compressed_export(tmp_path: Path, moe_base: Path, scheme: str):
    """A one-step aligned run of ``scheme`` on ``moe_base`` (UAQ 1.5, none for mxfp4) exported as
    compressed-tensors to ``tmp_path / "ct"``: ``(the base model, the run, the UAQ scale)``."""
    uaq = 1.0 if scheme == "mxfp4" else 1.5
    original = quarl.load_model(moe_base)
    run = _full_run(tmp_path / "run", original, {"path": str(moe_base)}, "aligned", scheme, uaq)
    export_checkpoint(run, tmp_path / "ct", "compressed-tensors")
    return original, run, uaq


@pytest.mark.parametrize("scheme", EXPORTED)
def test_compressed_experts_decompress_to_the_trained_codes(tmp_path, moe_base, scheme):
    original, run, uaq = _aligned_compressed_export(tmp_path, moe_base, scheme)
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    sparse = [i for i, layer in enumerate(original.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    assert sparse == [0, 2, 3]
    assert qc["ignore"] == ["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in sparse]
    stored, ct_scheme = _stored(tmp_path / "ct"), quantization_scheme(get_scheme(scheme))
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in stored)
    for i in sparse:
        assert stored[f"model.layers.{i}.mlp.gate"]["weight"].dtype == torch.bfloat16  # the router: bf16
        experts = original.layers[i].mlp.experts
        # as training quantized them: UAQ applied, each projection's [E * N, K] view
        gate_up = quantize_weight((experts.gate_up_proj.detach() * (1.0 / uaq)).reshape(8 * 256, 128), scheme)
        down = quantize_weight(experts.down_proj.detach().reshape(8 * 128, 128), scheme)
        for e in range(8):
            for part, qw in (("gate_proj", _unscaled(gate_up.rows(256 * e, 256 * e + 128), uaq)),
                             ("up_proj", _unscaled(gate_up.rows(256 * e + 128, 256 * (e + 1)), uaq)),
                             ("down_proj", down.rows(128 * e, 128 * (e + 1)))):
                name = f"model.layers.{i}.mlp.experts.{e}.{part}"
                got = decompress_weight(stored[name], ct_scheme).float()
                assert torch.equal(_bits(got), _bits(qw.dequantize(torch.float32))), name
    assert len([k for k in stored if ".experts." in k]) == 3 * 8 * 3


def _engine(original: torch.nn.Module, scheme: str, uaq: float, exclude: tuple[str, ...] = ()) -> torch.nn.Module:
    """quarl's exported weights as a plain float32 model: the engine's codes (QuantLinear /
    QuantExperts) with UAQ folded, dequantized; the rest in bf16. (No activation quantization:
    transformers' experts are no linears, so nothing quantizes their inputs there.)"""
    from quarl.export.lora import _dense_linears, _dequantized_experts

    engine = copy.deepcopy(original)
    if uaq != 1.0:
        rescale_uaq(engine, uaq)
    quantize_model(engine, scheme, QuantLinear, exclude=exclude)
    fold_uaq(engine, uaq)
    _dequantized_experts(engine)
    _dense_linears(engine)
    with torch.no_grad():
        for name, p in engine.named_parameters():
            if not name.endswith(("_proj.weight", "experts.gate_up_proj", "experts.down_proj")):
                p.data = p.data.bfloat16().float()
    return engine.eval()


# transformers 5 stacks the per-expert tensors into its experts with the library's decompression for these;
# for the others its MoE weight conversion fails on the library's own layouts (w4a16-asym: "Asymmetric quant
# requires zero-point values", the zero points not handed to the per-expert decompression; int-quantized
# w8a8-int8 / w4a8-int8: no tensor reaches the expert concatenation). Their exactness is the library's
# decompression above, which transformers and vLLM call.
TRANSFORMERS_LOADS = ("w4a16", "w8a8-fp8", "mxfp4")


@pytest.mark.parametrize("scheme", TRANSFORMERS_LOADS)
def test_transformers_loads_the_moe_export(tmp_path, moe_base, scheme):
    from transformers import CompressedTensorsConfig

    original, run, uaq = _aligned_compressed_export(tmp_path, moe_base, scheme)
    # (the fp4 formats decompress to bf16 weights, which transformers leaves so in a float32 model)
    hf = _hf(tmp_path / "ct", quantization_config=CompressedTensorsConfig(dequantize=True)).float()
    engine = _engine(original, scheme, uaq)
    for name, p in engine.named_parameters():  # every weight is quarl's, the experts stacked back
        assert torch.equal(hf.get_parameter(f"model.{name}" if name != "lm_head.weight" else name).float(), p), name
    with torch.no_grad():
        got, want = hf(IDS).logits, engine(IDS)
    assert _rel(got, want) < 1e-5  # float32 summation order only


def test_nvfp4_exports_with_the_experts_excluded_and_ignored(tmp_path, moe_base):
    original = quarl.load_model(moe_base)
    with pytest.raises(ValueError, match="per-tensor scale"):
        _full_run(tmp_path / "bad", original, {"path": str(moe_base)}, "aligned", "nvfp4")
    exclude = ("layers.*.mlp.experts",)
    run = _full_run(tmp_path / "run", original, {"path": str(moe_base)}, "aligned", "nvfp4", exclude=exclude)
    export_checkpoint(run, tmp_path / "ct", "compressed-tensors")
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    experts = [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in (0, 2, 3) for e in range(8)
               for p in ("gate_proj", "up_proj", "down_proj")]
    assert sorted(qc["ignore"]) == sorted(["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in (0, 2, 3)] + experts)
    stored = _stored(tmp_path / "ct")
    assert stored["model.layers.0.mlp.experts.3.up_proj"]["weight"].dtype == torch.bfloat16
    assert "weight_packed" in stored["model.layers.0.self_attn.q_proj"]
    for e in range(8):  # the experts as trained, bf16 (transformers 5.x cannot load unquantized experts
        # beside compressed linears: its MoE conversion finds no tensor to stack, as for int-quantized ones)
        w = original.layers[2].mlp.experts.gate_up_proj[e, 128:].detach().bfloat16()
        assert torch.equal(stored[f"model.layers.2.mlp.experts.{e}.up_proj"]["weight"], w)


# ------------------------------------------------------------------------------------------ LoRA
def _lora_run(tmp_path: Path, base: Path, uaq: float, targets: tuple[str, ...]) -> tuple[Path, torch.nn.Module]:
    """A LoRA run's checkpoint (the adapters alone) on the bf16 base ``base``, and its policy."""
    policy = quarl.load_model(base)
    if uaq != 1.0:
        rescale_uaq(policy, uaq)
    add_lora(policy, 4, 8, targets)
    _randomize_adapters(policy, seed=3, scale=0.2)
    randomize_expert_adapters(policy, seed=4, scale=0.2)
    run = _save_run(tmp_path / "run", {k: v.clone() for k, v in adapter_state_dict(policy).items()},
                    {"path": str(base), "lora_rank": 4, "lora_alpha": 8, "lora_targets": list(targets)},
                    {"uaq_scale": uaq})
    return run, policy.eval()


@pytest.mark.parametrize("uaq", [1.0, 1.5])
@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                                     ("q_proj", "v_proj", "experts")], ids=["default", "experts"])
def test_peft_loads_moe_adapters_and_merged_export_gives_the_policy(tmp_path, uaq, targets):
    from peft import PeftModel

    base = tmp_path / "base"
    make_moe_checkpoint(base, moe_hf_config(), seed=5)
    run, policy = _lora_run(tmp_path, base, uaq, targets)
    with torch.no_grad():
        ours = policy(IDS)
        assert _rel(lora_policy(read_policy(find_checkpoint(run)))(IDS), ours) < 1e-5

    export_checkpoint(run, tmp_path / "peft", "peft")
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8
    if "experts" in targets:
        assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        assert cfg["target_modules"] == ["q_proj", "v_proj"]
    else:  # MLP names adapt the dense layer's MLP only (layer 1): what PEFT's target_modules find too
        assert "target_parameters" not in cfg
    peft_model = PeftModel.from_pretrained(_hf(base), tmp_path / "peft").eval()
    with torch.no_grad():
        theirs = peft_model(IDS).logits
        with peft_model.disable_adapter():
            plain = peft_model(IDS).logits
    assert _rel(theirs, ours) < 1e-5
    assert _rel(plain, ours) > 1e-3  # the adapters change the logits

    export_checkpoint(run, tmp_path / "merged", "hf-fp32")
    assert not any("lora" in k for k in _keys(tmp_path / "merged"))
    with torch.no_grad():
        assert _rel(_hf(tmp_path / "merged")(IDS).logits, ours) < 1e-5
        assert _rel(quarl.load_model(tmp_path / "merged")(IDS), ours) < 1e-5


def test_peft_expert_keys_are_what_peft_saves(tmp_path):
    """The stacked-expert layout of ``peft_state_dict`` is PEFT's own: the tensors PEFT saves for
    a model it adapted equal ours for the same adapters, key for key."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict

    base = tmp_path / "base"
    make_moe_checkpoint(base, moe_hf_config(), seed=6)
    run, policy = _lora_run(tmp_path, base, 1.0, ("q_proj", "experts"))
    export_checkpoint(run, tmp_path / "peft", "peft")
    ours = _keys_of(tmp_path / "peft" / "adapter_model.safetensors")
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    fresh = get_peft_model(_hf(base), LoraConfig(r=4, lora_alpha=8, target_modules=cfg["target_modules"],
                                                 target_parameters=cfg["target_parameters"]))
    theirs = get_peft_model_state_dict(fresh)
    assert sorted(ours) == sorted(theirs)
    assert all(ours[k].shape == theirs[k].shape for k in ours)


def _keys_of(file: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(file), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8-int8"])
def test_packed_export_of_an_moe_round_trips(tmp_path, moe_base, scheme):
    from quarl.export import load_packed
    from quarl.quant.experts import QuantExperts

    original = quarl.load_model(moe_base)
    run = _full_run(tmp_path / "run", original, {"path": str(moe_base)}, "aligned", scheme)
    export_checkpoint(run, tmp_path / "packed", "quarl-packed")
    loaded = load_packed(tmp_path / "packed", dtype=torch.float32)
    assert isinstance(loaded.layers[0].mlp.experts, QuantExperts)
    engine = copy.deepcopy(original)
    quantize_model(engine, scheme, QuantLinear)
    for i in (0, 2, 3):
        for proj, qw in engine.layers[i].mlp.experts.quantized_weights().items():
            theirs = loaded.layers[i].mlp.experts.quantized_weights()[proj]
            assert all(torch.equal(t, theirs.tensors()[f]) for f, t in qw.tensors().items()), proj
    with torch.no_grad():
        for p in engine.parameters():
            p.data = p.data.bfloat16().float()
        assert _rel(loaded(IDS), engine(IDS)) < 1e-5
