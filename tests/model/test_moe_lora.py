"""LoRA on Qwen3-MoE: default targets, grouped expert adapters against a per-expert loop, merging."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from quarl.config import load_run_config
from quarl.config.typed import ConfigError
from quarl.model.lora import (
    ExpertsLoRA, LoRALinear, adapter_state_dict, adapters_disabled, add_lora, expert_lora_modules, has_lora,
    lora_modules, merged_experts,
)
from quarl.model.moe import Experts, SparseMoeBlock
from quarl.model.presets import build_random_model, preset_config
from tests.hf_models import make_moe_checkpoint, moe_hf_config
from tests.model.test_lora import _randomize_adapters


def _moe(seed: int = 0) -> torch.nn.Module:
    return build_random_model(preset_config("moe-tiny"), seed=seed, std=0.1).eval()


def randomize_expert_adapters(model: torch.nn.Module, seed: int, scale: float = 0.1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, _, ad in expert_lora_modules(model):
            for p in ad.parameters():
                p.copy_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _loop_reference(experts: Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each (token, slot) through its expert one at a time, adapters as ``x @ A^T @ B^T * scaling``."""
    ad = experts.lora
    out = torch.zeros_like(x)
    i = experts.intermediate_size
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            xe = x[n]
            gu = experts.gate_up_proj[e] @ xe
            gu = gu + (xe @ ad.gate_up_proj.A[e].T @ ad.gate_up_proj.B[e].T) * ad.gate_up_proj.scaling
            h = F.silu(gu[:i]) * gu[i:]
            y = experts.down_proj[e] @ h + (h @ ad.down_proj.A[e].T @ ad.down_proj.B[e].T) * ad.down_proj.scaling
            out[n] += weights[n, j] * y
    return out


def test_default_targets_on_moe_tiny_are_attention_only():
    model = _moe()
    ids = torch.randint(0, 60, (2, 7))
    with torch.no_grad():
        before = model(ids)
    names = add_lora(model, rank=4, alpha=8)
    dense = [i for i, layer in enumerate(model.layers) if not isinstance(layer.mlp, SparseMoeBlock)]
    assert dense == [1]  # moe-tiny: layer 1 keeps a dense MLP, which the MLP names leave alone too
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert set(names) == {f"layers.{i}.self_attn.{p}" for i in range(3) for p in attn}
    assert not any("lora" in n for layer in model.layers for n, _ in layer.mlp.named_parameters())
    assert all(model.layers[i].mlp.experts.lora is None for i in (0, 2))
    assert next(expert_lora_modules(model), None) is None
    with torch.no_grad():
        assert torch.equal(model(ids), before)
    with pytest.raises(ValueError, match="adapt nothing in an MoE model"):
        add_lora(_moe(), 4, 8, targets=("gate_proj", "down_proj"))


