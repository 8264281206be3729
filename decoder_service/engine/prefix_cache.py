"""The decoder's prefix cache: K/V of prompt prefixes in blocks of `block_size` tokens, reused by later requests.

Blocks are keyed by `decoder_service.engine.prefix_hash` (a hash chain over tokens, images by `mm_hash`, per salt). On
admission the longest chain of held blocks is COPIED into the sequence's slot (`load`) and only the rest of the
prompt is prefilled; a prefilled prompt, and a sequence that finishes, give their full blocks (`store`).

Copy, not share: a slot is preallocated at the full context length, so sharing blocks would save no memory, and
this attention reads each row's K/V as one contiguous view; a shared prefix would have to be gathered in front of
the row at every forward. Copying P tokens once cost 0.09-0.9 of what gathering them costs at ONE decode step
here (`python -m epd_bench.prefix_share`; P = 1024 on the bench LM: 0.77 ms once against 8.5 ms per step), and
prefilling them again 80-370x the copy: copying wins from the first generated token on.

Memory: byte-bounded LRU (`capacity` bytes, allocated block by block as used). A chain's blocks are touched
leaf first, so its root is the most recent: pressure evicts the ends of chains before the prefixes they share.
The blocks of the chain being loaded or stored are pinned for that call (the engine thread does both in one go:
no block is in use between calls). Engine thread only, except `summary()` and `stats()` (under the lock).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from decoder_service.engine.slots import SlotCache

MAX_ROUTE_KEYS = 4096  # the proxy's prefix keys reported in /health, most recent first


class PrefixCache:
    def __init__(self, slots: SlotCache, capacity: int, block_size: int):
        self.slots, self.capacity, self.block_size = slots, capacity, block_size
        k = slots.slot_layers[0].keys
        assert k is not None
        _, self.heads, _, self.head_dim = k.shape
        self.num_layers = len(slots.slot_layers)
        self.block_shape = (self.num_layers, 2, self.heads, block_size, self.head_dim)
        self.block_bytes = self.num_layers * 2 * self.heads * block_size * self.head_dim * k.element_size()
        self.blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # LRU first
        self.routes: OrderedDict[str, bytes] = OrderedDict()  # proxy prefix key -> the deepest block it came with
        self.hits = self.misses = self.evicted = self.tokens_saved = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.block_bytes

    def match(self, keys: Sequence[bytes]) -> int:
        """How many of the chain's leading blocks are held."""
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        return n

    @torch.inference_mode()
    def load(self, slot: int, keys: Sequence[bytes]) -> None:
        """Copy the held blocks `keys` (a chain's first ones) into the slot's columns [0, len(keys) * block_size)."""
        if not keys:
            return
        n, b = len(keys), self.block_size
        with self._lock:
            stacked = torch.stack([self.blocks[k] for k in keys])  # (n, layers, 2, heads, block, head_dim)
            self._touch(keys)
        for i, layer in enumerate(self.slots.slot_layers):
            for j, dst in enumerate((layer.keys, layer.values)):
                assert dst is not None
                dst[slot, :, : n * b].view(self.heads, n, b, self.head_dim).copy_(stacked[:, i, j].transpose(0, 1))
        self.slots.dirty[slot] = max(self.slots.dirty[slot], n * b)

    @torch.inference_mode()
    def store(self, slot: int, keys: Sequence[bytes]) -> int:
        """Keep the slot's blocks named `keys` (its chain from block 0; columns already written); returns how many
        of the chain are held now. Blocks held already are only touched; storing stops at the first block that
        finds no room (its descendants could never be matched)."""
        b = self.block_size
        with self._lock:
            first = end = self.match(keys)
            pinned = set(keys)
            while end < len(keys) and self._make_room(pinned, end - first):
                end += 1
        if end > first:  # the new blocks' columns in one copy per layer, then one contiguous tensor per block
            cols = slice(first * b, end * b)
            fresh = torch.stack([torch.stack((layer.keys[slot, :, cols], layer.values[slot, :, cols]))  # type: ignore[index]
                                 for layer in self.slots.slot_layers])  # (layers, 2, heads, (end - first) * b, head_dim)
            with self._lock:
                for i in range(end - first):
                    self.blocks[keys[first + i]] = fresh[:, :, :, i * b : (i + 1) * b].clone()
        with self._lock:
            self._touch(keys[:end])
        return end

    def note_routes(self, route_keys: Sequence[str], block: bytes) -> None:
        """The proxy's keys of a request whose K/V is held up to `block`: reported while that block stays."""
        with self._lock:
            for key in route_keys:
                self.routes[key] = block
                self.routes.move_to_end(key)
            while len(self.routes) > MAX_ROUTE_KEYS:
                self.routes.popitem(last=False)

    def record(self, reused_tokens: int) -> None:
        """One admitted prompt: a hit if it reused any tokens."""
        if reused_tokens:
            self.hits += 1
            self.tokens_saved += reused_tokens
        else:
            self.misses += 1

    def summary(self) -> dict[str, object]:
        """For /health: what is held, and the proxy's keys whose K/V is still here (most recent first)."""
        with self._lock:
            keys = [k for k, block in reversed(self.routes.items()) if block in self.blocks]
            return {"enabled": True, "block_size": self.block_size, "bytes": self.nbytes,
                    "capacity_bytes": self.capacity, "blocks": len(self.blocks), "keys": keys}

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "evicted_blocks": self.evicted,
                "tokens_saved": self.tokens_saved, "bytes": self.nbytes}

    def _make_room(self, pinned: set[bytes], pending: int) -> bool:
        """Evict least recently used blocks (not `pinned`) until one more block fits beside `pending` ones about
        to be stored; False if it cannot."""
        while self.nbytes + (pending + 1) * self.block_bytes > self.capacity:
            victim = next((k for k in self.blocks if k not in pinned), None)
            if victim is None:
                return False
            del self.blocks[victim]
            self.evicted += 1
        return True

    def _touch(self, keys: Sequence[bytes]) -> None:
        for k in reversed(keys):  # leaf first: the root ends most recent
            if k in self.blocks:
                self.blocks.move_to_end(k)
