"""Encoder side of the connector: caches embeddings for consumers to fetch; `ProducerServer` serves them."""

from __future__ import annotations

import logging
import secrets
from typing import Any

from connector.control.endpoints import events_endpoint
from connector.control.security import CurveConfig
from connector.control.wire import MAX_TENSOR_BYTES
from connector.tensors.cache import EmbeddingCache
from connector.tensors.disk_tier import DiskTier
from connector.tensors.frames import WireItem
from connector.tensors.get_limits import MAX_ITEMS_PER_GET, MAX_REPLY_BYTES
from connector.tensors.server import ProducerServer
from connector.tensors.shm import SHM_MIN_BYTES, Segment, open_probe
from connector.tensors.ungathered import UNGATHERED_MAX_AGE_S, Ungathered
from connector.tensors.waiters import MAX_PARKED, MAX_PARKED_HASHES
from epd_common.logs import request_id_var
from epd_contracts.embeddings import ImageFeatures

logger = logging.getLogger("epd.connector")

# a save that finds the cache full of pinned items waits this long for a pin to go: the serving thread pins an item
# only while it builds a reply and hands it to ZeroMQ (no network wait), and dropping a fresh item costs a re-encode
PIN_WAIT_S = 1.0
__all__ = ["MAX_ITEMS_PER_GET", "MAX_PARKED", "MAX_PARKED_HASHES", "MAX_REPLY_BYTES", "ECProducer"]


