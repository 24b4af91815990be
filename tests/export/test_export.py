"""`quarl export` on a hand-made checkpoint of the tiny built-in model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import quarl
from quarl.cli.main import main
from quarl.export import export_checkpoint, load_packed
from quarl.model.config import ModelConfigError
from quarl.model.presets import build_random_model
from quarl.quant import QATLinear, QuantLinear, apply_uaq, quantize_model
from quarl.trainer.checkpoint import save_checkpoint

IDS = torch.tensor([[5, 17, 99, 3, 42, 64, 7, 120], [1, 2, 3, 4, 5, 6, 7, 8]])


def _original(builtin: str = "tiny") -> torch.nn.Module:
    model = build_random_model(builtin, seed=1)
    with torch.no_grad():  # norms away from 1 so that UAQ (which scales them) is visible
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def _make_run(run_dir: Path, model, mode: str = "aligned", scheme: str = "w4a16", uaq: float = 1.0,
              step: int = 3, builtin: str = "tiny", exclude: tuple[str, ...] = ()) -> Path:
    """A checkpoint laid out as the trainer writes it: UAQ applied, QATLinear in aligned mode."""
    policy = copy.deepcopy(model)
    if uaq != 1.0:
        apply_uaq(policy, uaq)
    if mode == "aligned":
        quantize_model(policy, scheme, QATLinear, exclude=exclude)
    config = {
        "model": {"path": None, "builtin": builtin, "tokenizer": None},
        "quant": {"mode": mode, "scheme": scheme, "uaq_scale": uaq, "include": ["layers.*"], "exclude": list(exclude)},
        "algo": {"loss": "tbpo"},
    }
    state = {"step": step, "learner": {"model": policy.state_dict(), "optimizer": {}}, "config": config}
    save_checkpoint(run_dir, step, state)
    return run_dir


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).float()


def _assert_rel_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    assert ((a - b).norm() / b.norm()).item() < tol


@pytest.mark.parametrize("uaq", [1.0, 1.5])
def test_hf_fp32_export_equals_the_unscaled_original(tmp_path, uaq):
    original = _original()
    run = _make_run(tmp_path / "run", original, uaq=uaq)
    res = export_checkpoint(run, tmp_path / "hf", "hf-fp32")
    assert res.step == 3 and res.copied == []
    exported = quarl.load_model(tmp_path / "hf")
    for name, p in original.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], p, rtol=1e-6, atol=1e-7)
    want = _logits(original)
    _assert_rel_close(_logits(exported), want)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        _assert_rel_close(hf(IDS).logits.float(), want)


def test_hf_bf16_export_and_step_selection(tmp_path):
    original = _original()
    run = _make_run(tmp_path / "run", original, mode="rollout", step=2)
    _make_run(run, original, mode="rollout", step=5)
    export_checkpoint(run, tmp_path / "latest", "hf-bf16")
    with safe_open(str(tmp_path / "latest" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((tmp_path / "latest" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert export_checkpoint(run, tmp_path / "s2", "hf-bf16", step=2).step == 2
    assert export_checkpoint(run / "checkpoints" / "step_000005", tmp_path / "c", "hf-bf16").step == 5
    _assert_rel_close(_logits(quarl.load_model(tmp_path / "latest")), _logits(original), tol=2e-2)
    with pytest.raises(ValueError, match="available: 2, 5"):
        export_checkpoint(run, tmp_path / "x", "hf-bf16", step=4)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "x", "hf-bf16")


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8-int8", "nvfp4"])
def test_packed_round_trip(tmp_path, scheme):
    original = _original()
    run = _make_run(tmp_path / "run", original, scheme=scheme, uaq=1.5)
    export_checkpoint(run, tmp_path / "packed", "quarl-packed")
    qc = json.loads((tmp_path / "packed" / "config.json").read_text())["quantization_config"]
    assert qc["scheme"] == scheme and len(qc["modules"]) == 2 * 7
    # in memory: the engine's model (UAQ applied, codes made from the fp32 master weights)
    # with everything else rounded to bf16, as the export stores it
    engine = apply_uaq(copy.deepcopy(original), 1.5)
    quantize_model(engine, scheme, QuantLinear)
    with torch.no_grad():
        for p in engine.parameters():  # QuantLinear codes/scales are buffers, untouched
            p.copy_(p.bfloat16().float())
    loaded = load_packed(tmp_path / "packed", dtype=torch.float32)
    assert isinstance(loaded.layers[0].self_attn.q_proj, QuantLinear)
    assert torch.equal(_logits(loaded), _logits(engine))
    assert torch.isfinite(_logits(load_packed(tmp_path / "packed"))).all()  # as stored: bf16 activations
    with pytest.raises(ModelConfigError, match="quantized"):
        quarl.load_model(tmp_path / "packed")


def test_packed_load_rounds_older_group_scales_to_bf16(tmp_path):
    """An export written before group scales were bf16 values (fp32 scales off the bf16 grid)
    loads with them rounded to the nearest bf16, as vLLM reads them; codes and w8a8's per-channel
    fp32 scales are loaded as stored."""
    from safetensors.torch import load_file, save_file

    for scheme in ("w4a16", "w8a8-int8"):
        out = tmp_path / scheme
        export_checkpoint(_make_run(tmp_path / f"run-{scheme}", _original(), scheme=scheme), out, "quarl-packed")
        tensors = load_file(out / "model.safetensors")
        name = "model.layers.0.mlp.up_proj.scales"
        old = tensors[name] * (1 + 2**-12)  # as an older quarl wrote them: not bf16 values
        assert not torch.equal(old.bfloat16().float(), old)
        tensors[name] = old
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        up = load_packed(out).layers[0].mlp.up_proj
        assert torch.equal(up.qdata, tensors["model.layers.0.mlp.up_proj.qdata"])
        assert torch.equal(up.scales, old.bfloat16().float() if scheme == "w4a16" else old)


def test_cli(tmp_path, capsys):
    run = _make_run(tmp_path / "run", _original(), mode="bf16")
    assert main(["export", str(run), "--out", str(tmp_path / "hf"), "--format", "hf-fp32"]) == 0
    assert str(tmp_path / "hf") in capsys.readouterr().out
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert main(["export", str(run), "--out", str(tmp_path / "p"), "--format", "quarl-packed"]) == 2
    assert "quant.mode=bf16" in capsys.readouterr().err
    assert main(["export", str(run), "--out", str(tmp_path / "p"), "--format", "quarl-packed",
                 "--scheme", "w8a8-int8"]) == 0
