"""LoRA adapters on a frozen base: gradients against float64, PEFT parity, the adapter's plumbing."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from quarl.model.lora import (
    DEFAULT_TARGETS, LoRALinear, adapter_state_dict, adapters_disabled, add_lora, lora_modules, merged_weight,
    peft_config, peft_state_dict,
)
from quarl.model.presets import build_random_model, preset_config
from quarl.quant import QuantLinear, quantize_model
from tests.hf_models import make_hf_checkpoint


def _randomize_adapters(model: nn.Module, seed: int, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, _, ad in lora_modules(model):
            ad.A.copy_(scale * torch.randn(ad.A.shape, generator=g, dtype=ad.A.dtype))
            ad.B.copy_(scale * torch.randn(ad.B.shape, generator=g, dtype=ad.B.dtype))


def _tiny(seed: int = 0, dtype=torch.float32):
    return build_random_model(preset_config("tiny"), seed=seed, dtype=dtype, std=0.1)


def test_step_zero_is_the_base_and_only_adapters_train():
    model = _tiny()
    ids = torch.randint(0, 40, (2, 9))
    before = model(ids)
    names = add_lora(model, rank=4, alpha=8)
    assert len(names) == len(DEFAULT_TARGETS) * len(model.layers)
    assert torch.equal(model(ids), before)  # B starts at zero
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora.{p}" for n in names for p in ("A", "B")}
    assert all(isinstance(m, LoRALinear) for _, m, _ in lora_modules(model))


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8-int8", None])
def test_adapter_gradients_match_float64(scheme):
    """Adapter gradients of a LoRA model on a frozen base (low-bit QuantLinear running the
    straight-through frozen GEMM, or plain) equal a float64 model whose linears hold the
    dequantized base weights and the same adapters."""
    torch.manual_seed(1)
    model = _tiny(seed=3)
    if scheme is not None:
        quantize_model(model, scheme, QuantLinear)
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.learner_path = True
    add_lora(model, rank=3, alpha=6, targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
    _randomize_adapters(model, seed=5)

    ref = _tiny(seed=3).double()
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, (QuantLinear, LoRALinear)):
                w = mod.qweight.dequantize(torch.float64) if isinstance(mod, QuantLinear) else mod.weight.double()
                ref.get_submodule(name).weight.copy_(w)
    add_lora(ref, rank=3, alpha=6, targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
    with torch.no_grad():
        for (n1, _, a1), (n2, _, a2) in zip(lora_modules(model), lora_modules(ref)):
            assert n1 == n2
            a2.A.copy_(a1.A.double())
            a2.B.copy_(a1.B.double())
    if scheme == "w8a8-int8":  # the float64 base GEMM sees the activations as int8 codes (straight-through)
        import torch.nn.functional as F

        from quarl.quant import reference as qref

        def int8_base(mod):
            def forward(x):
                seen = x + (qref.fake_quantize_activations(x.detach(), "int8") - x).detach()
                y = F.linear(seen, mod.weight, mod.bias)
                return y + mod.lora(x) if isinstance(mod, LoRALinear) else y
            return forward

        for name, mod in ref.named_modules():
            if isinstance(mod, nn.Linear) and name.startswith("layers."):
                mod.forward = int8_base(mod)
    ids = torch.randint(0, 40, (2, 11))
    probe = torch.randn(2, 11, model.config.vocab_size, dtype=torch.float64)
    (model(ids).double() * probe).sum().backward()
    (ref(ids) * probe).sum().backward()
    for (name, _, a), (_, _, r) in zip(lora_modules(model), lora_modules(ref)):
        for p, q in ((a.A, r.A), (a.B, r.B)):
            assert p.grad is not None
            err = (p.grad.double() - q.grad).norm() / q.grad.norm()
            assert err < (1e-3 if scheme == "w8a8-int8" else 1e-5), (name, float(err))
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_adapters_disabled_gives_the_base_and_merged_weight_gives_the_policy():
    model = _tiny(seed=2)
    quantize_model(model, "w4a16", QuantLinear)
    base = copy.deepcopy(model)
    add_lora(model, rank=2, alpha=2)
    _randomize_adapters(model, seed=7)
    ids = torch.randint(0, 40, (1, 7))
    with adapters_disabled(model):
        assert torch.equal(model(ids), base(ids))
    assert not torch.allclose(model(ids), base(ids))
    # merging: a dense model with deq(W) + s B A gives the adapted model's logits
    dense = _tiny(seed=2)
    with torch.no_grad():
        for name, mod, _ in lora_modules(model):
            dense.get_submodule(name).weight.copy_(merged_weight(mod))
    torch.testing.assert_close(dense(ids), model(ids), rtol=1e-5, atol=1e-5)


def test_unknown_target_and_rank_are_refused():
    with pytest.raises(ValueError, match="unknown LoRA target"):
        add_lora(_tiny(), rank=2, alpha=2, targets=("qproj",))
    with pytest.raises(ValueError, match="rank must be >= 1"):
        add_lora(_tiny(), rank=0, alpha=2)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_peft_loads_the_adapter_and_gives_our_logits(family, tmp_path):
    """PEFT + transformers load our adapter files onto the same base checkpoint and give
    quarl's logits (float32)."""
    import json

    import transformers as tf
    from peft import PeftModel
    from safetensors.torch import save_file

    import quarl

    make_hf_checkpoint(family, tmp_path / "base", seed=4)
    model = quarl.load_model(tmp_path / "base", dtype=torch.float32)
    add_lora(model, rank=4, alpha=16, targets=("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"))
    _randomize_adapters(model, seed=11, scale=0.2)
    out = tmp_path / "adapter"
    out.mkdir()
    save_file(peft_state_dict(model), str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(peft_config(model, str(tmp_path / "base"))))

    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, out).eval()
    ids = torch.randint(3, 90, (2, 13))
    with torch.no_grad():
        theirs = peft_model(ids).logits
        ours = model(ids)
    rel = (ours - theirs).abs().max() / theirs.abs().max()
    assert rel < 1e-5, float(rel)
    with torch.no_grad(), peft_model.disable_adapter():
        base_logits = peft_model(ids).logits
    assert (ours - base_logits).abs().max() > 1e-3  # the adapters matter: the parity is not the base's


def test_adapter_state_dict_names():
    model = _tiny()
    add_lora(model, rank=2, alpha=4, targets=("q_proj",))
    sd = adapter_state_dict(model)
    assert set(sd) == {f"layers.{i}.self_attn.q_proj.lora.{p}" for i in range(len(model.layers)) for p in "AB"}
    assert set(peft_state_dict(model)) == {
        f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{p}.weight" for i in range(len(model.layers))
        for p in "AB"}
