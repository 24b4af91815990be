"""LoRA runs end to end: the shared frozen base, adapter-only publish, resume, exports."""

from __future__ import annotations

import json

import pytest
import torch

from quarl.config import load_run_config
from quarl.learner.logprobs import sequence_logprobs
from quarl.model.lora import lora_modules
from quarl.quant import QuantLinear
from quarl.rollout import EngineConfig, SamplingParams
from quarl.trainer import checkpoint as ckpt
from quarl.trainer.weights import LoRASettings, build_engine_and_publisher
from tests.model.test_lora import _randomize_adapters, _tiny
from tests.trainer.test_train_e2e import _train

LORA = ["--model.lora_rank=4", "--model.lora_alpha=8", "--trainer.sft_warmup_steps=0"]


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8-fp8"])
def test_engine_and_learner_share_the_base_and_publish_moves_only_adapters(scheme):
    cfg = load_run_config(None, [f"--quant.scheme={scheme}"])
    model = _tiny(seed=1)
    engine, pub = build_engine_and_publisher(model, cfg.quant, EngineConfig(num_kv_blocks=64, max_model_len=128),
                                             LoRASettings(4, 8.0, ("q_proj", "v_proj", "down_proj")))
    learner_q = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    engine_q = {n: m for n, m in engine.model.named_modules() if isinstance(m, QuantLinear)}
    assert learner_q.keys() == engine_q.keys() and learner_q
    for n, m in learner_q.items():  # one copy of the packed base: the learner reads the engine's buffers
        assert m.qdata.data_ptr() == engine_q[n].qdata.data_ptr() and m.learner_path and not engine_q[n].learner_path
    assert model.embed_tokens.weight.data_ptr() == engine.model.embed_tokens.weight.data_ptr()

    _randomize_adapters(model, seed=3, scale=0.3)
    base_before = {n: m.qdata.clone() for n, m in engine_q.items()}
    loaded = []
    real_load = engine.load_weights
    engine.load_weights = lambda published: (loaded.append(dict(published)), real_load(published))[1]
    metrics = pub.publish()
    (published,) = loaded
    adapter_bytes = sum(ad.A.numel() * ad.A.element_size() + ad.B.numel() * ad.B.element_size()
                        for _, _, ad in lora_modules(model))
    assert set(published) == {f"{n}.lora.{p}" for n, _, _ in lora_modules(model) for p in "AB"}
    assert metrics["publish/bytes"] == adapter_bytes
    assert all(torch.equal(base_before[n], m.qdata) for n, m in engine_q.items())
    for n, _, ad in lora_modules(engine.model):
        theirs = model.get_submodule(n).lora.A
        assert torch.equal(ad.A, theirs) and ad.A.data_ptr() != theirs.data_ptr()

    # the engine samples with the adapters: its log-probs are the learner's (aligned by construction)
    comps = engine.generate([[3, 5, 7, 9]], [SamplingParams(n=4, max_new_tokens=10, seed=5)])
    for c in comps:
        ids = torch.tensor([[3, 5, 7, 9, *c.token_ids]])
        with torch.no_grad():
            logp = sequence_logprobs(model, ids, torch.ones_like(ids))[0][0, 3:]
        torch.testing.assert_close(logp, torch.tensor(c.logprobs, dtype=logp.dtype), rtol=0, atol=2e-5)


def test_lora_run_resumes_exactly_and_checkpoints_hold_only_adapters(tmp_path):
    _, straight = _train(tmp_path / "a", *LORA, "--trainer.save_every=2", steps=4)
    _train(tmp_path / "b", *LORA, "--trainer.save_every=2", steps=2)
    _, resumed = _train(tmp_path / "b", *LORA, "--trainer.save_every=2", steps=4, resume=True)
    volatile = ("time/", "wall", "rollout/tokens_per_s", "memory/", "perf/")
    strip = [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in straight]
    assert strip == [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in resumed]
    assert straight[-1]["mismatch/kl_k3"] < 1e-9  # w4a16 base: engine and learner run the same math
    wa = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "a"))["learner"]["model"]
    wb = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "b"))["learner"]["model"]
    assert set(wa) == set(wb) and all(k.endswith((".lora.A", ".lora.B")) for k in wa)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(wa[k].abs().sum() > 0 for k in wa if k.endswith(".lora.B"))  # the adapters trained


