"""Tiny random Hugging Face models of each supported family, with odd shapes."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_FAMILIES = ("llama", "qwen2", "qwen3")


def hf_config(family: str, vocab_size: int = 96):
    import transformers as tf

    if family == "llama":
        # GQA ratio 3, head_dim != hidden/heads, llama3 rope scaling, untied.
        return tf.LlamaConfig(
            vocab_size=vocab_size, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5,
            max_position_embeddings=512, tie_word_embeddings=False, attention_bias=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
    if family == "qwen2":
        # q/k/v bias, tied embeddings, GQA 2.
        return tf.Qwen2Config(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000.0,
            max_position_embeddings=512, tie_word_embeddings=True, use_sliding_window=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
    if family == "qwen3":
        # per-head q/k norm, head_dim 32 with hidden 64 / 4 heads (= 16), untied, GQA 4.
        return tf.Qwen3Config(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
            rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False,
            use_sliding_window=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
    raise ValueError(family)


def make_hf_checkpoint(family: str, path: str | Path, seed: int = 0, vocab_size: int = 96):
    """Build a random HF model, perturb every parameter (norm weights, biases too), save it."""
    import transformers as tf

    torch.manual_seed(seed)
    cls = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM}[family]
    model = cls(hf_config(family, vocab_size)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return model


def moe_hf_config(vocab_size: int = 128, **overrides):
    """A tiny random ``Qwen3MoeConfig``: 4 layers, layer 1 dense (``mlp_only_layers``), 8
    experts of width 32, 2 per token, renormalised top-k; ``overrides`` change any field."""
    import transformers as tf

    fields = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=512, tie_word_embeddings=False, use_sliding_window=False,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1], bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    fields.update(overrides)
    return tf.Qwen3MoeConfig(**fields)


def make_moe_checkpoint(path: str | Path, config=None, seed: int = 0, per_expert: bool = True):
    """A random ``Qwen3MoeForCausalLM`` of ``config`` (default :func:`moe_hf_config`) in float32
    eval mode, every parameter perturbed as :func:`make_hf_checkpoint` does, saved to ``path``
    with one tensor per expert (``per_expert``, transformers' default) or the experts stacked
    as transformers >= 5 holds them."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.Qwen3MoeForCausalLM(config if config is not None else moe_hf_config()).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(str(path), save_original_format=per_expert)
    return model
