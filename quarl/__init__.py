"""quarl: reinforcement learning for LLMs with low-precision rollouts.

The learner runs the same low-bit kernels as the rollout engine (QaRL), uses
objectives made for that regime (TBPO, ACR, TIS, ...) and reports the
sampler/learner mismatch at every step. See docs/design.md for the architecture.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["load_model", "__version__"]


def load_model(path, dtype=None, device="cpu"):
    """Load a local Hugging Face checkpoint directory into quarl's transformer.

    ``path`` holds ``config.json`` and ``model.safetensors`` (or a sharded set with
    ``model.safetensors.index.json``). Returns a :class:`quarl.model.Transformer`
    whose ``model(input_ids)`` gives logits ``[B, T, V]``.
    """
    from quarl.model.loading import load_model as _load

    return _load(path, dtype=dtype, device=device)
