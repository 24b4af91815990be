"""Run the Triton kernels on CPU through the interpreter (set before they are compiled:
``triton.jit`` reads TRITON_INTERPRET when quarl's kernel module is first imported)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from quarl.quant.kernels import triton_available  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: needs triton (interpreter on CPU)")


@pytest.fixture
def needs_triton():
    # triton is in the test extras: its absence is a broken install, never a reason to skip
    if not triton_available():
        pytest.fail("triton is not installed: pip install -e '.[test]'")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.fail("Triton kernels on CPU need TRITON_INTERPRET=1 (set by this conftest before triton loads)")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["reference", "triton"])
def backend(request):
    """Run a test once on the reference and once on the Triton kernels (interpreted on CPU)."""
    if request.param == "triton":
        request.getfixturevalue("needs_triton")
    return request.param
