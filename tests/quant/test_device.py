"""Launch options from :mod:`quarl.quant.kernels.device`: programmatic dependent launches only
inside ``dependent_launches`` and only on a GPU of compute capability 9 or more."""

import torch

from quarl.quant.kernels import device
from quarl.quant.kernels.device import dependent_launches, pdl

ON = {"PDL": True, "launch_pdl": True}
OFF = {"PDL": False}  # passed explicitly (see device.pdl)


def test_dependent_launches_only_inside_the_block_and_only_on_hopper_or_later(monkeypatch):
    gpu = torch.device("cuda", 0)
    caps = {"cap": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: caps["cap"])
    gdc = device._has_grid_dependency_control  # asked once per device: forget between "devices"
    gdc.cache_clear()
    assert pdl(gpu) == OFF
    with dependent_launches():
        assert pdl(gpu) == ON
        assert pdl(torch.device("cpu")) == OFF  # the interpreter has no grid dependency control
        with dependent_launches(False):
            assert pdl(gpu) == OFF
        assert pdl(gpu) == ON  # the outer setting comes back
        caps["cap"] = (8, 9)
        gdc.cache_clear()
        assert pdl(gpu) == OFF
        caps["cap"] = (10, 0)
        gdc.cache_clear()
        assert pdl(gpu) == ON
    assert pdl(gpu) == OFF
    gdc.cache_clear()


def test_dependent_launches_are_off_again_after_an_exception():
    try:
        with dependent_launches():
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert device._DEPENDENT is False
