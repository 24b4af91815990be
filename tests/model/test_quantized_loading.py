"""load_quantized_model: the model load_model + quantize_model give, built one linear at a time,
and its packed cache."""

from __future__ import annotations

import gc
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import quarl.model.quantized_loading as ql
from quarl.model import CheckpointError, load_model
from quarl.model.quantized_loading import load_quantized_model, packed_cache_key
from quarl.quant import QuantLinear, get_scheme, quantize_model
from tests.hf_models import make_hf_checkpoint

WEIGHT_SCHEMES = ("w4a16", "w8a8-fp8", "w4a16-asym", "nvfp4")
OTHER_WEIGHT_SCHEMES = ("w8a8-int8", "w4a8-int8", "mxfp4", "w2a16")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """qwen2 (tied, q/k/v biases) saved in 20 KB shards with an index; llama (untied) in one file."""
    root = tmp_path_factory.mktemp("quantized_loading")
    hf = make_hf_checkpoint("qwen2", root / "qwen2_single")
    hf.save_pretrained(str(root / "qwen2"), max_shard_size="20KB")
    assert (root / "qwen2" / "model.safetensors.index.json").is_file()
    make_hf_checkpoint("llama", root / "llama")
    return {"qwen2": root / "qwen2", "llama": root / "llama"}


def reference(path, scheme, include=None, exclude=()):
    model = load_model(path, torch.bfloat16)
    quantize_model(model, scheme, QuantLinear, include, exclude)
    return model


def assert_same_model(a, b):
    """Same module types, and every parameter and buffer equal bit for bit (same dtype,
    same requires_grad)."""
    assert [(n, type(m)) for n, m in a.named_modules()] == [(n, type(m)) for n, m in b.named_modules()]
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        x, y = sa[name], sb[name]
        assert x.dtype == y.dtype and x.shape == y.shape and x.device == y.device, name
        if x.element_size() == 1:  # float8 has no equality kernel on CPU: compare the bytes
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), name
    assert [(n, p.requires_grad) for n, p in a.named_parameters()] == [
        (n, p.requires_grad) for n, p in b.named_parameters()]


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("scheme", WEIGHT_SCHEMES)
def test_equals_load_then_quantize(checkpoints, family, scheme):
    model = load_quantized_model(checkpoints[family], scheme)
    assert_same_model(model, reference(checkpoints[family], scheme))
    assert isinstance(model.get_submodule("layers.1.mlp.down_proj"), QuantLinear)
    assert model.quantized_from_cache is False


@pytest.mark.parametrize("scheme", OTHER_WEIGHT_SCHEMES)
def test_other_weight_schemes(checkpoints, scheme):
    assert_same_model(load_quantized_model(checkpoints["qwen2"], scheme), reference(checkpoints["qwen2"], scheme))


def test_bf16_is_load_model(checkpoints):
    model = load_quantized_model(checkpoints["llama"], "bf16")
    assert_same_model(model, load_model(checkpoints["llama"], torch.bfloat16))


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_include_exclude(checkpoints, family):
    include, exclude = ("layers.0.*", "lm_head"), ("*.down_proj", "*.k_proj")
    model = load_quantized_model(checkpoints[family], "w4a16", include=include, exclude=exclude)
    assert_same_model(model, reference(checkpoints[family], "w4a16", include, exclude))
    packed = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    expected = {f"layers.0.{m}" for m in ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj",
                                          "mlp.gate_proj", "mlp.up_proj")}
    assert packed == (expected | {"lm_head"} if family == "llama" else expected)  # qwen2's head is tied