class ECProducer:
    """Serves `get`/`has`/`ping`/`snapshot` for embeddings saved by this encoder process.

    A `get` may wait (up to its `wait_ms`) for items that are still being encoded; it is answered the
    moment they are stored or marked failed. Every store and eviction is published with a sequence number.
    """

    def __init__(self, bind: str = "tcp://127.0.0.1:0", cache_bytes: int = 1 << 30,
                 max_message_bytes: int = MAX_TENSOR_BYTES, events_bind: str | None = None,
                 curve: CurveConfig | None = None, advertise_host: str | None = None,
                 max_items_per_get: int = MAX_ITEMS_PER_GET, max_reply_bytes: int = MAX_REPLY_BYTES,
                 max_parked_gets: int = MAX_PARKED, max_parked_hashes: int = MAX_PARKED_HASHES,
                 shm: bool = True, shm_min_bytes: int = SHM_MIN_BYTES, pin_wait_s: float = PIN_WAIT_S,
                 disk: DiskTier | None = None, ungathered_max_age_s: float = UNGATHERED_MAX_AGE_S) -> None:
        """`shm`: hold items of at least `shm_min_bytes` in shared memory that same-host consumers map
        (connector/tensors/shm.py), falling back to the heap per item when it is unavailable or full; False: heap
        only (`--ec-shm off`). `pin_wait_s`: how long a save waits for pinned items (being sent) to make room.
        `disk`: every saved item is also written there (connector/tensors/disk_tier.py) and what it holds is
        advertised, answered and served like what memory holds; the producer closes it."""
        self.shm_min_bytes, self.pin_wait_s = shm_min_bytes, pin_wait_s
        self.bind, self.events_bind = bind, events_bind or events_endpoint(bind)
        self.max_items_per_get, self.max_reply_bytes = max_items_per_get, max_reply_bytes
        self.advertise_host = advertise_host  # None: advertise the bound address
        self.max_message_bytes, self.curve = max_message_bytes, curve
        self.epoch = secrets.token_hex(8)  # a restarted producer is a new epoch: subscribers drop what they knew
        self.disk = disk
        self._cache: EmbeddingCache[WireItem] = EmbeddingCache(cache_bytes, journal=True, on_drop=WireItem.release,
                                                               backing=disk)
        self._ungathered = Ungathered(ungathered_max_age_s)
        self._shm_probe = open_probe("embeddings") if shm else None
        self._num_shm_items = self._num_shm_failures = 0
        self._server = ProducerServer(
            self._cache, self.epoch, bind=self.bind, events_bind=self.events_bind, curve=curve,
            advertise_host=advertise_host, max_message_bytes=max_message_bytes, max_items_per_get=max_items_per_get,
            max_reply_bytes=max_reply_bytes, max_parked_gets=max_parked_gets, max_parked_hashes=max_parked_hashes,
            shm_probe=self._shm_probe, lower=None if disk is None else self._from_disk,
            on_gathered=self._ungathered.gathered)
        if disk is not None:
            disk.on_forget = self._forget

    @property
    def address(self) -> str:
        """The endpoint consumers connect to, with port 0 resolved."""
        assert self._server.address is not None, "ECProducer.start() has not been called"
        return self._server.address

    @property
    def events_address(self) -> str:
        """The endpoint cache-event subscribers connect to."""
        assert self._server.events_address is not None, "ECProducer.start() has not been called"
        return self._server.events_address

    def start(self) -> ECProducer:
        """Bind the sockets in a daemon thread and wait until they are listening."""
        self._server.start()
        return self

    def save_caches(self, mm_hash: str, features: ImageFeatures) -> None:
        """Keep an item's embeddings (as a contiguous CPU tensor) for consumers to fetch."""
        deep = features.deepstack
        if deep is not None and (deep.dtype != features.embeds.dtype or tuple(deep.shape[1:]) != tuple(features.embeds.shape)):
            logger.error("embeddings %s: DeepStack features %s %s do not match the embeddings %s %s; not saved",
                         mm_hash, tuple(deep.shape), deep.dtype, tuple(features.embeds.shape), features.embeds.dtype)
            self.mark_failed([mm_hash])
            self._server.wake()
            return
        item = self._placed(features)
        if self.disk is not None:  # first: an eviction from memory right after the put must find it on disk
            self.disk.put(mm_hash, item.features)
        if self._cache.put(mm_hash, item, wait_s=self.pin_wait_s):
            # the requests it was encoded for (the encode thread runs a batch under their ids, comma-joined)
            self._ungathered.stored(mm_hash, item.nbytes, frozenset(request_id_var.get().split(",")))
        else:
            item.release()
            if self.disk is None or not self.disk.holds(mm_hash):
                logger.warning("embeddings %s (%d bytes) do not fit the producer cache; not saved", mm_hash,
                               features.nbytes)
                self.mark_failed([mm_hash])
        self._server.wake()

    def _from_disk(self, mm_hash: str) -> WireItem | None:
        """An item only the disk holds, read back and kept in memory again (served from the heap if it does not
        fit beside the pinned items); None when the disk does not hold it (or its file is unreadable)."""
        assert self.disk is not None
        features = self.disk.load(mm_hash)
        if features is None:
            return None
        item = self._placed(features)
        if self._cache.put(mm_hash, item):
            self._server.wake()  # events of what the put evicted
            return item
        item.release()
        return WireItem(features)

    def _forget(self, mm_hashes: list[str]) -> None:
        """The disk no longer holds these (evicted, unreadable, or never written): tell subscribers."""
        self._cache.forget(mm_hashes)
        self._server.wake()

    def ungathered_bytes(self, exclude: str | None = None) -> int:
        """Bytes of items stored that no get has fetched yet, those of request `exclude` left out (aged out after a
        while; connector/tensors/ungathered.py)."""
        return self._ungathered.nbytes(exclude)

    def _placed(self, features: ImageFeatures) -> WireItem:
        """The item to hold: copied once into its own shared-memory segment, or (shm off, unavailable or full,
        a small item, or one that does not fit the cache at all) as contiguous CPU tensors on the heap."""
        if self._shm_probe is not None and self.shm_min_bytes <= features.nbytes <= self._cache.max_bytes:
            try:
                segment, placed = Segment.place(features)
            except OSError as e:  # ENOSPC, ENOMEM, EMFILE...: this item stays on the heap and goes by socket
                self._num_shm_failures += 1
                logger.warning("no shared memory for %d bytes (%s); the item is held on the heap", features.nbytes, e)
            else:
                self._num_shm_items += 1
                return WireItem(placed, segment)
        embeds = features.embeds.detach().to("cpu").contiguous()
        deepstack = None if features.deepstack is None else features.deepstack.detach().to("cpu").contiguous()
        if embeds is not features.embeds or deepstack is not features.deepstack:
            features = features.with_tensors(embeds, deepstack)
        return WireItem(features)

    def mark_failed(self, mm_hashes: list[str]) -> None:
        """These items will not be stored (bad image, encoder error): gets waiting for them answer now."""
        self._server.mark_failed(mm_hashes)

    def has_cache_item(self, mm_hash: str) -> bool:
        return self._cache.holds(mm_hash)

    def get_cache_item(self, mm_hash: str) -> ImageFeatures | None:
        """The held embeddings (refreshing their recency; read back from the disk when only it has them), or None."""
        held = self._cache.get(mm_hash)
        if held is None and self.disk is not None:
            held = self._from_disk(mm_hash)
        return held.features if held is not None else None

    def position(self) -> tuple[str, int]:
        """(epoch, seq) of the last cache event: a subscriber that has seen it knows everything stored so far."""
        return self.epoch, self._cache.seq

    def stats(self) -> dict[str, Any]:
        """Cache counters plus serving counters (`shm_items_placed`: items stored in shared memory so far,
        `shm_place_failures`: items that fell back to the heap because shared memory was unavailable or full)."""
        disk = self.disk.stats() if self.disk is not None else {}
        return {**self._cache.stats(), **self._server.stats(), **disk, "shm": self._shm_probe is not None,
                "shm_items_placed": self._num_shm_items, "shm_place_failures": self._num_shm_failures,
                "ungathered_bytes": self._ungathered.nbytes(), "ungathered_aged_out": self._ungathered.num_aged_out}

    def close(self) -> None:
        """Stop the serving thread (it closes its own sockets), then drop every held item (closing their
        shared-memory fds; memory a consumer still maps lives until it unmaps)."""
        self._server.close()
        if self.disk is not None:
            self.disk.close()  # writes what is still queued
        self._cache.clear()
        if self._shm_probe is not None:
            self._shm_probe.close()