def test_lora_exports_merged_and_peft(tmp_path):
    """A LoRA run on a local HF checkpoint exports (a) merged weights that transformers loads
    with the run's policy logits, (b) PEFT adapter files that PEFT loads onto the base with
    the same logits (bf16 base: exact up to float32 sums)."""
    import transformers as tf
    from peft import PeftModel

    from quarl.export.hf import find_checkpoint, read_policy
    from quarl.export.lora import lora_policy
    from quarl.export.run import export_checkpoint
    from tests.hf_models import make_hf_checkpoint

    make_hf_checkpoint("qwen2", tmp_path / "base", seed=2, vocab_size=128)
    base_args = [f"--model.path={tmp_path / 'base'}", "--model.tokenizer=builtin", "--trainer.save_every=2",
                 "--optim.lr=3e-2"]
    ids = torch.randint(3, 60, (2, 12))
    for mode in ("bf16", "aligned"):
        run = tmp_path / f"run_{mode}"
        trainer, _ = _train(run, *LORA, *base_args, f"--quant.mode={mode}",
                            f"--model.packed_cache={tmp_path / 'packed'}",
                            steps=2)
        if mode == "aligned":  # the base was quantized while loading, and its packed copy cached for the next run
            assert any(isinstance(m, QuantLinear) for m in trainer.learner.model.modules())
            assert len(list((tmp_path / "packed").iterdir())) == 1
            _train(tmp_path / "again", *LORA, *base_args, "--quant.mode=aligned",
                              f"--model.packed_cache={tmp_path / 'packed'}", steps=1)
        policy = lora_policy(read_policy(find_checkpoint(run)))
        with torch.no_grad():
            ours = policy(ids)
        export_checkpoint(run, tmp_path / f"merged_{mode}", "hf-fp32")
        merged = tf.AutoModelForCausalLM.from_pretrained(tmp_path / f"merged_{mode}", torch_dtype=torch.float32)
        with torch.no_grad():
            theirs = merged(ids).logits
        assert (ours - theirs).abs().max() / theirs.abs().max() < 1e-5
        export_checkpoint(run, tmp_path / f"peft_{mode}", "peft")
        cfg = json.loads((tmp_path / f"peft_{mode}" / "adapter_config.json").read_text())
        assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["base_model_name_or_path"] == str(tmp_path / "base")
        if mode == "bf16":
            hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32)
            peft_model = PeftModel.from_pretrained(hf, tmp_path / "peft_bf16").eval()
            with torch.no_grad():
                theirs = peft_model(ids).logits
                with peft_model.disable_adapter():
                    plain = peft_model(ids).logits
            assert (ours - theirs).abs().max() / theirs.abs().max() < 1e-5
            assert (ours - plain).abs().max() > 1e-4  # the trained adapters change the logits
    with pytest.raises(ValueError, match="LoRA run"):
        export_checkpoint(tmp_path / "run_aligned", tmp_path / "packed_export", "quarl-packed")


def test_lora_config_errors():
    from quarl.config.typed import ConfigError

    with pytest.raises(ConfigError, match="quant.mode=rollout"):
        load_run_config(None, ["--model.lora_rank=8", "--quant.mode=rollout"])
    with pytest.raises(ConfigError, match="lora_targets.*'qproj' \\(did you mean 'q_proj'\\?\\)"):
        load_run_config(None, ["--model.lora_rank=8", "--model.lora_targets=[qproj]"])
    # a YAML flow list on the command line is the list it reads as in a config file
    cfg = load_run_config(None, ["--model.lora_rank=8", "--model.lora_targets=[q_proj, 'v_proj']"])
    assert cfg.model.lora_targets == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match="algo.advantage=gae"):
        load_run_config(None, ["--model.lora_rank=8", "--algo.advantage=gae"])


