"""Bad checkpoints fail with messages that name the problem."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

import quarl
from quarl.model import CheckpointError, ModelConfigError
from tests.hf_models import make_hf_checkpoint


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        quarl.load_model(tmp_path)


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ModelConfigError, match=r"unsupported model_type 'gpt2'.*llama, qwen2, qwen3"):
        quarl.load_model(tmp_path)


def test_missing_tensor(hf_checkpoint, tmp_path):
    _, path, _ = hf_checkpoint
    bad = _copy(path, tmp_path / "bad")
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        quarl.load_model(bad)


def test_mis_shaped_and_extra_tensor(hf_checkpoint, tmp_path):
    _, path, _ = hf_checkpoint
    bad = _copy(path, tmp_path / "bad2")
    tensors = load_file(str(bad / "model.safetensors"))
    w = tensors["model.layers.0.self_attn.o_proj.weight"]
    tensors["model.layers.0.self_attn.o_proj.weight"] = w[:, :-1].contiguous()
    tensors["model.layers.0.extra.weight"] = w
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        quarl.load_model(bad)
    assert "mis-shaped tensors: model.layers.0.self_attn.o_proj.weight" in str(e.value)
    assert "unexpected tensors: model.layers.0.extra.weight" in str(e.value)


def test_sharded_checkpoint_loads(hf_checkpoint, tmp_path):
    family, path, hf = hf_checkpoint
    shard_dir = tmp_path / "sharded"
    hf.save_pretrained(str(shard_dir), max_shard_size="20KB")
    assert (shard_dir / "model.safetensors.index.json").is_file()
    a = quarl.load_model(shard_dir)
    b = quarl.load_model(path)
    for (n1, p1), (_, p2) in zip(a.named_parameters(), b.named_parameters()):
        assert (p1 == p2).all(), n1


def test_quantized_checkpoint_is_refused(hf_checkpoint, tmp_path):
    _, path, _ = hf_checkpoint
    bad = _copy(path, tmp_path / "q")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="quantized"):
        quarl.load_model(bad)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    make_hf_checkpoint("qwen2", path)
    return path


def _damage(data: bytes, how: str) -> bytes:
    return {
        "half": data[: len(data) // 2],
        "four_bytes": data[:4],
        "lfs_pointer": b"version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n",
        "html_page": b"<!DOCTYPE html><html>404</html>" * 4,
        "corrupt_header": data[:8] + b"[" + data[9:],
    }[how]


@pytest.mark.parametrize("how, what", [
    ("half", r"is truncated \(\d+ bytes on disk, its header describes \d+\)"),
    ("four_bytes", r"is truncated \(4 bytes"),
    ("lfs_pointer", r"is a Git LFS pointer, not the weights \(run `git lfs pull`"),
    ("html_page", r"is not a safetensors file, or truncated inside its header"),
    ("corrupt_header", r"is a safetensors file with a corrupt header"),
])
def test_damaged_weights_file_is_named(qwen2_dir, tmp_path, how, what):
    bad = _copy(qwen2_dir, tmp_path / "bad")
    file = bad / "model.safetensors"
    file.write_bytes(_damage(file.read_bytes(), how))
    with pytest.raises(CheckpointError, match=what) as e:
        quarl.load_model(bad)
    assert str(file) in str(e.value) and "re-download the checkpoint, or re-save it" in str(e.value)


def test_truncated_shard_is_named(qwen2_dir, tmp_path):
    hf = make_hf_checkpoint("qwen2", tmp_path / "unused")
    shard_dir = tmp_path / "sharded"
    hf.save_pretrained(str(shard_dir), max_shard_size="20KB")
    shard = sorted(shard_dir.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{shard}.* is truncated"):
        quarl.load_model(shard_dir)


def test_generate_cli_names_a_truncated_file(qwen2_dir, tmp_path):
    bad = _copy(qwen2_dir, tmp_path / "bad")
    file = bad / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1])
    r = subprocess.run([sys.executable, "-m", "quarl", "generate", "--model", str(bad), "--prompt", "x"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"quarl generate: error: {file} is truncated"), r.stderr
    assert "re-download the checkpoint" in r.stderr


@pytest.mark.parametrize("extra, what", [
    ("model.layers.0.mlp.gate.e_score_correction_bias", "a score-correction bias"),
    ("model.layers.2.mlp.shared_expert.gate_proj.weight", "a shared expert"),
    ("model.layers.0.mlp.gate.bias", "a router bias"),
])
def test_moe_checkpoint_with_another_router_names_the_layer(tmp_path, extra, what):
    """A qwen3_moe checkpoint carrying a router or block tensor Qwen3-MoE does not have fails at
    load, naming the layer, the tensor and what to change, rather than routing without it."""
    import torch

    from tests.hf_models import make_moe_checkpoint

    make_moe_checkpoint(tmp_path, seed=1)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors[extra] = torch.zeros(8)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    layer = extra.partition(".mlp.")[0]
    with pytest.raises(CheckpointError, match=rf"{layer}\.mlp has {what}.*fix model_type"):
        quarl.load_model(tmp_path)


@pytest.mark.parametrize("change, message", [
    (dict(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
    (dict(n_group=8, topk_group=4), "n_group=8"),
    (dict(routed_scaling_factor=2.5), "routed_scaling_factor=2.5"),
    (dict(n_shared_experts=1), "n_shared_experts=1"),
])
def test_moe_config_with_another_router_is_refused(change, message):
    from quarl.model import TransformerConfig
    from tests.hf_models import moe_hf_config

    raw = {**moe_hf_config().to_dict(), **change}
    with pytest.raises(ModelConfigError, match=rf"{message}.*softmax over mlp\.gate\.weight"):
        TransformerConfig.from_hf_dict(raw)
