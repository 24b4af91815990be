"""Repetition ("error token") detector."""

from __future__ import annotations

import random

import torch

from quarl.algos import is_repetitive, repeat_fraction
from quarl.algos.repetition import periodic_tail_length


def test_periodic_tail_length():
    assert periodic_tail_length([9, 1, 2, 3, 1, 2, 3, 1, 2], 3) == 8  # "1 2 3 1 2 3 1 2"
    assert periodic_tail_length([1, 2, 3], 2) == 2  # nothing repeats: just one period
    assert periodic_tail_length([1], 2) == 0


def test_detects_loops():
    random.seed(0)
    prefix = [random.randrange(1000, 2000) for _ in range(50)]
    assert is_repetitive(prefix + [7, 8, 9] * 10)
    assert is_repetitive(prefix + [7, 8, 9] * 10 + [7, 8])  # cut mid-n-gram by the length limit
    assert is_repetitive(prefix + [5] * 20)
    assert is_repetitive(torch.tensor(prefix + list(range(40)) * 3))  # a 40-gram looping 3 times


def test_ignores_normal_text():
    random.seed(1)
    text = [random.randrange(1000, 2000) for _ in range(300)]
    assert not is_repetitive(text)
    assert not is_repetitive(text + [41] * 3)  # ")))" is too short a span
    assert not is_repetitive([7, 8, 9] * 10 + text[:20])  # a loop that ended is not an error tail
    assert not is_repetitive([])


def test_thresholds():
    tail = [7, 8] * 5  # 10 tokens, 5 copies of a 2-gram
    assert not is_repetitive(tail)  # default min_span 16
    assert is_repetitive(tail, min_span=10)
    assert not is_repetitive(tail, min_span=1, min_repeats=6)
    assert not is_repetitive(tail, min_ngram=3, min_span=1)


def test_repeat_fraction():
    loop, ok = [1, 2] * 20, list(range(40))
    assert repeat_fraction([loop, ok, ok, loop]) == 0.5
    assert repeat_fraction([]) == 0.0
    assert repeat_fraction([loop], min_span=100) == 0.0
