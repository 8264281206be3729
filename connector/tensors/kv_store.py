"""A prefill worker's K/V hand-offs held for pickup, bounded in bytes and in time; the oldest go first.

The engine puts a prompt's blocks once, after its prefill; the KV server's thread reads them for every kv_get.
A get does not remove an entry (a decode worker whose fetch timed out may ask again): the decode worker's
`kv_release`, once it has the blocks, frees it (`release`), and otherwise its TTL, the byte bound or `drop`. The KV
server's thread calls `expire` on a timer, so an entry nobody asks for is freed within a moment of its TTL, not at
the next hand-off. Every entry lives `ttl_s`, so put order is expiry order and the oldest are at the front.

With shared memory on, a put copies the blocks once into a sealed memfd segment (connector/tensors/shm.py) and the
entry's tensor views it, so a same-host decode worker maps the blocks (the server answers with the segment's
handle) and the socket path sends from the same memory; an entry that cannot have one (small, memfd unavailable or
memory full) stays on the heap and goes by socket. Freeing an entry closes its segment's fd: the pages live on
while a send in flight or a decode worker's mapping still views them.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from connector.tensors.dtypes import DTYPES
from connector.tensors.frames import tensor_buffer
from connector.tensors.kv_checks import extent_error
from connector.tensors.shm import SHM_MIN_BYTES, Segment, open_probe
from epd_contracts.header import ShmHandle
from epd_contracts.kv import MAX_CHOICES, KVChoice, KVGetReply, KVLayout

logger = logging.getLogger("epd.connector")
_REPLY_DECODER = msgspec.msgpack.Decoder(KVGetReply)


@dataclass(frozen=True, eq=False)
class KVEntry:
    """One hand-off: a prompt's K/V blocks and its choices' states after their first token."""

    layout: KVLayout
    num_tokens: int
    blocks: torch.Tensor  # CPU, contiguous (num_blocks, *layout.block_shape), the layout's dtype
    choices: list[KVChoice]
    expires_at: float  # on the store's clock
    segment: Segment | None = None  # the shared memory `blocks` view (right after its tag), or None: the heap
    # NOTE: made once at the put, while the fd is open: an entry freed after a get still has it, and a decode worker
    # opening it then finds its fd closed or reused (the tag check), never another entry's bytes
    shm: ShmHandle | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    @property
    def block_nbytes(self) -> int:
        return self.nbytes // self.num_blocks if self.num_blocks else 0

    def block_buffers(self, first_block: int) -> list[memoryview]:
        """One byte view per block from `first_block` on, over the blocks' memory (no copy)."""
        flat, size = tensor_buffer(self.blocks), self.block_nbytes
        return [flat[i * size:(i + 1) * size] for i in range(first_block, self.num_blocks)]

    def release(self) -> None:
        """The store freed this entry: close its segment's fd (its memory goes with the last view)."""
        if self.segment is not None:
            self.segment.close()