def test_peft_export_of_a_uaq_run_fits_the_plain_base(tmp_path):
    """With UAQ the adapters of q/k/v and gate/up saw inputs scaled by s; the PEFT export folds
    s into their A, so PEFT on the plain base checkpoint gives the run's policy."""
    import transformers as tf
    from peft import PeftModel

    from quarl.export.hf import find_checkpoint, read_policy
    from quarl.export.lora import lora_policy
    from quarl.export.run import export_checkpoint
    from tests.hf_models import make_hf_checkpoint

    make_hf_checkpoint("llama", tmp_path / "base", seed=6, vocab_size=128)
    _train(tmp_path / "run", *LORA, f"--model.path={tmp_path / 'base'}", "--model.tokenizer=builtin",
           "--trainer.save_every=2", "--optim.lr=3e-2", "--quant.mode=bf16", "--quant.uaq_scale=1.5", steps=2)
    ids = torch.randint(3, 60, (2, 12))
    with torch.no_grad():
        ours = lora_policy(read_policy(find_checkpoint(tmp_path / "run")))(ids)
    export_checkpoint(tmp_path / "run", tmp_path / "peft", "peft")
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32)
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(hf, tmp_path / "peft").eval()(ids).logits
    assert (ours - theirs).abs().max() / theirs.abs().max() < 1e-5


def test_eval_of_a_lora_run_in_another_scheme_uses_the_trained_adapters(tmp_path):
    """``quarl eval RUN_DIR --scheme S`` on a LoRA run: the base is packed in S (a LoRA base is
    always frozen in the engine's scheme, so the mode is aligned, not rollout) and the engine
    samples with the checkpoint's adapters."""
    import argparse

    from quarl.cli.eval import _load_config
    from quarl.trainer.loop import Trainer

    _train(tmp_path / "r", *LORA, "--trainer.save_every=2", steps=2)
    args = argparse.Namespace(run_dir=str(tmp_path / "r"), config=None, model=None, reward=None,
                              reward_timeout=None, max_new_tokens=None, overrides=[])
    cfg = _load_config(args, "w8a8-int8", [])
    assert cfg.quant.mode.value == "aligned" and cfg.quant.scheme.name == "w8a8-int8"
    trainer = Trainer(cfg, resume=True, evaluation_only=True)
    try:
        saved = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "r"))["learner"]["model"]
        adapted = lora_modules(trainer.engine.model)
        assert adapted and {f"{n}.lora.{p}" for n, _, _ in adapted for p in "AB"} == set(saved)
        for n, _, ad in adapted:
            assert torch.equal(ad.A, saved[f"{n}.lora.A"]) and torch.equal(ad.B, saved[f"{n}.lora.B"])
        bases = [m for m in trainer.engine.model.modules() if isinstance(m, QuantLinear)]
        assert bases and all(m.qweight.scheme.name == "w8a8-int8" for m in bases)
    finally:
        trainer.rewards.close()


