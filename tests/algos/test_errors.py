"""Error-token detector: loop and garbled-stretch starts, the prefix mask, the metrics."""

from __future__ import annotations

import math

import pytest
import torch

from quarl.algos import before_error, error_metrics, error_starts, garbled_starts, is_repetitive, loop_starts
from quarl.algos.repetition import periodic_tail_length


def _rows(responses: list[list[int]], offsets: list[int], width: int, pad: int = 0):
    """token_ids, mask [B, width]: response i at columns offsets[i]..., prompt tokens 7 before it, pad after."""
    ids = torch.full((len(responses), width), pad, dtype=torch.long)
    mask = torch.zeros(len(responses), width)
    for i, (r, o) in enumerate(zip(responses, offsets)):
        ids[i, :o] = 7
        ids[i, o : o + len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, o : o + len(r)] = 1.0
    return ids, mask


# ---------------------------------------------------------------------- loops
def test_loop_start_hand_values():
    # row 0: "9 | 1 2 3 1 2 3 1 2 3 1 2" after 2 prompt columns: period 3 covers the last 11
    #   tokens (>= 3 * 3, cut mid-period), so the loop starts at response token 1 = column 3
    # row 1: a loop that ended is no error tail -> T
    # row 2: "5" x 20 from column 0: the whole response, start 0
    # row 3: no response -> T
    r0 = [9] + [1, 2, 3] * 3 + [1, 2]
    r1 = [1, 2, 3] * 4 + [8, 9]
    ids, mask = _rows([r0, r1, [5] * 20, []], [2, 1, 0, 4], width=24)
    got = loop_starts(ids, mask, min_span=1)
    assert got.tolist() == [3, 24, 0, 24]
    assert got.dtype == torch.long
    # with the default min_span=16 the 11-token tail of row 0 is too short; row 2's 20 are not
    assert loop_starts(ids, mask).tolist() == [24, 24, 0, 24]


def test_loop_ignores_prompt_and_padding():
    # the prompt "1 2 1 2 1 2" continues the response's 2-gram loop: only the response's
    # 8 tokens count (start at its first column, 6); pad 0 continuing a run of zeros does not count
    ids, mask = _rows([[1, 2] * 4], [6], width=20)
    ids[0, :6] = torch.tensor([1, 2] * 3)
    assert loop_starts(ids, mask, min_span=8).tolist() == [6]
    assert loop_starts(ids, mask, min_span=9).tolist() == [20]  # 8 response tokens < 9, the prompt adds none
    zeros, zmask = _rows([[4, 0, 0, 0, 0]], [1], width=12)  # padding is 0 too
    assert loop_starts(zeros, zmask, min_span=4).tolist() == [2]  # 4 zeros of the response, not 4 + 7 pads
    assert loop_starts(zeros, zmask, min_span=5).tolist() == [12]


def test_loop_thresholds_edges():
    text = [11, 12, 13, 14]
    ids, mask = _rows([text + [7, 8] * 8], [3], width=30)  # a 16-token 2-gram tail at response token 4
    assert loop_starts(ids, mask).tolist() == [7]  # span 16 == min_span: a loop (>=)
    assert loop_starts(ids, mask, min_span=17).tolist() == [30]
    assert loop_starts(ids, mask, min_span=1, min_repeats=8).tolist() == [7]  # 8 copies == min_repeats
    assert loop_starts(ids, mask, min_span=1, min_repeats=9).tolist() == [30]
    assert loop_starts(ids, mask, min_ngram=3, max_ngram=3).tolist() == [30]  # period 3 sees no loop
    assert loop_starts(ids, mask, min_ngram=4).tolist() == [7]  # period 4 covers the same 16 tokens
    assert loop_starts(ids, mask, min_ngram=5).tolist() == [30]  # period 6: 16 < 3 * 6
    # "5 5 5 5 5 6" twice: the final 6 breaks period 1; period 6 covers all 12 tokens in 2 copies
    ids, mask = _rows([[5, 5, 5, 5, 5, 6] * 2], [0], width=12)
    assert loop_starts(ids, mask, min_span=1, min_repeats=2).tolist() == [0]
    assert loop_starts(ids, mask, min_span=1, min_repeats=3).tolist() == [12]


