"""Headers of the encoder-cache (EC) connector: producer requests, their replies, and published cache events.

Each is a msgspec Struct tagged by `op` and travels msgpack-encoded after the magic+version prefix
(connector/control/wire.py frames it; tensor frames follow a `get_reply`). Field types and bounds are
checked on decode, so a handler never sees a malformed header. The unions also carry the K/V hand-off's
`kv_get`/`kv_reply`/`kv_release` (epd_contracts/kv.py), as every connector op travels the same wire. Torch-free:
every process imports it.
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from epd_contracts.header import DTYPE_SIZES as DTYPE_SIZES
from epd_contracts.header import MAX_TOKEN_ID as MAX_TOKEN_ID
from epd_contracts.header import SHM_TAG_BYTES as SHM_TAG_BYTES
from epd_contracts.header import DType, NonNegative, TokenId, _Header
from epd_contracts.header import ShmHandle as ShmHandle
from epd_contracts.kv import KVGetReply, KVGetRequest, KVRelease

MAX_WAIT_MS = 60_000  # the longest a producer holds a `get` for items still encoding
MAX_HASH_LEN = 256  # characters of one mm_hash on the wire (real ones are 64)
MAX_NDIM = 8
MAX_SPAN_IDS = 1 << 17  # token ids of one image's span (a 4k image in the largest layouts is ~20k)
HEARTBEAT_S = 0.5  # an idle producer still publishes its last seq this often

Hash = Annotated[str, msgspec.Meta(max_length=MAX_HASH_LEN)]
Shape = Annotated[list[NonNegative], msgspec.Meta(max_length=MAX_NDIM)]
Span = Annotated[list[TokenId], msgspec.Meta(max_length=MAX_SPAN_IDS)]
MAX_SECOND_PER_GRID_T = 1e6  # a video's seconds per temporal patch; finite and > 0 (NaN and inf are refused)
SecondsPerPatch = Annotated[float, msgspec.Meta(gt=0, le=MAX_SECOND_PER_GRID_T)]
EventKind = Literal["stored", "evicted", "heartbeat"]


# requests a producer serves


class GetRequest(_Header, tag="get"):
    """Embeddings by mm_hash; items in `wait` may still be encoding, and the producer holds the reply up to
    `wait_ms` (capped at MAX_WAIT_MS) for them. `shm`: the consumer has probed this producer (ShmProbe) and
    maps its shared memory, so found items held there may be answered with a handle instead of frames."""

    hashes: list[Hash]
    wait: list[Hash] = []
    wait_ms: NonNegative = 0
    shm: bool = False
    # the consumer's span (W3C traceparent) when tracing is on: the producer's `ec.get` span is its child
    traceparent: Annotated[str, msgspec.Meta(max_length=64)] = ""


class ShmProbe(_Header, tag="shm_probe"):
    """Can this consumer map the producer's shared memory? Answered by a ShmProbeReply with a probe segment."""


class HasRequest(_Header, tag="has"):
    hashes: list[Hash]


class PingRequest(_Header, tag="ping"):
    pass


class SnapshotRequest(_Header, tag="snapshot"):
    pass


# replies


class GetItem(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True, kw_only=True):
    """One requested item; a found one describes its tensor frames (`frame`, `deepstack_frame` index the frames
    after the header; both tensors have `dtype`), or, answering a `shm` get, the shared-memory segment holding
    both (`shm`, and no frames). `span`: the image's prompt tokens (ImageFeatures.span);
    `second_per_grid_t`: set for a video only (ImageFeatures.second_per_grid_t), omitted for an image."""

    mm_hash: Hash
    found: bool = False
    failed: bool = False  # encoding failed: asking again will not help
    more: bool = False  # held, but left out for the reply's byte limit: ask again
    num_tokens: NonNegative | None = None
    grid_thw: tuple[int, int, int] | None = None
    dtype: DType | None = None
    shape: Shape | None = None
    frame: NonNegative | None = None
    span: Span | None = None
    deepstack_shape: Shape | None = None
    deepstack_frame: NonNegative | None = None
    second_per_grid_t: SecondsPerPatch | None = None
    shm: ShmHandle | None = None


class GetReply(_Header, tag="get_reply"):
    items: list[GetItem]


class HasReply(_Header, tag="has_reply"):
    has: list[bool]


class Pong(_Header, tag="pong"):
    pass


class SnapshotReply(_Header, tag="snapshot_reply"):
    """Everything a producer holds, as of event `seq` of `epoch`."""

    epoch: str
    seq: NonNegative
    hashes: list[Hash]


class ShmProbeReply(_Header, tag="shm_probe_reply"):
    """The producer's probe segment (no payload: its size is SHM_TAG_BYTES), or None when its shared memory is
    off or unavailable. A consumer that maps it and finds the tag asks for handles from then on."""

    epoch: str
    handle: ShmHandle | None = None


class ErrorReply(_Header, tag="error"):
    message: str


# published on the producer's PUB socket, never requested


class CacheEvent(_Header, tag="event", kw_only=True):
    """A store or eviction, numbered per producer epoch; `heartbeat` repeats the last seq with no hashes."""

    req_id: int = 0
    producer: str
    epoch: str
    seq: NonNegative
    kind: EventKind
    hashes: list[Hash]


Request = (GetRequest | HasRequest | PingRequest | SnapshotRequest | ShmProbe
           | KVGetRequest | KVRelease)  # kv_get, kv_release: epd_contracts/kv.py
Reply = GetReply | HasReply | Pong | SnapshotReply | ShmProbeReply | ErrorReply | KVGetReply
Message = Request | Reply | CacheEvent
