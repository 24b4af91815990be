"""quarl's decoder-only transformer and HF checkpoint I/O (also straight into packed low-bit linears)."""

from quarl.model.config import SUPPORTED_MODEL_TYPES, ModelConfigError, TransformerConfig
from quarl.model.loading import CheckpointError, load_model, save_model
from quarl.model.transformer import Transformer, batch_attention

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CheckpointError",
    "ModelConfigError",
    "Transformer",
    "TransformerConfig",
    "batch_attention",
    "load_model",
    "load_quantized_model",
    "save_model",
]


def __getattr__(name: str):
    # imported on first use: quantized_loading needs quarl.quant, whose linears import quarl.model.lora
    if name == "load_quantized_model":
        from quarl.model.quantized_loading import load_quantized_model

        return load_quantized_model
    raise AttributeError(f"module 'quarl.model' has no attribute {name!r}")
