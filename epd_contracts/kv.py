"""K/V hand-off from a prefill worker to a decode worker (E -> P -> D): what the blocks are and how they are asked for.

Torch-free. A prefill worker (`epd-decoder --role prefill`) prefills a prompt, samples each choice's first token and
keeps the prompt's K/V blocks under a hand-off `key` for a while; the decode worker that continues the request
fetches them with a `KVGetRequest` on the connector wire (connector/control/wire.py framing, CURVE as every
connector link) and gets a `KVGetReply` followed by one raw frame per block.

Every block is one tensor of `KVLayout.block_shape`: (num_layers, 2 [K, V], kv_heads, block_size, head_dim) in the
layout's dtype, whatever the producer's pool layout on its device. Block i holds the prompt's positions
[i * block_size, (i + 1) * block_size); the last block may be partial (its tail positions are zeros). A consumer
that holds the prompt's first blocks already (its prefix cache, under the same chain keys) asks from `first_block`
and gets only the rest. The consumer checks the reply against the layout it expects (its own model) before it
builds a tensor: every declared size, the frame count and lengths, and then the values (finite).

Same host: a consumer that has probed the producer (ec.py ShmProbe, answered with a probe segment it could map)
asks with `shm`, and a hand-off the producer holds in shared memory is answered with its segment's handle instead
of frames. The segment holds all `num_blocks` blocks back to back after the tag, so block i starts at byte
i * (the bytes of one block of `layout`) past the tag; the consumer checks the handle's size against the layout and
the block count, maps it copy-on-write and checks the tag, then the values, as for frames.
"""
from __future__ import annotations

from typing import Annotated

import msgspec

from epd_contracts.header import DType, NonNegative, ShmHandle, TokenId, _Header

MAX_KV_KEY_LEN = 128
MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_BLOCK_SIZE = 4096
MAX_BLOCKS = 1 << 17  # blocks one hand-off may have: 2M positions at block size 16
MAX_CHOICES = 128  # n of one request (the OpenAI maximum)
MAX_GENERATOR_STATE = 1 << 14  # bytes of one torch.Generator state (CPU: 5,056; CUDA: 16)

KVKey = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KV_KEY_LEN, pattern=r"^[A-Za-z0-9_.:-]+$")]


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The K/V of one model, as a block of it travels. `fingerprint`: the checkpoint's (epd_models/identity.py
    model_identity), so blocks never reach a worker of another model."""

    fingerprint: Annotated[str, msgspec.Meta(max_length=64)]
    num_layers: Annotated[int, msgspec.Meta(ge=1, le=MAX_LAYERS)]
    kv_heads: Annotated[int, msgspec.Meta(ge=1, le=MAX_KV_HEADS)]
    head_dim: Annotated[int, msgspec.Meta(ge=1, le=MAX_HEAD_DIM)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
    dtype: DType

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return self.num_layers, 2, self.kv_heads, self.block_size, self.head_dim


class KVChoice(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One choice's state after its first token: the token, and its sampler's generator state (a seeded choice
    continues with the same draws; empty for greedy)."""

    first_token: TokenId
    generator_state: Annotated[bytes, msgspec.Meta(max_length=MAX_GENERATOR_STATE)] = b""


class KVGetRequest(_Header, tag="kv_get"):
    """The hand-off `key`'s blocks from `first_block` on, for a consumer whose model is `layout`. `shm`: the consumer
    has probed this producer and maps its shared memory, so blocks held there may be answered by handle."""

    key: KVKey
    layout: KVLayout
    first_block: Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCKS)] = 0
    shm: bool = False
    # the decode worker's `kv.get` span (W3C traceparent) when tracing is on: the server's `kv.serve` is its child
    traceparent: Annotated[str, msgspec.Meta(max_length=64)] = ""


class KVRelease(_Header, tag="kv_release"):
    """The consumer has the hand-off `key`'s blocks (copied out of frames, or its own mapping of their segment): the
    producer frees them now instead of at their TTL. Answered with a Pong, for a key not held too."""

    key: KVKey


class KVGetReply(_Header, tag="kv_reply"):
    """Found: `num_tokens` prompt positions in `num_blocks` blocks, of which blocks `first_block`.. follow as frames
    (one each, `layout.block_shape`), or, answering a `shm` get, are in the segment of `shm` (all `num_blocks`
    blocks after its tag; no frames); the choices' first tokens and sampler states. Not found (expired, never
    there, or a layout that is not the producer's): `found` false and `error` says which."""

    key: KVKey
    found: bool = False
    error: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    layout: KVLayout | None = None
    num_tokens: NonNegative = 0
    num_blocks: Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCKS)] = 0
    first_block: Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCKS)] = 0
    choices: Annotated[list[KVChoice], msgspec.Meta(max_length=MAX_CHOICES)] = []
    shm: ShmHandle | None = None
