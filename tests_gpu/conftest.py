"""The GPU suite runs on the GPU machine only; without CUDA it refuses to start rather than skip."""

import pytest
import torch


def pytest_sessionstart(session):
    if not torch.cuda.is_available():
        raise pytest.UsageError("tests_gpu needs a CUDA GPU: run it on the device (PYTHONPATH=. python3 -m pytest tests_gpu)")


@pytest.fixture(autouse=True)
def _seed():
    """Each test draws the same random inputs whatever subset of the suite runs."""
    torch.manual_seed(0)
