"""Shared fixtures: tiny random HF checkpoints built with transformers, saved locally."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton kernels run on CPU through the interpreter; triton.jit reads this when a kernel
# module is first imported, and any test folder may import one first (tests/bench does).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.hf_models import TINY_FAMILIES, make_hf_checkpoint  # noqa: E402


@pytest.fixture(scope="session", params=TINY_FAMILIES)
def hf_checkpoint(request, tmp_path_factory):
    """(family name, checkpoint dir, HF model in float32 eval mode) for each tiny family."""
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(request.param, path)
    return request.param, path, hf


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