def test_loop_empty_batches_and_bad_arguments():
    assert loop_starts(torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, 5)).shape == (0,)
    assert loop_starts(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0)).tolist() == [0, 0]
    with pytest.raises(ValueError, match="min_repeats >= 2"):
        loop_starts(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4), min_repeats=1)
    with pytest.raises(ValueError, match=r"\[B, T\] tensors of one shape"):
        loop_starts(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 5))


def _reference_loop_start(x: list[int], min_ngram, max_ngram, min_repeats, min_span) -> int | None:
    """Start within the response of the longest qualifying periodic tail, from repetition.py."""
    best = 0
    for n in range(min_ngram, min(max_ngram, len(x) // min_repeats) + 1):
        tail = periodic_tail_length(x, n)
        if tail >= max(min_repeats * n, min_span):
            best = max(best, tail)
    assert (best > 0) == is_repetitive(x, min_ngram, max_ngram, min_repeats, min_span)
    return len(x) - best if best else None


@pytest.mark.parametrize("seed, thresholds", enumerate([
    dict(),
    dict(min_span=4),
    dict(min_ngram=2, max_ngram=5, min_repeats=2, min_span=1),
    dict(max_ngram=3, min_repeats=4, min_span=6),
]))
def test_loop_starts_match_is_repetitive_on_random_rows(seed, thresholds):
    kw = dict(min_ngram=1, max_ngram=64, min_repeats=3, min_span=16) | thresholds
    g = torch.Generator().manual_seed(seed)
    responses, offsets, width, flagged = [], [], 130, 0
    for _ in range(400):
        text = torch.randint(0, 3, (int(torch.randint(0, 25, (1,), generator=g)),), generator=g).tolist()
        if torch.rand(1, generator=g) < 0.7:  # a planted loop, cut mid-period
            period = int(torch.randint(1, 9, (1,), generator=g))
            gram = torch.randint(0, 3, (period,), generator=g).tolist()
            text += (gram * 12)[: int(torch.randint(period, 12 * period, (1,), generator=g))]
        offset = int(torch.randint(0, width - len(text) + 1, (1,), generator=g))
        responses.append(text)
        offsets.append(offset)
    ids, mask = _rows(responses, offsets, width)
    ids[mask == 0] = torch.randint(0, 3, (int((mask == 0).sum()),), generator=g)  # prompt/pads from the vocab too
    got = loop_starts(ids, mask, **kw).tolist()
    for i, (x, o) in enumerate(zip(responses, offsets)):
        ref = _reference_loop_start(x, **kw)
        assert got[i] == (width if ref is None else o + ref), (i, x, o)
        flagged += ref is not None
    assert 50 < flagged < 390  # both outcomes were exercised


# ---------------------------------------------------------------------- garbled stretches
BAD = (-9.0, -6.0)  # learner, sampler: surprise 9 > 8, gap 3 > 2
FINE = (-0.5, -0.5)


def _logps(rows: list[list[tuple[float, float]]], offsets: list[int], width: int):
    learner, sampler = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width)
    for i, (r, o) in enumerate(zip(rows, offsets)):
        for j, (lp, sp) in enumerate(r):
            learner[i, o + j], sampler[i, o + j], mask[i, o + j] = lp, sp, 1.0
    return learner, sampler, mask


def _pattern(bad_at: list[int], length: int) -> list[tuple[float, float]]:
    return [BAD if j in bad_at else FINE for j in range(length)]


def test_garbled_start_hand_values():
    # window 8, min_bad 3, response offset 2:
    # row 0: bad at 2, 5, 9 -> [2, 10) holds 3: start at token 2 = column 4
    # row 1: bad at 2, 5, 10 -> no 8-window holds 3 -> T
    # row 2: bad at 2, 9, 10, 11 -> the first window with 3 is [4, 12); its first bad token 9 -> column 11
    # row 3: 3 bad tokens in a 3-token response (the window is cut at the end) -> column 2
    # row 4: no response -> T
    rows = [_pattern([2, 5, 9], 20), _pattern([2, 5, 10], 20), _pattern([2, 9, 10, 11], 20), [BAD] * 3, []]
    learner, sampler, mask = _logps(rows, [2] * 5, width=24)
    assert garbled_starts(learner, sampler, mask).tolist() == [4, 24, 11, 2, 24]
    # min_bad=1: any single bad token; window 2 with 2 bad: only the adjacent 9, 10 of row 2
    assert garbled_starts(learner, sampler, mask, min_bad=1).tolist() == [4, 4, 4, 2, 24]
    assert garbled_starts(learner, sampler, mask, window=2, min_bad=2).tolist() == [24, 24, 11, 2, 24]


def test_garbled_threshold_edges():
    # (learner, sampler) per column; defaults surprise 8, gap 2, min_bad 1 here:
    # 0 (-8, -5): surprise exactly 8 -> not bad; 1 (-9, -7): gap exactly 2 -> not bad;
    # 2 (-12, -12): surprising but the sampler agrees; 3 (-1, 0): a big gap on a likely token;
    # 4 (-8.25, -6): just over both -> the first bad token
    learner = torch.tensor([[-8.0, -9.0, -12.0, -1.0, -8.25]])
    sampler = torch.tensor([[-5.0, -7.0, -12.0, 0.0, -6.0]])
    mask = torch.ones(1, 5)
    kw = dict(min_bad=1)
    assert garbled_starts(learner, sampler, mask, **kw).tolist() == [4]
    assert garbled_starts(learner, sampler, mask, surprise=7.5, **kw).tolist() == [0]
    assert garbled_starts(learner, sampler, mask, gap=1.5, **kw).tolist() == [1]
    assert garbled_starts(learner, sampler, mask, gap=2.25, **kw).tolist() == [5]  # column 4's gap is 2.25
    assert garbled_starts(learner, sampler, mask, surprise=11.0, gap=0.0, **kw).tolist() == [5]  # 2: gap 0
    assert garbled_starts(learner, sampler, mask, surprise=0.0, gap=0.0, **kw).tolist() == [0]
    assert garbled_starts(learner, sampler, mask, window=5, min_bad=2, surprise=7.5, gap=1.5).tolist() == [0]
    nan = torch.full((1, 5), float("nan"))
    assert garbled_starts(nan, sampler, mask, **kw).tolist() == [5]


def test_garbled_ignores_tokens_outside_the_mask():
    # bad numbers on the prompt (columns 0-2) and on padding (past the response) are not response tokens
    learner = torch.full((1, 12), BAD[0])
    sampler = torch.full((1, 12), BAD[1])
    mask = torch.zeros(1, 12)
    mask[0, 3:6] = 1.0
    learner[0, 3:6], sampler[0, 3:6] = FINE
    learner[0, 5], sampler[0, 5] = BAD
    assert garbled_starts(learner, sampler, mask).tolist() == [12]  # 1 bad response token < 3
    assert garbled_starts(learner, sampler, mask, min_bad=1).tolist() == [5]


def test_garbled_bad_arguments():
    x = torch.zeros(1, 4)
    for kw, msg in [(dict(window=0, min_bad=1), "window >= 1"), (dict(min_bad=0), "1 <= min_bad <= window"),
                    (dict(window=2, min_bad=3), "1 <= min_bad <= window"), (dict(surprise=-1.0), "surprise >= 0"),
                    (dict(gap=float("nan")), "gap >= 0")]:
        with pytest.raises(ValueError, match=msg):
            garbled_starts(x, x, x, **kw)
    with pytest.raises(ValueError, match="sampler_logp"):
        garbled_starts(x, torch.zeros(1, 3), x)


def test_garbled_matches_a_loop_over_rows():
    g = torch.Generator().manual_seed(3)
    b, t = 300, 40
    learner = -torch.rand(b, t, generator=g) * 12
    sampler = learner + 1.5 + torch.randn(b, t, generator=g) * 2.5  # bad tokens are ~15%
    starts = torch.randint(0, t, (b,), generator=g)
    ends = (starts + torch.randint(0, t, (b,), generator=g)).clamp(max=t)
    cols = torch.arange(t)
    mask = ((cols >= starts[:, None]) & (cols < ends[:, None])).float()
    for window, min_bad in [(8, 3), (4, 2), (1, 1), (10, 1), (3, 3)]:
        got = garbled_starts(learner, sampler, mask, window=window, min_bad=min_bad).tolist()
        flagged = 0
        for i in range(b):
            bad = [j for j in range(t) if mask[i, j] and -learner[i, j] > 8 and sampler[i, j] - learner[i, j] > 2]
            first = next((p for p in bad if sum(p <= q < p + window for q in bad) >= min_bad), t)
            assert got[i] == first, (window, min_bad, i)
            flagged += first < t
        assert 0 < flagged < b


# ---------------------------------------------------------------------- combined, prefix, metrics
def test_error_starts_is_the_earlier():
    # row 0: a loop of "4" from response token 10 (column 11) and a garbled stretch from token 3 (column 4)
    # row 1: the loop only (column 1); row 2: garbled only, at token 16 (column 17); row 3: neither
    resp = [1, 2, 3, 1, 3, 2, 1, 2, 3, 2] + [4] * 16
    ids, mask = _rows([resp] * 4, [1] * 4, width=30)
    ids[1, 1:27] = 4
    ids[2, 11:27] = torch.arange(16) + 10
    ids[3, 11:27] = torch.arange(16) + 10
    rows = [_pattern([3, 4, 5], 26), _pattern([], 26), _pattern([16, 18, 20], 26), _pattern([], 26)]
    learner, sampler, _ = _logps(rows, [1] * 4, width=30)
    assert loop_starts(ids, mask).tolist() == [11, 1, 30, 30]
    assert garbled_starts(learner, sampler, mask).tolist() == [4, 30, 17, 30]
    assert error_starts(ids, learner, sampler, mask).tolist() == [4, 1, 17, 30]
    assert error_starts(ids, learner, sampler, mask, min_span=27, min_bad=4).tolist() == [30, 30, 30, 30]


def test_before_error_keeps_the_prefix():
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    starts = torch.tensor([3, 6, 6])
    out = before_error(mask, starts)
    assert out.tolist() == [[0, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    assert out.dtype == mask.dtype
    assert before_error(mask, torch.tensor([1, 0, 0])).sum() == 0  # cut at the first response token: nothing left
    with pytest.raises(ValueError, match="starts"):
        before_error(mask, torch.tensor([1, 2]))


def test_error_metrics_hand_values():
    # response columns: row 0 [2, 12) L 10, row 1 [0, 4) L 4, row 2 [1, 7) L 6, row 3 none, width 16
    # row 0: loop at column 7 (rel 5/10); row 1: loop at 3, garbled at 2 -> first at 2 (rel 2/4);
    # row 2: a "start" in its padding (column 9, past its end 7: another rank's T) is none; row 3: empty
    # response_frac 2/3, loop_frac 2/3, garbled_frac 1/3, first_pos (0.5 + 0.5)/2, after (5 + 2)/20
    mask = torch.zeros(4, 16)
    mask[0, 2:12], mask[1, 0:4], mask[2, 1:7] = 1, 1, 1
    loops, garbled = torch.tensor([7, 3, 16, 16]), torch.tensor([16, 2, 9, 16])
    m = error_metrics(loops, garbled, mask)
    expect = {"errors/response_frac": 2 / 3, "errors/loop_frac": 2 / 3, "errors/garbled_frac": 1 / 3,
              "errors/first_pos": 0.5, "errors/token_frac_after": 7 / 20}
    assert set(m) == set(expect)
    for k, v in expect.items():
        assert m[k].dim() == 0 and math.isclose(float(m[k]), v), k
    none = error_metrics(torch.full((4,), 16), torch.full((4,), 16), mask)
    assert all(float(v) == 0.0 for v in none.values())
    empty = error_metrics(torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), torch.zeros(2, 5))
    assert all(float(v) == 0.0 for v in empty.values())
