"""Export trained policies: plain HF checkpoints (BF16/FP32), quarl-packed and compressed-tensors low-bit ones."""

from quarl.export.hf import find_checkpoint, read_policy
from quarl.export.packed import load_packed
from quarl.export.run import FORMATS, ExportResult, export_checkpoint

__all__ = ["FORMATS", "ExportResult", "export_checkpoint", "find_checkpoint", "load_packed", "read_policy"]
