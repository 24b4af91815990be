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
    lines = "\n".join(f"    {i}) printf '%s\\n' {' '.join(repr(r) for r in rows)} ;;" for i, rows in enumerate(READINGS))
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
