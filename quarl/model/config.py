"""Architecture description read from a Hugging Face ``config.json``.

One dataclass covers the decoder-only families quarl trains: Llama (2/3/3.x, with
Llama-3 rope scaling), Qwen2 / Qwen2.5 (q/k/v bias), Qwen3 (per-head q/k RMSNorm) and
Qwen3-MoE (Qwen3's attention with sparse mixture-of-experts MLPs: ``num_experts`` routed
experts of width ``moe_intermediate_size``, ``num_experts_per_tok`` per token, no shared
expert; the layers of ``mlp_only_layers``, and those ``decoder_sparse_step`` skips, keep a
dense MLP of width ``intermediate_size``).
Both spellings of rotary settings are read: the classic ``rope_theta`` +
``rope_scaling`` keys of released checkpoints, and ``rope_parameters`` written by
transformers >= 5.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
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
    # Qwen3-MoE (num_experts 0: every layer dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    router_aux_loss_coef: float = 0.0  # read from config.json; quarl's losses do not add it
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        # config.json and presets give a list; a tuple keeps the frozen config hashable
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has a sparse MoE block (else a dense MLP), as transformers decides."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def _mlp_params(self, layer_idx: int, active: bool) -> int:
        """Weights of layer ``layer_idx``'s MLP: a dense one's, or an MoE block's router and
        experts (``active``: only the ``num_experts_per_tok`` experts a token runs)."""
        h = self.hidden_size
        if not self.is_moe_layer(layer_idx):
            return 3 * h * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        return h * self.num_experts + experts * 3 * h * self.moe_intermediate_size

    @property
    def matmul_params(self) -> int:
        """Weights of the decoder's matrix products plus the LM head: a forward costs 2 FLOPs
        per such weight per token (attention's score products not counted). An MoE layer
        counts its router and the experts one token runs (``num_experts_per_tok``)."""
        per_layer = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlps = sum(self._mlp_params(i, active=True) for i in range(self.num_hidden_layers))
        return self.num_hidden_layers * per_layer + mlps + self.vocab_size * self.hidden_size

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        h, v, n = self.hidden_size, self.vocab_size, self.num_hidden_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h
        mlps = sum(self._mlp_params(i, active=False) for i in range(n))
        return n * per_layer + mlps + v * h * (1 if self.tie_word_embeddings else 2) + h

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dictionary that transformers reads back into the same model."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}
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
        if self.model_type in ("qwen3", "qwen3_moe"):
            d["attention_bias"] = self.attention_bias
        if self.model_type == "qwen3_moe":
            # "num_experts", as released checkpoints spell it (transformers 5 maps it to num_local_experts)
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                     decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                     router_aux_loss_coef=self.router_aux_loss_coef)
        return d

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "TransformerConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"{source}: unsupported model_type {model_type!r}; quarl supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-3, Qwen2/2.5, Qwen3)"
            )
        if model_type == "qwen3_moe":
            # transformers' default width of the dense MLPs, which a config without any needs not name
            raw = {"intermediate_size": 6144, **raw}
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
            raise ModelConfigError(f"{source}: num_attention_heads={n_heads} is not a multiple of "
                                   f"num_key_value_heads={n_kv}")
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
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            hidden_act=act,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            **(_read_moe(raw, source) if model_type == "qwen3_moe" else {}),
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


def _read_moe(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The MoE fields of a ``qwen3_moe`` config.json, checked. The expert count is
    ``num_experts`` in released checkpoints and ``num_local_experts`` in those transformers 5
    writes."""
    n_experts = raw.get("num_experts", raw.get("num_local_experts"))
    for key, value in (("num_experts", n_experts), ("num_experts_per_tok", raw.get("num_experts_per_tok")),
                       ("moe_intermediate_size", raw.get("moe_intermediate_size"))):
        if not isinstance(value, int) or value < 1:
            raise ModelConfigError(f"{source}: qwen3_moe needs a positive integer {key}, got {value!r}")
    top_k = raw["num_experts_per_tok"]
    if top_k > n_experts:
        raise ModelConfigError(f"{source}: num_experts_per_tok={top_k} exceeds num_experts={n_experts}")
    if raw.get("shared_expert_intermediate_size"):
        raise ModelConfigError(f"{source}: shared experts (shared_expert_intermediate_size) are not part of "
                               "qwen3_moe; quarl's MoE block routes to the num_experts experts only")
    variant = _router_variant(raw)
    if variant:
        raise ModelConfigError(f"{source}: {variant}; quarl's qwen3_moe router is a softmax over mlp.gate.weight "
                               "and the top num_experts_per_tok experts: this is another MoE family's router, "
                               "declared as qwen3_moe (fix model_type, or remove the key if it has no effect)")
    step = raw.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ModelConfigError(f"{source}: decoder_sparse_step must be a positive integer, got {step!r}")
    dense = tuple(raw.get("mlp_only_layers") or ())
    outside = [i for i in dense if not 0 <= i < raw["num_hidden_layers"]]
    if outside:
        raise ModelConfigError(f"{source}: mlp_only_layers {outside} are not layers of a "
                               f"{raw['num_hidden_layers']}-layer model")
    return dict(num_experts=n_experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["moe_intermediate_size"],
                # transformers' default when the key is absent (Qwen3-30B-A3B's config.json sets true)
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)), decoder_sparse_step=step,
                mlp_only_layers=dense, router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.0)))


def _router_variant(raw: dict[str, Any]) -> str | None:
    """What in a qwen3_moe config.json asks for a router Qwen3-MoE does not have (sigmoid
    scores, grouped top-k, a scaled or biased routing), or None."""
    scoring = raw.get("scoring_func", "softmax")
    if scoring != "softmax":
        return f"scoring_func={scoring!r} (Qwen3-MoE scores experts with a softmax)"
    for key in ("n_group", "topk_group"):
        if raw.get(key) not in (None, 1):
            return f"{key}={raw[key]!r} (grouped top-k routing)"
    if raw.get("routed_scaling_factor") not in (None, 1, 1.0):
        return f"routed_scaling_factor={raw['routed_scaling_factor']!r} (scaled routing weights)"
    if raw.get("n_shared_experts"):
        return f"n_shared_experts={raw['n_shared_experts']!r} (shared experts)"
    if raw.get("topk_method") not in (None, "greedy"):
        return f"topk_method={raw['topk_method']!r}"
    return None


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
