"""Where a response goes wrong: the first error token, by loop or by garbling.

QaRL (section 3.2) traces the collapse of low-bit rollouts to *error tokens*: after one
token the learner would not have produced, the response leaves the policy's trajectory,
and everything after it is off-policy noise to learn from. Two signatures are detected:

- a **loop**: the response ends in a periodic tail, the criterion of
  :func:`quarl.algos.repetition.is_repetitive`; :func:`loop_starts` gives the tail's
  first token;
- a **garbled stretch**: a burst of tokens that the learner finds very unlikely while
  the sampler did not, which no period describes; :func:`garbled_starts` gives the
  stretch's first bad token.

:func:`error_starts` is the earlier of the two, :func:`before_error` the response mask cut
there (to train on the prefix before the first bad token), and :func:`error_metrics` the
``errors/*`` metrics of a step.

Layout: right-padded ``[B, T]`` tensors whose ``mask`` is 1.0 on response tokens and 0 on
prompt and padding, each row's response tokens contiguous; ``token_ids[:, t]`` is the token
whose log-probs are ``learner_logp[:, t]`` and ``sampler_logp[:, t]`` (for a
:class:`~quarl.learner.batch.RolloutBatch` that is ``input_ids[:, 1:]`` beside
``response_mask``). A start is a column index of that layout, ``T`` (the width) where the
row has none. Everything is vectorized over rows (a Python loop runs over loop periods
only) and reads nothing back to the host, so it runs inside a training step on the GPU.
"""

from __future__ import annotations

import math

import torch

# Defaults of the garbled-stretch test (reasons in garbled_starts' docstring).
SURPRISE = 8.0
GAP = 2.0
WINDOW = 8
MIN_BAD = 3


