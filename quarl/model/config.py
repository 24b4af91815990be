"""Architecture description read from a Hugging Face ``config.json``.

One dataclass covers the decoder-only families quarl trains: Llama (2/3/3.x, with
Llama-3 rope scaling), Qwen2 / Qwen2.5 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).
Both spellings of rotary settings are read: the classic ``rope_theta`` +
``rope_scaling`` keys of released checkpoints, and ``rope_parameters`` written by
transformers >= 5.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ModelConfigError(ValueError):
    """A checkpoint's config.json cannot be used by quarl's transformer."""


@dataclass(frozen=True)
class TransformerConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    attention_bias: bool = False  # q/k/v bias (Qwen2 always, Llama optional)
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of q and k before rope
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def matmul_params(self) -> int:
        """Weights of the decoder's matrix products plus the LM head: a forward costs 2 FLOPs
        per such weight per token (attention's score products not counted)."""
        per_layer = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        per_layer += 3 * self.hidden_size * self.intermediate_size
        return self.num_hidden_layers * per_layer + self.vocab_size * self.hidden_size

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        h, i, v, n = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        return n * per_layer + v * h * (1 if self.tie_word_embeddings else 2) + h

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dictionary that transformers reads back into the same model."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        d: dict[str, Any] = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type == "llama":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = self.mlp_bias
        if self.model_type == "qwen3":
            d["attention_bias"] = self.attention_bias
        return d

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "TransformerConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"{source}: unsupported model_type {model_type!r}; quarl supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-3, Qwen2/2.5, Qwen3)"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in raw:
                raise ModelConfigError(f"{source}: missing required key {key!r}")
        if raw.get("use_sliding_window"):
            raise ModelConfigError(f"{source}: use_sliding_window=true is not supported; set it to false")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        n_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // n_heads
        n_kv = raw.get("num_key_value_heads") or n_heads
        if n_heads % n_kv:
            raise ModelConfigError(f"{source}: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
        rope_theta, rope_scaling = _read_rope(raw, source)
        if model_type == "qwen2":
            attention_bias = True
        else:
            attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            attention_bias=attention_bias,
            o_bias=bool(raw.get("attention_bias", False)) if model_type != "qwen2" else False,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            hidden_act=act,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "TransformerConfig":
        path = Path(path)
        cfg_file = path / "config.json"
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist: point the model path at a local "
                                    "Hugging Face model directory (config.json + *.safetensors)")
        if not cfg_file.is_file():
            raise FileNotFoundError(
                f"{str(path)!r} has no config.json: point the model path at a Hugging Face checkpoint "
                "directory (config.json + *.safetensors)"
            )
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{cfg_file}: not valid JSON ({e})") from e
        return cls.from_hf_dict(raw, source=str(cfg_file))

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra", None)
        return d


def _read_rope(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = dict(raw["rope_scaling"]) if raw.get("rope_scaling") else None
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelConfigError(
                f"{source}: rope type {rope_type!r} is not supported; use one of {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        scaling["rope_type"] = rope_type
        scaling.pop("type", None)
        if rope_type == "default":
            scaling = None
    return theta, scaling
