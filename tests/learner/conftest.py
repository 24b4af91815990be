"""Triton kernels run under the interpreter on machines without a GPU.

The variable must be set before any ``@triton.jit`` function is defined, i.e. before
``quarl.learner.kernels`` is imported (the log-probs import it lazily).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
