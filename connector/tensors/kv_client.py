"""A decode worker's side of the K/V hand-off: fetch a prompt's blocks from its prefill worker, or say why not.

Every failure is one exception, KVUnavailable, raised within the timeout (the decode worker then recomputes the
prefill, so the request never fails for it). Nothing is returned before the reply is checked against what this
worker asked for, its own model's layout: decode_message checks the frames against the reply's layout (count,
byte lengths), the layout must equal the asked one exactly, the counts must agree, and every frame's values must be
finite before it is copied into the one blocks tensor returned (frames are separate buffers: one copy).

Same host: each prefill worker's address is probed once (its probe segment mapped and its tag checked,
connector/tensors/shm_peers.py), and a verified one is asked with `shm`; blocks it holds in shared memory come as a
handle, whose size must be the layout's block bytes times the block count. The blocks returned are then a tensor
over a copy-on-write mapping of the segment (no copy), their values checked finite as a frame's. A handle that
cannot be mapped (the entry freed meanwhile, another host or user, a stale fd) is asked again by socket in the
same fetch, and that address gets frames until its retry is due.

A fetch with `release` then tells the producer it has the blocks (`kv_release`: the producer frees them now, not at
their TTL); that call's failure changes nothing (the TTL frees them) and never fails the fetch.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq

from connector.control.client import ProducerClient, Reply, expect
from connector.control.security import CurveConfig
from connector.control.wire import MAX_KV_FRAMES, MAX_TENSOR_BYTES, WireError, tensor_nbytes
from connector.tensors.dtypes import DTYPES
from connector.tensors.errors import KVUnavailable
from connector.tensors.frames import tensor_buffer
from connector.tensors.kv_checks import MAX_KV_REPLY_BYTES, extent_error, layout_difference
from connector.tensors.shm import ShmError, mapped_tensor, open_handle, probed_pid
from connector.tensors.shm_peers import ShmPeers
from epd_common.tracing import traceparent
from epd_contracts.ec import ErrorReply, Pong, ShmProbe, ShmProbeReply
from epd_contracts.kv import MAX_BLOCKS, MAX_CHOICES, KVChoice, KVGetReply, KVGetRequest, KVLayout, KVRelease

_PROBE_TIMEOUT_S = 2.0  # a prefill worker that does not answer a shared-memory probe in this long is asked by socket
_RELEASE_TIMEOUT_S = 0.5  # a kv_release not answered in this long is left to the producer's TTL

# wire dtype -> (the unsigned integer of its width, +inf's bits): a value is NaN or infinite exactly when its bits,
# the sign cleared, are at least +inf's (its exponent all ones)
_INF_BITS: dict[str, tuple[type[np.unsignedinteger[Any]], int]] = {
    "bfloat16": (np.uint16, 0x7F80), "float16": (np.uint16, 0x7C00),
    "float32": (np.uint32, 0x7F80_0000), "float64": (np.uint64, 0x7FF0_0000_0000_0000),
}


@dataclass(frozen=True, eq=False)
class KVFetched:
    """A hand-off's blocks from `first_block` on (block i of the prompt is `blocks[i - first_block]`)."""

    num_tokens: int
    num_blocks: int
    first_block: int
    blocks: torch.Tensor = field(repr=False)  # CPU (num_blocks - first_block, *layout.block_shape), layout's dtype
    choices: list[KVChoice]
    shm: bool = False  # the blocks came by shared-memory handle (else by frames)


