"""The rollout benchmark's pure parts: idle time between a decode step's kernels."""

import pytest

from quarl.bench.rollout import idle_gaps


def test_idle_gaps_sums_the_holes_and_names_the_kernel_that_waited():
    spans = [("b", 12.0, 20.0), ("a", 0.0, 10.0), ("c", 23.0, 30.0), ("b", 31.5, 40.0),
             ("a", 1000.0, 1010.0)]  # the last one comes after the host's pause between replays
    idle, before = idle_gaps(spans, max_gap_us=100.0)
    assert idle == pytest.approx(2.0 + 3.0 + 1.5)
    assert before == {"b": (pytest.approx(3.5), 2), "c": (pytest.approx(3.0), 1)}


def test_overlapping_kernels_leave_no_idle_time():
    idle, before = idle_gaps([("a", 0.0, 10.0), ("b", 5.0, 8.0), ("c", 9.0, 12.0), ("d", 12.5, 13.0)])
    assert idle == pytest.approx(0.5) and before == {"d": (pytest.approx(0.5), 1)}