def test_expert_adapters_start_at_zero_and_equal_a_per_expert_loop():
    torch.manual_seed(0)
    model = _moe(seed=1)
    ids = torch.randint(0, 60, (2, 9))
    with torch.no_grad():
        before = model(ids)
    names = add_lora(model, rank=3, alpha=6, targets=("q_proj", "experts"))
    assert [n for n in names if n.endswith("experts")] == ["layers.0.mlp.experts", "layers.2.mlp.experts"]
    ad = model.layers[0].mlp.experts.lora
    assert isinstance(ad, ExpertsLoRA)
    assert ad.gate_up_proj.A.shape == (8, 3, 64) and ad.gate_up_proj.B.shape == (8, 64, 3)  # E, r, H / E, 2I, r
    assert ad.down_proj.A.shape == (8, 3, 32) and ad.down_proj.B.shape == (8, 64, 3)  # E, r, I / E, H, r
    assert torch.count_nonzero(ad.gate_up_proj.B) == 0 and ad.gate_up_proj.A.abs().max() <= 1 / 64 ** 0.5
    with torch.no_grad():
        assert torch.equal(model(ids), before)  # B = 0: step 0 is the base

    randomize_expert_adapters(model, seed=2)
    experts = model.layers[0].mlp.experts
    x = torch.randn(11, 64)
    eids = torch.stack([torch.randperm(8)[:2] for _ in range(11)])
    eids[3] = eids[4]  # some experts get several rows, others none
    w = torch.rand(11, 2)
    with torch.no_grad():
        got = experts(x, eids, w)
        want = _loop_reference(experts, x, eids, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad(), adapters_disabled(model):
        assert not ad.enabled
        assert torch.equal(model(ids), before)
    assert ad.enabled


def test_expert_adapter_gradients_reach_a_and_b_and_the_base_stays_frozen():
    model = _moe(seed=2)
    add_lora(model, rank=4, alpha=8, targets=("q_proj", "experts"))
    randomize_expert_adapters(model, seed=3)
    _randomize_adapters(model, seed=4)
    ids = torch.randint(0, 60, (3, 8))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(adapter_state_dict(model))
    assert {"layers.0.mlp.experts.lora.gate_up_proj.A", "layers.2.mlp.experts.lora.down_proj.B"} <= trainable
    model(ids).logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def _merged_dense(experts: Experts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The experts with their adapters merged (``W + s B A``), every expert run on every token
    and the outputs weighted by a dense routing matrix: no sort, no grouped GEMM."""
    ad, i = experts.lora, experts.intermediate_size
    gate_up = experts.gate_up_proj + torch.bmm(ad.gate_up_proj.B, ad.gate_up_proj.A) * ad.gate_up_proj.scaling
    down = experts.down_proj + torch.bmm(ad.down_proj.B, ad.down_proj.A) * ad.down_proj.scaling
    h = torch.einsum("nh,eoh->neo", x, gate_up)
    y = torch.einsum("nei,ehi->neh", F.silu(h[..., :i]) * h[..., i:], down)
    route = torch.zeros(x.shape[0], experts.num_experts, dtype=x.dtype).scatter_add(1, ids, w)
    return torch.einsum("ne,neh->nh", route, y)


def test_expert_gradients_match_float64_merged_experts():
    """The grouped adapters' gradients equal those of float64 experts ``W + s B A`` (autograd
    through the merge): the forward and backward of the adapter terms are the merged linear's."""
    model = _moe(seed=4)
    add_lora(model, rank=2, alpha=4, targets=("experts",))  # rank 2: fp32 rows of 8 bytes, the padded GEMM
    randomize_expert_adapters(model, seed=5)
    ref = copy.deepcopy(model).double()
    for block in (ref.layers[0].mlp, ref.layers[2].mlp):
        block.experts.forward = lambda x, i, w, e=block.experts: _merged_dense(e, x, i, w)
    ids = torch.randint(0, 60, (2, 10))
    out = model(ids)
    out.sum().backward()
    want = ref(ids)
    want.sum().backward()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    grads = 0
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if p.requires_grad:
            assert q.grad.abs().max() > 0, name
            assert (p.grad.double() - q.grad).abs().max() / q.grad.abs().max() < 1e-5, name  # float32 sums
            grads += 1
    assert grads == 2 * 4


def test_merged_experts_give_the_adapted_function():
    model = _moe(seed=6)
    add_lora(model, rank=4, alpha=8, targets=("experts",))
    randomize_expert_adapters(model, seed=7)
    merged = copy.deepcopy(model)
    for _, mod, _ in list(expert_lora_modules(merged)):
        for proj, w in merged_experts(mod).items():
            getattr(mod, proj).data = w
        mod.lora = None
    ids = torch.randint(0, 60, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), model(ids), rtol=1e-5, atol=1e-5)
    assert has_lora(model) and not has_lora(merged)


def test_expert_target_on_a_dense_model_is_refused():
    dense = build_random_model(preset_config("tiny"), seed=0)
    with pytest.raises(ValueError, match="dense model"):
        add_lora(dense, 4, 8, targets=("q_proj", "experts"))
    with pytest.raises(ConfigError, match="dense model"):
        load_run_config(None, ["--model.lora_rank=4", "--model.lora_targets=[q_proj,experts]", "--model.builtin=tiny"])
    with pytest.raises(ConfigError, match="experts"):
        load_run_config(None, ["--model.lora_rank=4", "--model.lora_targets=[q_proj,expert]"])


def test_expert_target_is_accepted_on_an_moe_checkpoint(tmp_path):
    make_moe_checkpoint(tmp_path / "moe", moe_hf_config(), seed=0)
    cfg = load_run_config(None, ["--model.lora_rank=4", "--model.lora_targets=[q_proj,experts]",
                                 f"--model.path={tmp_path / 'moe'}"])
    assert cfg.model.lora_targets == ["q_proj", "experts"]


def test_experts_without_lora_support_are_refused():
    model = _moe()
    experts = model.layers[0].mlp.experts
    del experts.lora  # an experts type whose forward does not add adapters
    with pytest.raises(ValueError, match="do not run LoRA adapters"):
        add_lora(model, 4, 8, targets=("experts",))


