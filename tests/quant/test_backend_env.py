"""The quantized-GEMM backend comes from QUARL_QUANT_BACKEND when first asked, not at import."""

import pytest

from quarl.quant import ops


def test_the_environment_is_read_at_first_use_and_set_backend_wins(monkeypatch):
    monkeypatch.setattr(ops, "_backend", None)  # as if nothing had asked yet
    monkeypatch.setenv("QUARL_QUANT_BACKEND", "reference")
    assert ops.get_backend() == "reference"
    monkeypatch.setenv("QUARL_QUANT_BACKEND", "triton")
    assert ops.get_backend() == "reference"  # read once
    with ops.use_backend("auto"):
        assert ops.get_backend() == "auto"
    assert ops.get_backend() == "reference"


def test_an_unknown_backend_in_the_environment_is_an_error_naming_the_choices(monkeypatch):
    monkeypatch.setattr(ops, "_backend", None)
    monkeypatch.setenv("QUARL_QUANT_BACKEND", "cuda")
    with pytest.raises(ValueError, match="unknown backend 'cuda'; valid: auto, triton, reference"):
        ops.get_backend()
