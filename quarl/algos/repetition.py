"""Detect responses stuck in a loop: the papers' "error tokens".

QaRL (section 3.2, appendix table 6) observes that under-trained quantized policies
emit repetitive tokens at the end of long responses: after one bad token the model
falls into a loop that runs until the length limit. A response counts as repetitive
when its tail is periodic: the last ``span`` tokens satisfy ``x[t] == x[t - n]`` for
some period ``n`` in ``[min_ngram, max_ngram]``, covering at least ``min_repeats``
copies of the n-gram and at least ``min_span`` tokens. The check is on periods, not on
whole copies, so a loop cut mid-n-gram by the length limit is still caught
(``a b c a b c a b``). ``response/repeat_frac`` is :func:`repeat_fraction` of a batch.
"""

from __future__ import annotations

from typing import Sequence

import torch

TokenIds = Sequence[int] | torch.Tensor


def periodic_tail_length(token_ids: Sequence[int], period: int) -> int:
    """Length of the longest suffix of ``token_ids`` with period ``period`` (0 if too short)."""
    n = len(token_ids)
    if period < 1 or n < period:
        return 0
    t = n - 1
    while t >= period and token_ids[t] == token_ids[t - period]:
        t -= 1
    # x[t+1:] all match one period back, so the suffix x[t+1-period:] is periodic.
    return n - (t + 1) + period


def is_repetitive(
    token_ids: TokenIds,
    min_ngram: int = 1,
    max_ngram: int = 64,
    min_repeats: int = 3,
    min_span: int = 16,
) -> bool:
    """Whether the response ``token_ids`` (list of ints or 1-D tensor) ends in a loop.

    True if for some ``n`` in ``[min_ngram, max_ngram]`` the periodic tail of period
    ``n`` is at least ``max(min_repeats * n, min_span)`` tokens long. ``min_span`` keeps
    short legitimate runs (``)))``, ``\\n\\n\\n``) from counting.
    """
    if not 1 <= min_ngram <= max_ngram or min_repeats < 2:
        raise ValueError(
            f"need 1 <= min_ngram <= max_ngram and min_repeats >= 2; got "
            f"{min_ngram}, {max_ngram}, {min_repeats}"
        )
    ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
    for n in range(min_ngram, min(max_ngram, len(ids) // min_repeats) + 1):
        if periodic_tail_length(ids, n) >= max(min_repeats * n, min_span):
            return True
    return False


def repeat_fraction(responses: Sequence[TokenIds], **kw) -> float:
    """Share of ``responses`` (token-id lists) for which :func:`is_repetitive` holds; 0 if none.

    ``kw`` are :func:`is_repetitive`'s thresholds.
    """
    if len(responses) == 0:
        return 0.0
    return sum(is_repetitive(r, **kw) for r in responses) / len(responses)