class KVClient:
    """Fetches hand-offs over pooled DEALER sockets (connector/control/client.py); thread-safe."""

    def __init__(self, curve: CurveConfig | None = None, max_message_bytes: int = MAX_TENSOR_BYTES,
                 max_reply_bytes: int = MAX_KV_REPLY_BYTES, shm: bool = True) -> None:
        """`max_message_bytes` bounds each block (a frame or a mapped one), `max_reply_bytes` all of one reply's;
        `shm`: map the blocks of same-host prefill workers that pass a probe; False: socket only."""
        self.max_message_bytes, self.max_reply_bytes = max_message_bytes, max_reply_bytes
        self._client = ProducerClient(curve, max_message_bytes, max_reply_bytes, MAX_KV_FRAMES)
        self._peers = ShmPeers(shm)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("shm_fetches", "socket_fetches", "shm_fallbacks", "shm_probes", "releases",
                                      "release_failures"), 0)

    def fetch(self, address: str, key: str, layout: KVLayout, first_block: int = 0,
              timeout: float = 10.0, release: bool = False) -> KVFetched:
        """The blocks of hand-off `key` from `first_block` on, for a model of `layout`; KVUnavailable otherwise.
        `release`: once they are here (copied, or mapped), the producer is told to free them (`release`)."""
        deadline = time.monotonic() + timeout
        if self._peers.to_probe((address,)):
            self._probe(address, min(timeout, _PROBE_TIMEOUT_S))
        pid = self._peers.pid(address)
        got: KVFetched | None = None
        if pid is not None:
            try:
                got = self._fetch(address, key, layout, first_block, deadline, pid)
            except ShmError as e:  # asked again by socket, now and until the retry is due
                self._peers.failed(address, str(e))
                self._count("shm_fallbacks")
        if got is None:
            got = self._fetch(address, key, layout, first_block, deadline, None)
        if release:
            self.release(address, key)
        return got

    def release(self, address: str, key: str, timeout: float = _RELEASE_TIMEOUT_S) -> bool:
        """Tell the producer at `address` this worker has hand-off `key` (it frees the blocks now); whether it
        answered. A failure is counted, never raised: the producer's TTL frees them anyway."""
        try:
            reply = self._client.exchange_one(address, KVRelease(req_id=self._client.next_req_id(), key=key), timeout)
            expect(reply, Pong, address)
        except (WireError, zmq.ZMQError):
            self._count("release_failures")
            return False
        self._count("releases")
        return True

    def stats(self) -> dict[str, int]:
        """Fetches answered by handle and by frames, handles that fell back to the socket, probes sent, releases
        answered and not."""
        with self._lock:
            return {**self._counts, "shm_producers": self._peers.num_mapped()}

    def close(self) -> None:
        self._client.close()

    def _fetch(self, address: str, key: str, layout: KVLayout, first_block: int, deadline: float,
               pid: int | None) -> KVFetched:
        """One kv_get, with `shm` when `pid` (the probed producer's) is known; ShmError for a handle not mapped."""
        request = KVGetRequest(req_id=self._client.next_req_id(), key=key, layout=layout, first_block=first_block,
                               shm=pid is not None, traceparent=traceparent())
        timeout = round(max(0.0, deadline - time.monotonic()), 3)  # what is left of the fetch's
        try:
            reply = self._client.exchange_one(address, request, timeout)
        except zmq.ZMQError as e:
            raise KVUnavailable(f"cannot reach {address}: {e}") from e
        header, buffers = _checked(reply, request, address, timeout)
        if header.shm is None:
            blocks = _blocks(layout, first_block, buffers)
        else:
            assert pid is not None, "_checked refuses a handle not asked for"
            blocks = _mapped(header, layout, pid, self.max_message_bytes, self.max_reply_bytes)
        self._count("socket_fetches" if header.shm is None else "shm_fetches")
        return KVFetched(num_tokens=header.num_tokens, num_blocks=header.num_blocks, first_block=header.first_block,
                         blocks=blocks, choices=list(header.choices), shm=header.shm is not None)

    def _probe(self, address: str, timeout: float) -> None:
        """Ask for the server's probe segment and map it: only a server that passes gets `shm` gets."""
        self._count("shm_probes")
        try:
            reply = self._client.exchange_one(address, ShmProbe(req_id=self._client.next_req_id()), timeout)
            pid = probed_pid(expect(reply, ShmProbeReply, address).handle)
        except (WireError, ShmError, zmq.ZMQError) as e:
            self._peers.failed(address, str(e))
        else:
            self._peers.verified(address, pid)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1


def _checked(reply: Reply | None, request: KVGetRequest, address: str,
             timeout: float) -> tuple[KVGetReply, list[memoryview]]:
    """The reply if it answers `request` with blocks that fit its layout; KVUnavailable naming why not."""
    if reply is None:
        raise KVUnavailable(f"no reply from {address} within {timeout}s (down, unreachable, or refusing our key)")
    header, buffers = reply
    if isinstance(header, ErrorReply):
        raise KVUnavailable(f"error from {address}: {header.message[:512]}")
    if not isinstance(header, KVGetReply) or header.req_id != request.req_id or header.key != request.key:
        raise KVUnavailable(f"{address} answered another request ({type(header).__name__} {header.req_id})")
    if not header.found:
        raise KVUnavailable(f"{address} has no {request.key!r}: {header.error[:512] or 'not found'}")
    if header.shm is not None and not request.shm:
        raise KVUnavailable(f"bad kv_reply from {address}: a shared-memory handle this client did not ask for")
    if error := _reply_error(header, request, len(buffers)):
        raise KVUnavailable(f"bad kv_reply from {address}: {error}")
    return header, buffers


