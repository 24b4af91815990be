import pytest

from quarl.quant import SCHEMES, QuantScheme, get_scheme

NAMES = ["bf16", "w8a8-int8", "w8a8-fp8", "w4a16", "w4a16-asym", "w4a8-int8", "nvfp4", "mxfp4", "w2a16"]


def test_all_design_names_exist():
    assert list(SCHEMES) == NAMES
    for n in NAMES:
        assert get_scheme(n).name == n


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError) as e:
        get_scheme("w3a7")
    for n in NAMES:
        assert n in str(e.value)


def test_frozen_and_table():
    s = get_scheme("w4a16")
    with pytest.raises(Exception):
        s.group_size = 64  # type: ignore[misc]
    assert (s.weight_bits, s.group_size, s.symmetric, s.act_format) == (4, 128, True, "none")
    assert get_scheme("w4a16-asym").symmetric is False
    assert get_scheme("w8a8-int8").act_format == "int8" and get_scheme("w8a8-int8").group_size is None
    assert get_scheme("w8a8-fp8").act_format == "fp8"
    assert get_scheme("w4a8-int8").act_format == "int8" and get_scheme("w4a8-int8").group_size == 128
    assert (get_scheme("nvfp4").group_size, get_scheme("nvfp4").scale_format) == (16, "e4m3")
    assert (get_scheme("mxfp4").group_size, get_scheme("mxfp4").scale_format) == (32, "e8m0")
    assert (get_scheme("w2a16").weight_bits, get_scheme("w2a16").group_size) == (2, 64)
    assert get_scheme(s) is s


def test_invalid_scheme_rejected():
    with pytest.raises(ValueError):
        QuantScheme("bad", "int", 4, group_size=96)
    with pytest.raises(ValueError):
        QuantScheme("bad", "int", 4)
