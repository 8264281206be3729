"""The n-gram proposer (prompt lookup, vLLM's `"method": "ngram"`): no model, no device work.

For a sequence whose text so far (its prompt's text tokens, then its own output) ends in an n-gram that occurred
before, propose the k tokens that followed its latest earlier occurrence with k tokens after it (else its latest),
trying the longest n first (prompt_lookup_max down to prompt_lookup_min): in a loop shorter than k the latest
occurrence is one period back, and an earlier one proposes the whole k. Answers that repeat their prompt (extracting or rewriting a passage,
filling a described form) are where it proposes well; elsewhere it mostly finds nothing and costs nothing but the
lookup (numpy over the history: about 20 us for 2,000 tokens).

Only text is looked up: image, video and audio placeholder positions are masked out (-1), so a run of 256 image
tokens never proposes.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

MASKED = -1


def text_history(input_ids: Iterable[int], media_ids: set[int]) -> np.ndarray:
    """The prompt's tokens with every media placeholder masked out."""
    ids = np.fromiter(input_ids, dtype=np.int64)
    if media_ids:
        ids[np.isin(ids, np.fromiter(media_ids, dtype=np.int64))] = MASKED
    return ids


def propose(history: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens following the latest earlier occurrence of the history's last n-gram (longest n first); []
    when none matches (or the match is at the very end)."""
    size = len(history)
    if k <= 0 or size < n_min + 1:
        return []
    last = history[-1]
    if last == MASKED:
        return []
    starts = np.flatnonzero(history[: size - 1] == last)  # positions p < size - 1 whose token is the last one
    if not len(starts):
        return []
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        tail = history[size - n:]
        if (tail == MASKED).any():
            continue
        ends = starts[starts >= n - 1]  # the n-gram ends at p: history[p - n + 1 : p + 1] == tail
        if not len(ends):
            continue
        ok = np.ones(len(ends), dtype=bool)
        for j in range(1, n):
            ok &= history[ends - j] == tail[n - 1 - j]
        hits = ends[ok]
        if len(hits):  # the latest occurrence with k tokens after it (a loop's period may be shorter than k)
            full = hits[hits + 1 + k <= size]
            p = int(full[-1] if len(full) else hits[-1]) + 1
            follow = history[p: p + k]
            stop = np.flatnonzero(follow == MASKED)
            if len(stop):
                follow = follow[: int(stop[0])]
            return [int(t) for t in follow]
    return []