def _reply_error(header: KVGetReply, request: KVGetRequest, num_frames: int) -> str:
    """Why a found reply does not fit `request` ("" when it does)."""
    layout = request.layout
    if header.layout != layout:
        return f"layout differs: {layout_difference(layout, header.layout)}"
    if header.first_block != request.first_block:
        return f"blocks from {header.first_block}, asked from {request.first_block}"
    if not header.first_block <= header.num_blocks <= MAX_BLOCKS:
        return f"first_block {header.first_block} of {header.num_blocks} block(s)"
    if error := extent_error(layout, header.num_tokens, header.num_blocks):
        return error
    if not 1 <= len(header.choices) <= MAX_CHOICES:
        return f"{len(header.choices)} choice(s), not 1 to {MAX_CHOICES}"
    # NOTE: decode_message checked the frames against the reply's layout, just found equal to ours (and that a reply
    # by handle has none); asserted again
    num_sent = header.num_blocks - header.first_block
    assert num_frames == (0 if header.shm is not None else num_sent), "decode_message checks the kv frame count"
    return ""


def _blocks(layout: KVLayout, first_block: int, buffers: list[memoryview]) -> torch.Tensor:
    """The blocks as one CPU tensor, each frame checked finite before it is copied in."""
    out = torch.empty((len(buffers), *layout.block_shape), dtype=DTYPES[layout.dtype])
    view = tensor_buffer(out)
    size = view.nbytes // len(buffers) if buffers else 0  # every frame's length, checked by decode_message
    for i, buf in enumerate(buffers):
        _check_finite(buf, layout.dtype, first_block + i)
        view[i * size:(i + 1) * size] = buf  # a memcpy on this thread
    return out


def _mapped(header: KVGetReply, layout: KVLayout, pid: int, max_block_bytes: int, max_bytes: int) -> torch.Tensor:
    """The blocks from `first_block` on, over a copy-on-write mapping of the handle's segment (no copy), each block
    checked finite; ShmError when the handle cannot be mapped (then ask by socket)."""
    assert header.shm is not None
    try:
        block_nbytes = tensor_nbytes(layout.dtype, layout.block_shape, max_block_bytes)
    except WireError as e:
        raise KVUnavailable(f"bad kv_reply: {e}") from None
    num_sent = header.num_blocks - header.first_block
    if num_sent * block_nbytes > max_bytes:
        raise KVUnavailable(f"bad kv_reply: {num_sent * block_nbytes} bytes of blocks, over the {max_bytes}-byte cap")
    # the segment holds all num_blocks blocks after its tag: its size is checked against them before it is opened
    mapping = open_handle(header.shm, pid, header.num_blocks * block_nbytes)
    out = mapped_tensor(mapping, header.first_block * block_nbytes, layout.dtype, [num_sent, *layout.block_shape])
    view = tensor_buffer(out)
    for i in range(num_sent):
        _check_finite(view[i * block_nbytes:(i + 1) * block_nbytes], layout.dtype, header.first_block + i)
    return out


def _check_finite(buf: memoryview, dtype: str, block: int) -> None:
    if not _finite(buf, dtype):
        raise KVUnavailable(f"block {block} has non-finite values")


def _finite(buf: memoryview, dtype: str) -> bool:
    """Whether every value in a frame is finite (integers always are), read from the bits.

    NOTE: numpy on this thread, not torch: `torch.isfinite(...).all()` on bfloat16 blocks is ~10x slower on CPU and
    runs in torch's thread pool, which a concurrent engine step may hold."""
    if dtype not in _INF_BITS:
        return True
    uint, inf = _INF_BITS[dtype]
    bits = np.frombuffer(buf, dtype=uint)
    return int(np.bitwise_and(bits, np.iinfo(uint).max >> 1).max()) < inf