def _full_precision_bytes(skip: set[int], min_numel: int) -> int:
    """Bytes of the distinct storages of live 2-D full-precision tensors of at least
    ``min_numel`` elements, other than the objects with ids in ``skip``."""
    storages = {}
    for o in gc.get_objects():
        if (issubclass(type(o), torch.Tensor) and id(o) not in skip and o.device.type != "meta" and o.dim() == 2
                and o.dtype in (torch.float32, torch.bfloat16, torch.float16) and o.numel() >= min_numel):
            storages[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
    return sum(storages.values())


def _peak_while_quantizing(monkeypatch, module, load, min_numel: int) -> int:
    """The most bytes of full-precision tensors of at least ``min_numel`` elements that ``load``
    made and holds at any call of ``module``'s ``quantize_weight``."""
    gc.collect()
    before = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]  # held: their ids stay theirs
    skip = {id(o) for o in before}
    seen: list[int] = []
    quantize = module.quantize_weight

    def recording(w, scheme):
        seen.append(_full_precision_bytes(skip, min_numel))
        return quantize(w, scheme)

    monkeypatch.setattr(module, "quantize_weight", recording)
    load()
    monkeypatch.undo()
    assert seen
    return max(seen)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_one_full_precision_linear_at_a_time(checkpoints, monkeypatch, family):
    path = checkpoints[family]
    full = load_model(path, torch.bfloat16)
    linears = {n for n, m in full.named_modules() if type(m) is torch.nn.Linear and n.startswith("layers.")}
    sizes = [full.get_submodule(n).weight.numel() for n in linears]
    largest, smallest = max(sizes), min(sizes)
    unquantized = sum(p.numel() * 2 for n, p in full.named_parameters()
                      if p.dim() == 2 and n.removesuffix(".weight") not in linears)
    # the embeddings (and an untied head) and one linear, in bf16 (the fp32 tensor read from
    # the file is gone once cast)
    bound = unquantized + largest * 2
    all_linears = sum(sizes) * 2
    assert unquantized + all_linears > bound  # so that a loader holding every bf16 linear fails
    del full

    model = None

    def streamed():
        nonlocal model
        model = load_quantized_model(path, "w4a16")

    peak = _peak_while_quantizing(monkeypatch, ql, streamed, smallest)
    assert peak <= bound, f"{peak} bytes of full-precision tensors alive while quantizing (bound {bound})"
    for name in linears:
        assert not hasattr(model.get_submodule(name), "weight")
    # the measurement sees what load_model + quantize_model holds
    import quarl.quant.linear as linear_module
    naive = _peak_while_quantizing(monkeypatch, linear_module, lambda: reference(path, "w4a16"), smallest)
    assert naive >= unquantized + all_linears > bound


def _forbid_quantizing(monkeypatch):
    def fail(w, scheme):
        raise AssertionError("quantized although the cache holds the model")

    monkeypatch.setattr(ql, "quantize_weight", fail)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_cache_hit_is_identical_and_does_not_quantize(checkpoints, tmp_path, monkeypatch, family):
    first = load_quantized_model(checkpoints[family], "nvfp4", cache_dir=tmp_path)
    assert first.quantized_from_cache is False
    _forbid_quantizing(monkeypatch)
    second = load_quantized_model(checkpoints[family], "nvfp4", cache_dir=tmp_path)
    assert second.quantized_from_cache is True
    assert_same_model(second, first)
    assert_same_model(second, reference(checkpoints[family], "nvfp4"))
    x = torch.randint(0, 96, (1, 7))
    assert torch.equal(second(x), first(x))