def test_dense_lora_modules_are_unchanged_by_the_expert_adapters():
    model = _moe()
    add_lora(model, 4, 8, targets=("q_proj", "experts"))
    assert all(isinstance(m, LoRALinear) for _, m, _ in lora_modules(model))
    assert sorted(n for n, _, _ in lora_modules(model)) == [f"layers.{i}.self_attn.q_proj" for i in range(3)]


def test_short_lora_runs_on_an_moe_model_train_and_export(tmp_path):
    """Two trainer steps of LoRA on a Qwen3-MoE checkpoint shaped like moe-tiny: expert adapters on a
    bf16 base, and the default (attention) targets on a w4a16 base; the first exports to PEFT with the
    policy's logits."""
    import json

    import transformers as tf
    from peft import PeftModel

    from quarl.export.hf import find_checkpoint, read_policy
    from quarl.export.lora import lora_policy
    from quarl.export.run import export_checkpoint
    from quarl.trainer import checkpoint as ckpt
    from tests.trainer.test_train_e2e import _train

    make_moe_checkpoint(tmp_path / "base", moe_hf_config(), seed=2)
    common = ["--model.lora_rank=4", "--model.lora_alpha=8", "--trainer.sft_warmup_steps=0", "--optim.lr=3e-2",
              f"--model.path={tmp_path / 'base'}", "--model.tokenizer=builtin", "--trainer.save_every=2"]
    run = tmp_path / "experts"
    _, rows = _train(run, *common, "--quant.mode=bf16", "--model.lora_targets=[q_proj,v_proj,experts]", steps=2)
    assert len(rows) == 2 and rows[-1]["mismatch/kl_k3"] < 1e-6
    saved = ckpt.load_checkpoint(ckpt.latest_checkpoint(run))["learner"]["model"]
    assert all(".lora." in k for k in saved)
    assert any(k.startswith("layers.0.mlp.experts.lora.gate_up_proj") for k in saved)
    assert all(saved[k].abs().max() > 0 for k in saved if k.endswith(".B"))  # every adapter trained

    export_checkpoint(run, tmp_path / "peft", "peft")
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["target_parameters"]
    ids = torch.randint(3, 60, (2, 12))
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    with torch.no_grad():
        ours, theirs = lora_policy(read_policy(find_checkpoint(run)))(ids), peft_model(ids).logits
    assert (ours - theirs).abs().max() / theirs.abs().max() < 1e-5

    trainer, rows = _train(tmp_path / "attn", *common, "--quant.mode=aligned", "--quant.scheme=w4a16", steps=2)
    assert len(rows) == 2
    adapted = {n for n, _ in trainer.learner.model.named_parameters() if ".lora." in n}
    assert adapted and all(".self_attn." in n for n in adapted)


@pytest.mark.parametrize("layer", ["QuantExperts", "QATExperts"])
def test_expert_adapters_on_quantized_experts_equal_a_loop_over_the_dequantized_base(layer):
    """A frozen low-bit expert base (the engine's QuantExperts, the aligned learner's QATExperts)
    runs the adapters too: the loop reference over the dequantized experts, and the gradient
    reaches A and B but not the base."""
    from quarl.quant.experts import QATExperts, QuantExperts
    from quarl.quant.linear import QATLinear, QuantLinear, quantize_model

    model = _moe(seed=3)
    quantize_model(model, "w4a16", QuantLinear if layer == "QuantExperts" else QATLinear)
    experts = model.layers[0].mlp.experts
    assert type(experts).__name__ == layer
    add_lora(model, rank=3, alpha=6, targets=("experts",))
    randomize_expert_adapters(model, seed=4)
    qws = experts.quantized_weights()
    plain = Experts(64, experts.intermediate_size, experts.num_experts)
    with torch.no_grad():
        plain.gate_up_proj.copy_(qws["gate_up_proj"].dequantize().view(plain.gate_up_proj.shape))
        plain.down_proj.copy_(qws["down_proj"].dequantize().view(plain.down_proj.shape))
    plain.lora = experts.lora
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 64, generator=g)
    eids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(9)])
    w = torch.rand(9, 2, generator=g)
    got = experts(x, eids, w)
    with torch.no_grad():
        want = _loop_reference(plain, x, eids, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.square().sum().backward()
    ad = experts.lora
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in ad.parameters())
    assert isinstance(experts, (QuantExperts, QATExperts))
    assert all(p.grad is None for n, p in experts.named_parameters() if ".lora." not in n and "lora" not in n)
