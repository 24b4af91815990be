"""quarl.bench.common.ClockWatch: GPU clocks sampled by nvidia-smi while a benchmark run lasts
(here a fake nvidia-smi on PATH that replays readings), and nothing on a machine without it."""

from __future__ import annotations

import os
import stat
import time

import pytest

from quarl.bench.common import CLOCK_FIELDS, ClockWatch
from quarl.bench.train import clock_line

# two GPUs; GPU 1 clocks down under load with the hardware-slowdown reason (0x8); GPU 0 is idle
# (reason 0x1, low power) in its first reading, whose clock must not count as a busy one
READINGS = [
    ["0, 345, 1980, 35, 70.5, 0x0000000000000001", "1, 1980, 1980, 60, 650.0, 0x0000000000000000"],
    ["0, 1980, 1980, 62, 690.0, 0x0000000000000000", "1, 1410, 1980, 88, 640.0, 0x0000000000000008"],
    ["0, 1965, 1980, 66, 700.0, 0x0000000000000000", "1, 1395, 1980, 90, 600.0, 0x0000000000000008"],
]


def _fake_nvidia_smi(tmp_path, monkeypatch, fields=CLOCK_FIELDS):
    state = tmp_path / "calls"
    state.write_text("0")
    script = tmp_path / "nvidia-smi"
    lines = "\n".join(f"    {i}) printf '%s\\n' {' '.join(repr(r) for r in rows)} ;;"
                      for i, rows in enumerate(READINGS))
    script.write_text(f"""#!/bin/sh
case "$1" in --query-gpu={','.join(fields)}) ;; *) exit 2 ;; esac
n=$(cat {state}); echo $((n + 1)) > {state}
case $((n < {len(READINGS) - 1} ? n : {len(READINGS) - 1})) in
{lines}
esac
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("reasons", ["clocks_event_reasons.active", "clocks_throttle_reasons.active"],
                         ids=["driver-535+", "older-driver"])
def test_the_watch_reports_busy_clocks_and_slowdown_reasons_per_gpu(tmp_path, monkeypatch, reasons):
    _fake_nvidia_smi(tmp_path, monkeypatch, CLOCK_FIELDS[:-1] + (reasons,))
    with ClockWatch(interval=0.05) as watch:
        deadline = time.time() + 10
        while len(watch.samples) < 2 * len(READINGS) and time.time() < deadline:
            time.sleep(0.02)
    got = watch.summary()
    assert got is not None and set(got) == {"0", "1"}
    zero, one = got["0"], got["1"]
    assert zero["sm_mhz_min"] >= 1965 and zero["reasons"] == "0x0"  # (the idle reading is left out)
    assert one["sm_mhz_min"] == 1395 and one["sm_mhz_max"] == 1980 and one["temp_c_max"] == 90
    assert one["reasons"] == "0x8"
    line = clock_line("aligned-w4a16@2gpu", {"gpu_clocks": got})
    assert "GPU 1 median" in line and "lowest 1395" in line and "0x8" in line


def test_without_nvidia_smi_the_watch_samples_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # (an empty directory: no nvidia-smi)
    with ClockWatch(interval=0.01) as watch:
        time.sleep(0.05)
    assert watch.samples == [] and watch.summary() is None
    assert clock_line("bf16", {}) == ""


def test_readings_tagged_by_stage_and_step_give_each_stages_clock_per_step():
    """Hand-made readings (two GPUs, two steps): per stage the medians over every GPU's
    readings, per step too; untagged readings (between steps) are left out."""
    from quarl.bench.train import add_stage_clocks, stage_clock_line

    watch = ClockWatch()
    rows = [("rollout", 1, 1980, 600), ("rollout", 1, 1970, 620), ("learner", 1, 1900, 690),
            ("learner", 1, 1800, 700), ("learner", 2, 1500, 700), (None, None, 345, 70)]
    watch.samples = [{"gpu": i % 2, "sm_mhz": mhz, "max_sm_mhz": 1980, "temp_c": 50, "power_w": w, "reasons": 0,
                      "label": None if st is None else (st, t)} for i, (st, t, mhz, w) in enumerate(rows)]
    got = watch.by_label()
    assert set(got) == {"rollout", "learner"}
    assert got["learner"]["sm_mhz_median"] == 1800 and got["learner"]["sm_mhz_min"] == 1500
    assert got["learner"]["samples"] == 3 and got["learner"]["power_w_median"] == 700
    assert got["learner"]["sm_mhz_by_step"] == {"1": 1850, "2": 1500}
    assert got["rollout"]["sm_mhz_by_step"] == {"1": 1975} and got["rollout"]["power_w_by_step"] == {"1": 610}
    steps = [{"step": 1, "time/learner": 2.5}, {"step": 2, "time/learner": 3.25}, {"step": 3}]
    add_stage_clocks(steps, got)
    assert steps[0] == {"step": 1, "time/learner": 2.5, "gpu/rollout_sm_mhz": 1975, "gpu/rollout_power_w": 610,
                        "gpu/learner_sm_mhz": 1850, "gpu/learner_power_w": 695}
    assert steps[1] == {"step": 2, "time/learner": 3.25, "gpu/learner_sm_mhz": 1500, "gpu/learner_power_w": 700}
    assert steps[2] == {"step": 3}  # (no reading fell in it)
    line = stage_clock_line("aligned-w8a8-fp8", {"steps": steps})
    assert line == ("aligned-w8a8-fp8 by step: rollout 1:1975MHz/610W; "
                    "learner 1:2.50s/1850MHz/695W 2:3.25s/1500MHz/700W")
    assert stage_clock_line("bf16", {"steps": [{"step": 1}]}) == ""
    steps[0]["perf/triton_builds"], steps[1]["perf/triton_builds"] = 14.0, 1.0  # (kernels built inside the steps)
    assert stage_clock_line("aligned-w8a8-fp8", {"steps": steps}).endswith("; Triton kernels built 1:14 2:1")


def test_a_benchmark_run_tags_its_clock_readings_with_the_trainer_stage(tmp_path, monkeypatch):
    """``run_mode`` on a tiny random model: each step's row carries the clock and power of the
    readings taken in its rollout and its learner stage (the trainer's
    :func:`~quarl.trainer.stages.current_stage`). The readings come from a function that
    says which stage was open when it ran (nvidia-smi is faked), and each stage is stretched
    to 30 ms so that readings fall in it on a busy machine."""
    import time

    from quarl.bench import train
    from quarl.trainer import stages
    from quarl.trainer.collect import RolloutCollector
    from quarl.trainer.loop import Trainer

    _fake_nvidia_smi(tmp_path, monkeypatch)  # (found on PATH: the watch starts)
    mhz = {"rollout": 1900.0, "learner": 1500.0}
    monkeypatch.setattr(ClockWatch, "sample", lambda self: [
        {"gpu": 0, "sm_mhz": mhz.get(stages.current_stage(), 345.0), "max_sm_mhz": 1980.0, "temp_c": 50.0,
         "power_w": 600.0 if stages.current_stage() == "learner" else 400.0, "reasons": 0}])
    for owner, name in ((RolloutCollector, "sample"), (Trainer, "update_policy")):  # (each called inside its stage)
        def stretched(self, *args, _call=getattr(owner, name), **kw):
            time.sleep(0.03)
            return _call(self, *args, **kw)
        monkeypatch.setattr(owner, name, stretched)
    monkeypatch.setattr(train, "STAGE_CLOCK_INTERVAL", 0.001)
    w = train.Workload("tiny", prompts=2, n=2, gen=6, token_budget=256, steps=2)
    model_dir = train.save_random_model(w.shape, tmp_path / "model")
    rows, _ = train.run_mode("bf16", train.workload_overrides(w, model_dir) + train.MODES["bf16"], tmp_path / "run")
    for r in rows:
        assert r["gpu/learner_sm_mhz"] == 1500 and r["gpu/learner_power_w"] == 600, r
        assert r["gpu/rollout_sm_mhz"] == 1900 and r["gpu/rollout_power_w"] == 400, r
    assert stages.current_stage() is None  # every stage closed
    assert train.median_metrics(rows)["learner_sm_mhz"] == 1500
