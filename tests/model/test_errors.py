"""Bad checkpoints fail with messages that name the problem."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

import quarl
from quarl.model import CheckpointError, ModelConfigError


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
