"""Small factories the K/V transfer tests share: a layout, blocks that fill a prompt, a served store."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import torch

from connector.control.security import CurveConfig
from connector.tensors.frames import DTYPES
from connector.tensors.kv_checks import MAX_KV_REPLY_BYTES
from connector.tensors.kv_server import KVServer
from connector.tensors.kv_store import KVStore
from epd_contracts.kv import KVChoice, KVLayout

GUARD_S = 10.0  # upper bound on any wait; never reached while the server answers
LAYOUT = KVLayout(fingerprint="f" * 64, num_layers=2, kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
CHOICES = [KVChoice(first_token=7, generator_state=bytes(range(256)) * 20), KVChoice(first_token=9)]


def layout(**changes: object) -> KVLayout:
    return msgspec.structs.replace(LAYOUT, **changes)


def make_blocks(lay: KVLayout, num_tokens: int) -> torch.Tensor:
    """Random blocks holding `num_tokens` positions; the last block's tail positions are zeros, as a producer's."""
    num_blocks = -(-num_tokens // lay.block_size)
    blocks = torch.randn(num_blocks, *lay.block_shape).to(DTYPES[lay.dtype])
    tail = num_tokens - (num_blocks - 1) * lay.block_size
    if num_blocks:
        blocks[-1, :, :, :, tail:] = 0
    return blocks


@contextmanager
def serving(store: KVStore, curve: CurveConfig | None = None,
            max_reply_bytes: int = MAX_KV_REPLY_BYTES) -> Iterator[KVServer]:
    server = KVServer(store, curve=curve, max_reply_bytes=max_reply_bytes).start()
    try:
        yield server
    finally:
        server.close()