@pytest.mark.parametrize("fast_path", [True, False])
def test_frozen_base_kept_dense_gives_the_same_values_and_goes_at_release(fast_path, monkeypatch):
    """``keep_frozen_bases_dense``: each base weight is dequantized once for all micro-batches
    (forward on the GPU's weight-only path, backward on every path) instead of at every GEMM,
    with the same log-probs and gradients bit for bit; the learner's release drops the copies."""
    import quarl.learner.memory as memory
    import quarl.quant.linear as qlinear
    from quarl.learner.learner import Learner
    from quarl.quant import ops

    if fast_path:  # the GPU's path: F.linear over the dequantized weight
        monkeypatch.setattr(qlinear, "learner_runs_dequantized", lambda x, qw: qw.scheme.act_format == "none")
    calls = []
    real = ops.dequantize
    monkeypatch.setattr(ops, "dequantize", lambda qw, dtype: (calls.append(qw.qdata.data_ptr()), real(qw, dtype))[1])
    cfg = load_run_config(None, ["--quant.scheme=w4a16"])
    model = _tiny(seed=2)
    build_engine_and_publisher(model, cfg.quant, EngineConfig(num_kv_blocks=64, max_model_len=128),
                               LoRASettings(4, 8.0, ("q_proj", "v_proj", "down_proj")))
    _randomize_adapters(model, seed=5, scale=0.3)
    bases = memory.frozen_bases(model)
    assert len(bases) == 7 * len(model.layers) and memory.dense_bytes(bases, torch.float32) == 4 * sum(
        m.out_features * m.in_features for m in bases)
    ids = [torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(s)) for s in (0, 1)]

    def grads_over_micro_batches():
        model.zero_grad(set_to_none=True)
        out = []
        for x in ids:  # two micro-batches, one update
            logp = sequence_logprobs(model, x, torch.ones_like(x))[0]
            (logp * torch.linspace(-1, 1, logp.shape[1])).sum().backward()
            out.append(logp.detach())
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    calls.clear()
    per_gemm = grads_over_micro_batches()
    n_per_gemm = len(calls)
    memory.keep_frozen_bases_dense(model)
    calls.clear()
    kept = grads_over_micro_batches()
    # once per base for the whole update (off the fast path only the backward dequantizes, and
    # not for the first layer's q/k/v, whose input needs no gradient)
    assert len(set(calls)) == len(calls) < n_per_gemm and len(calls) == (len(bases) if fast_path else len(bases) - 3)
    assert all(torch.equal(a, b) for a, b in zip(per_gemm[0], kept[0]))
    assert per_gemm[1].keys() == kept[1].keys() and all(torch.equal(per_gemm[1][k], kept[1][k]) for k in kept[1])
    assert sum(bool(m.repacked._entries) for m in bases) == len(calls)
    Learner(model, lr=0.0).release_caches()
    assert not any(m.repacked._entries for m in bases)


@pytest.mark.parametrize("keep_kv,kv_counted,peak_gb,fits", [
    (True, False, 40.0, True),     # 40 + 8 (KV, not in the peak) + base <= 90% of 80
    (True, False, 60.0, False),    # 60 + 8 + base > 72
    (True, True, 60.0, True),      # the KV cache was in the peak already: 60 + base <= 72
    (False, False, 63.0, True),    # the KV cache is released through updates: it does not count
])
def test_the_trainer_keeps_the_lora_base_dense_only_where_it_fits(keep_kv, kv_counted, peak_gb, fits, monkeypatch):
    """The first update's peak, plus the KV cache if it stays and was not in that peak, plus
    the base's bf16 size must stay within 90% of the GPU; the bases are switched accordingly."""
    import types

    import quarl.learner.memory as memory
    from quarl.trainer.memory_policy import dense_base_fits

    cfg = load_run_config(None, ["--quant.scheme=w4a16"])
    model = _tiny(seed=2).to(torch.bfloat16)
    build_engine_and_publisher(model, cfg.quant, EngineConfig(num_kv_blocks=64, max_model_len=128),
                               LoRASettings(4, 8.0, ("q_proj",)))
    bases = memory.frozen_bases(model)
    dense = memory.dense_bytes(bases, torch.bfloat16)
    gib = 2**30
    scale = 8 * gib / dense  # pretend the base is 8 GiB: the GPU's numbers scaled to it
    total = 80 * gib / scale
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=total))
    said = []
    assert dense_base_fits(model, "cuda", 8 * gib / scale, peak_gb / scale, kv_counted, keep_kv, said.append) is fits
    assert all(m.repacked.keep_dequantized is fits for m in bases)
    assert ("kept dense" if fits else "dequantized per GEMM") in said[0]
