"""quarl.trainer.stages: the stage clock's open-stage record (what a benchmark's GPU clock
readings are tagged with)."""

from __future__ import annotations

import pytest
import torch

from quarl.trainer.stages import StageClock, current_stage


def test_current_stage_is_the_innermost_open_one_and_closes_on_errors():
    clock = StageClock(torch.device("cpu"))
    assert current_stage() is None
    with clock.stage("step"):
        assert current_stage() == "step"
        with clock.stage("learner"):
            assert current_stage() == "learner"
        assert current_stage() == "step"
        with pytest.raises(ZeroDivisionError), clock.stage("publish"):
            assert current_stage() == "publish"
            1 / 0
        assert current_stage() == "step"
    assert current_stage() is None
    assert set(clock.metrics()) == {"time/step", "time/learner", "time/publish"}
    assert clock.out_of_memory is None  # (only an out-of-memory error names its stage)
