"""quarl.bench.timing.PowerGate: timings pinned to a power state (after a cool-down, or after
half a second of the same load), on CPU with stand-ins for nvidia-smi's readings, the sleep,
the wall clock and the CUDA-event timer."""

from __future__ import annotations

import pytest

from quarl.bench.timing import PowerGate


class FakeWatch:
    """nvidia-smi's samples in turn (the last one repeated), each a list of per-GPU readings or
    one reading; ``command`` None: no nvidia-smi."""

    def __init__(self, readings, command="nvidia-smi"):
        self.readings, self.command, self.calls = list(readings), command, 0

    def sample(self):
        r = self.readings[min(self.calls, len(self.readings) - 1)]
        self.calls += 1
        return r if isinstance(r, list) else [r]


def reading(reasons, sm=1980.0, gpu=0):
    return dict(gpu=gpu, sm_mhz=sm, max_sm_mhz=1980.0, temp_c=50.0, power_w=300.0, reasons=reasons)


def gate(readings, **kw):
    log: list = []
    t = [0.0]

    def sleep(s):
        log.append(("sleep", round(s, 3)))
        t[0] += s

    g = PowerGate(gpu=0, watch=FakeWatch(readings), sleep=sleep, clock=lambda: t[0], **kw)
    return g, log, t


def test_a_cool_down_waits_until_no_reason_but_idle_is_active():
    # GPU 1 capped throughout (another GPU's reasons do not count); GPU 0: power cap (0x4)
    # twice, then the idle reason only (0x1)
    def both(r0):
        return [reading(r0), reading(0x4, gpu=1)]

    g, log, _ = gate([both(0x4), both(0x4), both(0x1)], rest_s=0.6)
    assert g.cool_down()["reasons"] == 0x1
    assert log == [("sleep", 0.6), ("sleep", 0.1), ("sleep", 0.1)]
    # capped for good: it gives up after timeout_s and returns the capped reading
    g, log, _ = gate([both(0x4)], rest_s=0.5, timeout_s=1.0)
    assert g.cool_down()["reasons"] == 0x4 and sum(s for _, s in log) == pytest.approx(1.0)


def test_without_nvidia_smi_a_cool_down_is_a_fixed_sleep():
    log = []
    g = PowerGate(gpu=0, watch=FakeWatch([], command=None), sleep=lambda s: log.append(s), rest_s=0.6, fallback_s=1.5)
    assert g.cool_down() is None and sum(log) == pytest.approx(1.5)


def test_a_burst_times_a_few_replays_after_each_cool_down():
    """Replays of 10 ms, bursts of 25 ms of load: each burst is one untimed replay, then timed
    ones until the load reaches 25 ms (three), at most ceil(reps / bursts) (two at reps 6)."""
    g, log, t = gate([reading(0)], bursts=3, burst_s=0.025, rest_s=0.6)
    durations = iter([0.010, 0.012, 0.011, 0.008, 0.010, 0.009, 0.013, 0.010, 0.010])

    def timer(fn):
        fn()
        log.append("timed")
        return next(durations)

    g.timer = timer
    info: dict = {}
    got = g.time(lambda: log.append("replay"), "burst", reps=20, info=info)
    one = [("sleep", 0.6), "replay", "replay", "timed", "replay", "timed", "replay", "timed"]
    assert log == one * 3
    assert got == pytest.approx(0.010)  # the median of the nine
    assert info == dict(reading=reading(0), power="burst", replays=9)
    log.clear()
    g.timer = lambda fn: (fn(), 0.001)[1]
    g.watch = FakeWatch([reading(0)])
    g.time(lambda: log.append("replay"), "burst", reps=6)
    assert log.count("replay") == 3 * (1 + 2)


def test_sustained_times_after_settle_seconds_of_the_same_load():
    g, log, t = gate([reading(0x4, sm=1500.0)], settle_s=0.5)

    def timer(fn):
        fn()
        t[0] += 0.1
        return 0.1 if len(log) <= 5 else 0.2  # the settling replays are the faster ones

    g.timer = timer
    info: dict = {}
    got = g.time(lambda: log.append("replay"), "sustained", reps=4, info=info)
    assert len(log) == 5 + 4 and got == pytest.approx(0.2)
    assert info["reading"]["sm_mhz"] == 1500.0 and info["power"] == "sustained" and info["replays"] == 4
    with pytest.raises(ValueError, match="burst, sustained"):
        g.time(lambda: None, "hot", reps=1)


def test_targets_and_layer_ratios_compare_timings_of_one_power_state():
    from quarl.bench.gemm import check_targets, layer_speedups

    def row(power, fmt, ms):
        return dict(model="qwen2.5-7b", layer="down", counts={"engine": 1}, M=1024, format=fmt, ms=ms, power=power,
                    speedup=dict(burst=1.8, sustained=2.0)[power] / ms)

    rows = [row("burst", "bf16", 1.8), row("burst", "w4a16", 2.0), row("sustained", "bf16", 2.0),
            row("sustained", "w4a16", 2.0)]
    sp = {(r["power"], r["format"]): r["speedup"] for r in layer_speedups(rows, "engine")}
    assert sp[("burst", "w4a16")] == pytest.approx(0.9) and sp[("sustained", "w4a16")] == pytest.approx(1.0)
    t = {x["power"]: x for x in check_targets(rows, shape_set="engine") if x["where"] == "M=1024"}
    assert not t["burst"]["met_all"] and t["sustained"]["met_all"] and t["sustained"]["target"] == 1.0


def test_the_nvidia_smi_index_follows_cuda_visible_devices(monkeypatch):
    import torch

    from quarl.bench.timing import nvidia_smi_index

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert nvidia_smi_index(torch.device("cuda", 0)) == 3 and nvidia_smi_index(torch.device("cuda", 1)) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234")  # a UUID: the CUDA index stands
    assert nvidia_smi_index(torch.device("cuda", 0)) == 0


def test_the_cli_reads_power_states_and_names_the_valid_ones():
    from quarl.cli.bench_gemm import _power_states

    assert _power_states("burst,sustained") == ("burst", "sustained") and _power_states("found") == (None,)
    with pytest.raises(ValueError, match="burst, sustained, found"):
        _power_states("burst,cold")