def test_changed_inputs_miss(checkpoints, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["qwen2"], path)
    cache = tmp_path / "cache"

    def load(scheme="w4a16", **kw):
        model = load_quantized_model(path, scheme, cache_dir=cache, **kw)
        return model.quantized_from_cache, len(list(cache.iterdir()))

    assert load() == (False, 1)
    assert load() == (True, 1)
    assert load("w8a8-fp8") == (False, 2)
    assert load(exclude=("*.o_proj",)) == (False, 3)
    assert load(dtype=torch.float32) == (False, 4)
    shard = sorted(path.glob("model-*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert load() == (False, 5)
    assert load() == (True, 5)
    cuda_key = packed_cache_key(path, get_scheme("w4a16"), torch.bfloat16, torch.device("cuda"), ("layers.*",), ())
    assert not (cache / cuda_key).exists()


@pytest.mark.parametrize("damage", ["truncated shard", "no manifest"])
def test_damaged_cache_entry_is_rebuilt(checkpoints, tmp_path, damage):
    path = checkpoints["llama"]
    first = load_quantized_model(path, "w4a16-asym", cache_dir=tmp_path)
    (entry,) = tmp_path.iterdir()
    if damage == "truncated shard":
        shard = sorted(entry.glob("packed-*.safetensors"))[0]
        shard.write_bytes(shard.read_bytes()[:-100])
    else:
        (entry / "manifest.json").unlink()
    with pytest.warns(UserWarning, match=re.escape(str(entry))):
        rebuilt = load_quantized_model(path, "w4a16-asym", cache_dir=tmp_path)
    assert rebuilt.quantized_from_cache is False
    assert_same_model(rebuilt, first)
    again = load_quantized_model(path, "w4a16-asym", cache_dir=tmp_path)
    assert again.quantized_from_cache is True
    assert_same_model(again, first)


def test_mis_shaped_tensor_names_tensor_and_file(checkpoints, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoints["qwen2"], bad)
    name = "model.layers.1.mlp.up_proj.weight"
    shard = next(f for f in sorted(bad.glob("model-*.safetensors")) if name in load_file(str(f)))
    tensors = load_file(str(shard))
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}: checkpoint \(96, 63\).*{shard.name}"):
        load_quantized_model(bad, "w4a16")


def test_random_quantized_model_packs_every_selected_linear_and_is_seeded():
    """Random weights of a shape with the selected linears packed one at a time (the bench's
    32B LoRA base): no full-precision weight of a selected linear, the distribution of
    build_random_model (norms one, biases zero, weights ~ N(0, std)), equal for equal seeds."""
    from quarl.model.presets import preset_config
    from quarl.model.quantized_loading import random_quantized_model
    from quarl.quant import QuantLinear

    cfg = preset_config("tiny")
    a = random_quantized_model(cfg, "w4a16", seed=3, dtype=torch.float32, exclude=("*.down_proj",), std=0.05)
    b = random_quantized_model(cfg, "w4a16", seed=3, dtype=torch.float32, exclude=("*.down_proj",), std=0.05)
    packed = {n for n, m in a.named_modules() if isinstance(m, QuantLinear)}
    assert packed == {f"layers.{i}.{p}" for i in range(cfg.num_hidden_layers) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")}
    assert all(not t.is_meta for t in list(a.parameters()) + list(a.buffers()))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(torch.equal(v, torch.ones_like(v)) for k, v in sa.items() if k.endswith("norm.weight"))
    w = a.layers[0].mlp.up_proj.qweight.dequantize(torch.float32)
    assert 0.04 < float(w.std()) < 0.06
    ids = torch.randint(0, 100, (1, 5))
    assert torch.isfinite(a(ids)).all()


def test_bench_random_base_workload_uses_the_builtin_shape():
    from quarl.bench.train import WORKLOADS, workload_overrides

    w = WORKLOADS["lora-32b"]
    flags = workload_overrides(w, None)
    assert "--model.builtin=qwen2.5-32b" in flags and not any(f.startswith("--model.path") for f in flags)
    from quarl.config import load_run_config

    cfg = load_run_config(None, flags + ["--quant.mode=aligned", "--quant.scheme=w4a16"])
    assert cfg.model.lora_rank == 64 and cfg.trainer.activation_checkpointing


def test_engine_from_a_path_runs_the_quantized_load(tmp_path):
    """``Engine(path, scheme)`` packs the checkpoint while loading: the same greedy completions
    and log-probs as an engine over ``load_model`` + ``quantize_model``."""
    import quarl
    from quarl.rollout import Engine, EngineConfig, SamplingParams
    from tests.hf_models import make_hf_checkpoint

    make_hf_checkpoint("qwen2", tmp_path / "m", seed=5)
    cfg = EngineConfig(num_kv_blocks=32, max_model_len=64)
    a = Engine(tmp_path / "m", scheme="w4a16", config=cfg, device="cpu")
    b = Engine(quarl.load_model(tmp_path / "m", dtype=torch.float32), scheme="w4a16", config=cfg)
    params = [SamplingParams(n=1, temperature=0.0, max_new_tokens=8)]
    (ca,), (cb,) = a.generate([[3, 4, 5]], params), b.generate([[3, 4, 5]], params)
    assert ca.token_ids == cb.token_ids and ca.logprobs == cb.logprobs
    assert a.model.layers[0].mlp.down_proj.qweight.qdata.dtype != torch.float32
