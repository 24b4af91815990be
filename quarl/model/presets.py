"""Built-in model shapes: the demo's small models and the benchmark shapes of real ones.

The demo shapes use the built-in character tokenizer's vocabulary (128). The named
shapes of released models (``qwen2.5-1.5b`` ...) are for benchmarks on random weights;
they never download anything. ``moe-tiny`` and ``moe-100m`` are Qwen3-MoE shapes on the
built-in tokenizer (CPU tests; experiment suites), ``qwen3-30b-a3b`` the released MoE's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from quarl.distributed import rank_cores
from quarl.model.config import TransformerConfig
from quarl.model.transformer import Transformer

_DEMO = dict(model_type="qwen3", vocab_size=128, qk_norm=True, rope_theta=10000.0, max_position_embeddings=2048)
_DEMO_MOE = dict(_DEMO, model_type="qwen3_moe", norm_topk_prob=True)

# the built-in tokenizer's models; the rest are released shapes
DEMO_PRESETS = ("tiny", "small", "100m", "moe-tiny", "moe-100m")

PRESETS: dict[str, dict] = {
    # ~0.1M parameters: CPU tests.
    "tiny": dict(_DEMO, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    # ~0.8M parameters: the default CPU demo run.
    "small": dict(_DEMO, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    # ~100M parameters: the GPU demo run.
    "100m": dict(_DEMO, hidden_size=768, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=12,
                 num_key_value_heads=4, head_dim=64, tie_word_embeddings=True),
    # ~0.2M parameters: CPU tests of MoE. Layer 1 keeps a dense MLP; 8 experts, 2 per token.
    "moe-tiny": dict(_DEMO_MOE, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, mlp_only_layers=(1,)),
    # ~100M parameters (~22M of them run per token): MoE experiment suites. 32 experts, 4 per token,
    # expert width 128 (one group of the 128-wide int4 schemes).
    "moe-100m": dict(_DEMO_MOE, hidden_size=512, intermediate_size=1536, num_hidden_layers=14,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32,
                     num_experts_per_tok=4, moe_intermediate_size=128, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                         attention_bias=True, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                         max_position_embeddings=32768),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                       attention_bias=True, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
                       max_position_embeddings=32768),
    "qwen2.5-14b": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=13824,
                        num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                        attention_bias=True, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
                        max_position_embeddings=32768),
    "qwen2.5-32b": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                        attention_bias=True, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
                        max_position_embeddings=32768),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     qk_norm=True, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
                     max_position_embeddings=40960),
    # Qwen3-30B-A3B: 128 experts of width 768, 8 per token, every layer sparse (~30.5B parameters, ~3.3B active)
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          qk_norm=True, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
                          max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, router_aux_loss_coef=0.001),
}


def preset_config(name: str) -> TransformerConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return TransformerConfig(**PRESETS[name])


def build_random_model(
    name_or_cfg: str | TransformerConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    std: float = 0.02,
) -> Transformer:
    """A randomly initialised model (normal(0, std) weights, unit norms, zero biases).

    The numbers come from CPU generators, one per parameter, so a seed gives the same
    weights on any device (a LoRA run's export rebuilds its random base on the CPU). The
    parameters are made in ``dtype`` from the start: a 14B model in bf16 never exists in
    float32 on the device (the values are those of float32 weights rounded once)."""
    model = blank_model(name_or_cfg, dtype, device)
    params = list(model.named_parameters())
    with torch.no_grad():
        for name, p in params:
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
        drawn = [(i, p) for i, (name, p) in enumerate(params) if not name.endswith(("norm.weight", "bias"))]
        # one CPU generator per tensor (seeded by the seed and the tensor's place), drawn by a
        # few threads at once: one generator is serial, ~100 s for a 14B model's numbers
        # (each rounded to its parameter's dtype by its worker: half the bytes to a GPU for bf16)
        def draw(item: tuple[int, torch.Tensor]) -> torch.Tensor:
            return _normal(item[1].shape, seed, item[0], std).to(item[1].dtype)

        # (threads of their own, whatever OMP_NUM_THREADS says: the rank's share of the node's cores)
        workers = min(16, rank_cores())
        with ThreadPoolExecutor(workers) as pool:
            for lo in range(0, len(drawn), workers):  # (a window at a time: float32 copies of a few)
                window = drawn[lo : lo + workers]
                for (_, p), values in zip(window, pool.map(draw, window)):
                    p.copy_(values)
    return model.to(dtype=dtype)


def blank_model(name_or_cfg: str | TransformerConfig, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Transformer:
    """A model of the preset's (or config's) shape made in ``dtype`` on ``device`` with torch's
    default initialisation: for weights about to be overwritten (a checkpoint's)."""
    cfg = preset_config(name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else before)
    try:
        with torch.device(device):
            return Transformer(cfg)
    finally:
        torch.set_default_dtype(before)


def _normal(shape: torch.Size, seed: int, index: int, std: float) -> torch.Tensor:
    """normal(0, std) float32 values of the ``index``-th parameter of a seed's random model."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + index)
    return torch.randn(shape, generator=gen).mul_(std)