def _span(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first response column and one past its last, ``[B]`` long (``0, 0``
    for a row with no response token)."""
    m = mask > 0
    cols = torch.arange(1, m.shape[1] + 1, device=m.device)
    end = torch.where(m, cols, 0).amax(-1) if m.shape[1] else m.new_zeros(m.shape[0], dtype=torch.long)
    return end - m.sum(-1), end


def _check_2d(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        raise ValueError("need [B, T] tensors of one shape; got " + ", ".join(f"{k} {v}" for k, v in shapes.items()))


def loop_starts(
    token_ids: torch.Tensor,
    mask: torch.Tensor,
    min_ngram: int = 1,
    max_ngram: int = 64,
    min_repeats: int = 3,
    min_span: int = 16,
) -> torch.Tensor:
    """``[B]`` long: the column of the first token of each response's looping tail, ``T``
    where the response does not end in a loop.

    ``token_ids`` ``[B, T]`` (any integer dtype), ``mask`` ``[B, T]``. The criterion is
    :func:`~quarl.algos.repetition.is_repetitive`'s on the response tokens alone: the tail
    of period ``n`` is the longest suffix with ``x[t] == x[t - n]`` for all its ``t`` past
    its first ``n`` tokens, and it is a loop when it covers at least
    ``max(min_repeats * n, min_span)`` tokens, for some ``n`` in ``[min_ngram, max_ngram]``.
    Of the periods that qualify, the longest tail (the earliest start) is returned.
    """
    if not 1 <= min_ngram <= max_ngram or min_repeats < 2:
        raise ValueError(
            f"need 1 <= min_ngram <= max_ngram and min_repeats >= 2; got {min_ngram}, {max_ngram}, {min_repeats}"
        )
    _check_2d(token_ids=token_ids, mask=mask)
    b, t = token_ids.shape
    m = mask > 0
    start, end = _span(mask)
    length = end - start
    cols = torch.arange(t, device=token_ids.device)
    longest = torch.zeros(b, dtype=torch.long, device=token_ids.device)
    # a tail of period n holds >= min_repeats * n tokens: no period above T // min_repeats fits
    for n in range(min_ngram, min(max_ngram, t // min_repeats) + 1):
        same = torch.zeros_like(m)
        same[:, n:] = (token_ids[:, n:] == token_ids[:, :-n]) & m[:, n:] & m[:, :-n]
        # the last column up to the response's end where the match chain breaks: it exists,
        # since column start + n - 1 compares with a token before the response
        broken = torch.where(~same & (cols < end[:, None]), cols, -1).amax(-1)
        tail = torch.where(length >= n, end - 1 - broken + n, 0)
        ok = tail >= max(min_repeats * n, min_span)
        longest = torch.where(ok, torch.maximum(longest, tail), longest)
    return torch.where(longest > 0, end - longest, t)


def garbled_starts(
    learner_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    surprise: float = SURPRISE,
    gap: float = GAP,
    window: int = WINDOW,
    min_bad: int = MIN_BAD,
) -> torch.Tensor:
    """``[B]`` long: the column of the first bad token of each response's first garbled
    stretch, ``T`` where it has none.

    ``learner_logp``, ``sampler_logp``, ``mask``: ``[B, T]``. A response token is *bad* when
    the learner finds it surprising, ``-learner_logp > surprise``, and the two policies part
    ways on it, ``sampler_logp - learner_logp > gap`` (strictly: a token exactly at a
    threshold is not bad; NaN is never bad). A garbled stretch is ``window`` consecutive
    response tokens (fewer at the response's end) holding at least ``min_bad`` bad tokens;
    ``min_bad=1`` flags any single bad token. The first such stretch begins at the first
    bad token ``p`` with ``min_bad`` bad tokens in ``[p, p + window)``.

    Defaults, for an LLM's log-probs at the sampling temperature: ``surprise`` 8 nats is a
    learner probability below e^-8 = 3.4e-4, far in the tail of a real policy's sampled
    tokens; ``gap`` 2 nats asks that the sampler gave the token over e^2 = 7.4 times the
    learner's probability, so the low-bit policy, not sampling luck, chose it (a sound
    low-bit sampler stays within ~0.1 nat on average, ``mismatch/abs_logp_diff_mean``).
    An isolated such token is expected now and then in a long response sampled at
    temperature 1; three within 8 tokens is a burst: were bad tokens independent at a rate
    of 1e-3, a window would hold three with probability C(8, 3) * 1e-9 = 5.6e-8, and a
    4096-token response would be flagged by chance once in ~4000.
    """
    if not window >= 1 or not 1 <= min_bad <= window:
        raise ValueError(f"need window >= 1 and 1 <= min_bad <= window; got window={window}, min_bad={min_bad}")
    if math.isnan(surprise) or math.isnan(gap) or surprise < 0 or gap < 0:
        raise ValueError(f"need surprise >= 0 and gap >= 0 (nats); got surprise={surprise}, gap={gap}")
    _check_2d(learner_logp=learner_logp, sampler_logp=sampler_logp, mask=mask)
    t = mask.shape[1]
    learner = learner_logp.detach()
    bad = (mask > 0) & (-learner > surprise) & (sampler_logp.detach() - learner > gap)
    # before[:, i] = bad tokens in columns [0, i): a window's count is a difference of two
    before = torch.nn.functional.pad(bad.to(torch.int32).cumsum(-1, dtype=torch.int32), (1, 0))
    cols = torch.arange(t, device=mask.device)
    ahead = before.gather(1, (cols + window).clamp(max=t).expand_as(bad)) - before[:, :t]
    first = torch.where(bad & (ahead >= min_bad), cols, t)
    return first.amin(-1) if t else first.new_zeros(first.shape[0])


def error_starts(
    token_ids: torch.Tensor,
    learner_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    min_ngram: int = 1,
    max_ngram: int = 64,
    min_repeats: int = 3,
    min_span: int = 16,
    surprise: float = SURPRISE,
    gap: float = GAP,
    window: int = WINDOW,
    min_bad: int = MIN_BAD,
) -> torch.Tensor:
    """``[B]`` long: the first error token of each response, the earlier of
    :func:`loop_starts` and :func:`garbled_starts` (``T`` where neither finds one).
    All tensors ``[B, T]``; the keywords are those two functions' thresholds."""
    loops = loop_starts(token_ids, mask, min_ngram, max_ngram, min_repeats, min_span)
    garbled = garbled_starts(learner_logp, sampler_logp, mask, surprise=surprise, gap=gap, window=window,
                             min_bad=min_bad)
    return torch.minimum(loops, garbled)


def before_error(mask: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """``mask`` ``[B, T]`` with every column ``>= starts`` (``[B]``) zeroed: the prefix before
    each response's first error token (a row whose start is ``T`` keeps its mask)."""
    if mask.dim() != 2 or starts.shape != mask.shape[:1]:
        raise ValueError(f"need mask [B, T] and starts [B]; got {tuple(mask.shape)} and {tuple(starts.shape)}")
    cols = torch.arange(mask.shape[1], device=mask.device)
    return torch.where(cols < starts[:, None].to(mask.device), mask, torch.zeros_like(mask))


def error_metrics(loops: torch.Tensor, garbled: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ``errors/*`` metrics (0-d float tensors) of :func:`loop_starts` and
    :func:`garbled_starts` ``[B]`` over the responses of ``mask`` ``[B, T]``.

    A response is flagged when a start falls inside it (a start of ``T``, or any other past
    the response, is none); its error begins at the earlier start. Over the non-empty
    responses (every value 0 when there are none or none is flagged):

    - ``errors/response_frac``    share of responses flagged
    - ``errors/loop_frac``        share with a looping tail
    - ``errors/garbled_frac``     share with a garbled stretch (a response may have both)
    - ``errors/first_pos``        mean over the flagged responses of the first error
      token's relative position, ``(start - first response column) / length``, in [0, 1)
    - ``errors/token_frac_after`` share of all response tokens at or after an error: what
      :func:`before_error` would cut
    """
    if mask.dim() != 2 or loops.shape != mask.shape[:1] or garbled.shape != mask.shape[:1]:
        raise ValueError(f"need loops [B], garbled [B] and mask [B, T]; got {tuple(loops.shape)}, "
                         f"{tuple(garbled.shape)} and {tuple(mask.shape)}")
    start, end = _span(mask)
    loops, garbled = loops.to(start.device), garbled.to(start.device)
    has_loop = (loops >= start) & (loops < end)
    has_garbled = (garbled >= start) & (garbled < end)
    flagged = has_loop | has_garbled
    first = torch.minimum(torch.where(has_loop, loops, end), torch.where(has_garbled, garbled, end))
    length = (end - start).double()
    responses = (length > 0).sum().double().clamp(min=1)
    tokens = length.sum().clamp(min=1)
    relative = torch.where(flagged, (first - start).double() / length.clamp(min=1), 0.0)
    return {
        "errors/response_frac": flagged.sum().double() / responses,
        "errors/loop_frac": has_loop.sum().double() / responses,
        "errors/garbled_frac": has_garbled.sum().double() / responses,
        "errors/first_pos": relative.sum() / flagged.sum().double().clamp(min=1),
        "errors/token_frac_after": (end - first).double().sum() / tokens,
    }
