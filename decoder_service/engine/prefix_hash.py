"""Keys of the prefix cache: a hash chain over a prompt's full blocks of tokens, images named by their `mm_hash`.

Block b's key hashes block b-1's key, the block's token ids and, for every image token in it, which image it is
(`mm_hash`) and its index among that image's tokens. So a block's key names everything its K/V depends on: every
token before it (the chain), the pictures behind its image tokens (two pictures share placeholder ids, never an
`mm_hash`), and the positions (M-RoPE positions are a function of the tokens and the images' grids, which their
`mm_hash` fixes). The chain starts from the request's `cache_salt`: different salts never share a block.

A video's tokens (the video token's) are named the same way by the video's hash, which fixes its bytes and
sampling, hence its rows, grid and time steps (epd_contracts/video.py), however it was cut into chunks.

blake2b with a 128-bit digest: finding two prompts with one key (to read or poison another user's prefix) takes
about 2^64 hashes. A chain costs ~1 µs per block, built on the request's worker thread, off the engine's.
"""
from __future__ import annotations

import bisect
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

_DIGEST = 16
_TAG = b"epd-prefix-v1"


def _key(parent: bytes, ids: Sequence[int], images: bytes = b"") -> bytes:
    h = hashlib.blake2b(parent, digest_size=_DIGEST)
    h.update(array("q", ids).tobytes())
    h.update(images)
    return h.digest()


@dataclass(frozen=True)
class PrefixChain:
    """One prompt's block keys (`keys[b]` for tokens [b * block_size, (b + 1) * block_size)), extendable with the
    tokens a sequence generates after it (text only: no image follows the prompt)."""

    block_size: int
    keys: tuple[bytes, ...]  # one per full block of the prompt
    tail: tuple[int, ...]  # the prompt's tokens after its last full block
    root: bytes  # the first block's parent: the salt's key
    extendable: bool = True  # False when the tail holds image tokens (their blocks would need the images' names)

    @property
    def num_tokens(self) -> int:
        return len(self.keys) * self.block_size + len(self.tail)

    def extend(self, generated: Sequence[int]) -> tuple[bytes, ...]:
        """Keys of every full block of the prompt followed by `generated` (the prompt's own first)."""
        if not self.extendable:
            return self.keys
        keys, rest = list(self.keys), [*self.tail, *generated]
        parent = keys[-1] if keys else self.root
        for i in range(0, len(rest) - self.block_size + 1, self.block_size):
            parent = _key(parent, rest[i : i + self.block_size])
            keys.append(parent)
        return tuple(keys)


def root_of(salt: str) -> bytes:
    return hashlib.blake2b(_TAG + salt.encode(), digest_size=_DIGEST).digest()


def _runs(ids: Sequence[int], positions: list[int], images: Sequence[tuple[str, int]],
          kinds: Sequence[int | None]) -> list[tuple[int, int, int]]:
    """The media positions as runs (first position index, item, its first row): consecutive positions of one item's
    consecutive rows. Items take the media tokens in order, or, with `kinds`, each kind's tokens in order (None
    when they do not add up)."""
    if not kinds:
        starts = [0, *accumulate(n for _, n in images)]
        return [(starts[j], j, 0) for j, (_, n) in enumerate(images) if n]
    queues: dict[int | None, list[tuple[int, int]]] = {}
    for j, ((_, n), kind) in enumerate(zip(images, kinds, strict=True)):
        if n:
            queues.setdefault(kind, []).append((j, n))
    at = {k: [0, 0] for k in queues}  # per kind: its item in the queue, the rows of it taken
    runs: list[tuple[int, int, int]] = []
    for g, p in enumerate(positions):
        kind = ids[p]
        if kind not in queues or at[kind][0] >= len(queues[kind]):
            return []
        k, taken = at[kind]
        j, n = queues[kind][k]
        if not (runs and runs[-1][1] == j and g > 0 and ids[positions[g - 1]] == kind):
            runs.append((g, j, taken))
        at[kind] = [k + 1, 0] if taken + 1 == n else [k, taken + 1]
    return runs


def prompt_chain(ids: Sequence[int], block_size: int, salt: str = "", image_token_id: int | None = None,
                 images: Sequence[tuple[str, int]] = (), video_token_id: int | None = None,
                 audio_token_id: int | None = None, kinds: Sequence[int | None] = ()) -> PrefixChain | None:
    """The chain of a prompt whose image tokens (id `image_token_id`, and video and audio tokens: `video_token_id`,
    `audio_token_id`) take the rows of `images` ((mm_hash, number of rows) each, images, videos and clips in prompt
    order) in order. `kinds`: the token each item's rows take, where a kind's rows interleave with another's (a
    video's sound track); each kind's tokens then take its items' rows in order. None when the prompt's media tokens
    do not add up to the items' rows: not cached."""
    media = {image_token_id, video_token_id, audio_token_id} - {None}
    positions = [i for i, t in enumerate(ids) if t in media] if images else []
    if len(positions) != sum(n for _, n in images):
        return None
    runs = _runs(ids, positions, images, kinds)
    if images and not runs and positions:
        return None
    firsts = [g for g, _, _ in runs]
    root = root_of(salt)
    keys: list[bytes] = []
    parent = root
    for b in range(len(ids) // block_size):
        lo, hi = b * block_size, (b + 1) * block_size
        first, last = bisect.bisect_left(positions, lo), bisect.bisect_left(positions, hi)
        named = b""
        if first < last:  # the items behind this block's media tokens, and where in each it starts
            r = bisect.bisect_right(firsts, first) - 1
            g = first
            while g < last:
                start, j, row = runs[r]
                end = min(last, firsts[r + 1] if r + 1 < len(runs) else last)
                named += f"{images[j][0]}:{row + g - start}:{end - g};".encode()
                g, r = end, r + 1
        parent = _key(parent, ids[lo:hi], named)
        keys.append(parent)
    full = len(keys) * block_size
    return PrefixChain(block_size, tuple(keys), tuple(ids[full:]), root, not positions or positions[-1] < full)