class KVStore:
    """Thread-safe: the engine puts and drops, the KV server's thread gets."""

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic, shm: bool = True,
                 shm_min_bytes: int = SHM_MIN_BYTES) -> None:
        """`clock`: seconds, monotonic (tests pass a fake one). `shm`: hold hand-offs of at least `shm_min_bytes` in
        shared memory that same-host decode workers map, falling back to the heap per entry; False: heap only."""
        if max_bytes < 0 or ttl_s < 0:
            raise ValueError(f"max_bytes and ttl_s must be >= 0, got {max_bytes} and {ttl_s}")
        self.max_bytes, self.ttl_s, self._clock, self.shm_min_bytes = max_bytes, ttl_s, clock, shm_min_bytes
        self._entries: collections.OrderedDict[str, KVEntry] = collections.OrderedDict()  # key -> entry, oldest first
        self._lock = threading.Lock()
        self._bytes = 0
        self._counts = dict.fromkeys(("puts", "hits", "misses", "released", "expired", "evicted", "rejected",
                                      "shm_placed", "shm_place_failures"), 0)
        self._shm_probe = open_probe("K/V blocks") if shm else None

    def probe_handle(self) -> ShmHandle | None:
        """The probe segment a decode worker maps before asking for handles (None: heap only, blocks by socket)."""
        with self._lock:  # close() may be closing it
            return None if self._shm_probe is None else self._shm_probe.handle()

    def put(self, key: str, layout: KVLayout, num_tokens: int, blocks: torch.Tensor, choices: list[KVChoice]) -> bool:
        """Hold `blocks` under `key` (replacing what it held) for `ttl_s`, evicting the oldest entries to make room;
        False, and nothing held under `key`, when they alone are over `max_bytes`. ValueError for an inconsistent
        hand-off (shapes, dtype, counts, bounds of the contract).

        NOTE: `blocks` are copied once into shared memory, or else kept, not copied, and sent from their memory:
        the caller must not write to them after."""
        _check_put(key, layout, num_tokens, blocks, choices)
        nbytes = blocks.numel() * blocks.element_size()
        with self._lock:
            self._expire(self._clock())
            self._remove(key)
            if nbytes > self.max_bytes:
                self._counts["rejected"] += 1
                return False
            self._make_room(nbytes)
        # NOTE: the copy runs outside the lock, so the server's gets never wait for it
        held, segment = self._placed(blocks)
        with self._lock:
            self._remove(key)  # a put of the same key meanwhile
            self._make_room(nbytes)
            self._entries[key] = KVEntry(layout, num_tokens, held, list(choices), self._clock() + self.ttl_s, segment,
                                         None if segment is None else segment.handle())
            self._bytes += nbytes
            self._counts["puts"] += 1
            self._counts["shm_placed"] += segment is not None
        return True

    def _placed(self, blocks: torch.Tensor) -> tuple[torch.Tensor, Segment | None]:
        """The blocks to hold and their segment: copied once into a new one, or (shm off or unavailable, small,
        memory full) `blocks` themselves on the heap, and None."""
        nbytes = blocks.numel() * blocks.element_size()
        if self._shm_probe is None or nbytes < self.shm_min_bytes:
            return blocks, None
        try:
            segment = Segment(nbytes, [blocks])
        except OSError as e:  # ENOSPC, ENOMEM, EMFILE...: this entry stays on the heap and goes by socket
            logger.warning("no shared memory for %d bytes of K/V (%s); the hand-off is held on the heap", nbytes, e)
            with self._lock:
                self._counts["shm_place_failures"] += 1
            return blocks, None
        return segment.tensor(0, blocks.dtype, tuple(blocks.shape)), segment

    def get(self, key: str) -> KVEntry | None:
        """The entry under `key` if it has not expired; it stays held."""
        with self._lock:
            self._expire(self._clock())
            entry = self._entries.get(key)
            self._counts["hits" if entry is not None else "misses"] += 1
            return entry

    def drop(self, key: str) -> None:
        with self._lock:
            self._remove(key)

    def release(self, key: str) -> bool:
        """A decode worker has `key`'s blocks: free them now (its mapping, or a send in flight, keeps the pages it
        views). Whether it was held."""
        with self._lock:
            held = key in self._entries
            self._remove(key)
            self._counts["released"] += held
            return held

    def expire(self) -> float | None:
        """Free the entries past their TTL; the seconds until the next one is due (None: none is held)."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            return None if not self._entries else next(iter(self._entries.values())).expires_at - now

    def stats(self) -> dict[str, Any]:
        """What is held now (`items`, `bytes`, of `max_bytes`; `ttl_s`) and counters (`released`: freed by their
        decode worker's kv_release, `expired`: by the TTL; `shm_placed`: hand-offs held in shared memory so far,
        `shm_place_failures`: those that fell back to the heap because shared memory was unavailable or full).
        Reading does not expire anything: the KV server's timer does."""
        with self._lock:
            return {"items": len(self._entries), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "ttl_s": self.ttl_s, "shm": self._shm_probe is not None, **self._counts}

    def close(self) -> None:
        """Free every entry and the probe segment (their fds; pages a decode worker still maps live until it unmaps)."""
        with self._lock:
            while self._entries:
                self._remove(next(iter(self._entries)))
            if self._shm_probe is not None:
                self._shm_probe.close()
                self._shm_probe = None

    def _make_room(self, nbytes: int) -> None:
        while self._bytes + nbytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
            self._counts["evicted"] += 1

    def _expire(self, now: float) -> None:
        while self._entries and next(iter(self._entries.values())).expires_at <= now:
            self._remove(next(iter(self._entries)))
            self._counts["expired"] += 1

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
            entry.release()


def _check_put(key: str, layout: KVLayout, num_tokens: int, blocks: torch.Tensor, choices: list[KVChoice]) -> None:
    """What a consumer would refuse is refused here, where the bug is: the fields against the contract's bounds
    (by a msgpack round trip of the reply they make), then the tensor against the layout."""
    reply = KVGetReply(req_id=0, key=key, found=True, layout=layout, num_tokens=num_tokens,
                       num_blocks=int(blocks.shape[0]) if blocks.dim() else 0, choices=list(choices))
    try:
        _REPLY_DECODER.decode(msgspec.msgpack.encode(reply))
    except msgspec.ValidationError as e:
        raise ValueError(f"K/V hand-off {key[:64]!r} breaks the contract: {e}") from e
    shape = (reply.num_blocks, *layout.block_shape)
    if blocks.device.type != "cpu" or not blocks.is_contiguous() or tuple(blocks.shape) != shape:
        raise ValueError(f"blocks must be a contiguous CPU tensor of {list(shape)}, got {list(blocks.shape)} "
                         f"on {blocks.device}, contiguous={blocks.is_contiguous()}")
    if blocks.dtype != DTYPES[layout.dtype]:
        raise ValueError(f"blocks are {blocks.dtype}, the layout says {layout.dtype}")
    if error := extent_error(layout, num_tokens, reply.num_blocks):
        raise ValueError(error)
    if not 1 <= len(choices) <= MAX_CHOICES:
        raise ValueError(f"a hand-off has 1 to {MAX_CHOICES} choices, got {len(choices)}")
