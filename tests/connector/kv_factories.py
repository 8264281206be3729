"""Small factories the K/V transfer tests share: a layout, blocks that fill a prompt, a served store, a fake server."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import torch
import zmq

from connector.control.security import CurveConfig
from connector.control.wire import decode_message, encode_message
from connector.tensors.dtypes import DTYPES
from connector.tensors.errors import KVUnavailable
from connector.tensors.kv_checks import MAX_KV_REPLY_BYTES
from connector.tensors.kv_server import KVServer
from connector.tensors.kv_store import KVStore
from epd_contracts.ec import ShmHandle, ShmProbe, ShmProbeReply
from epd_contracts.kv import KVChoice, KVGetRequest, KVLayout

GUARD_S = 10.0  # upper bound on any wait; never reached while the server answers
LAYOUT = KVLayout(fingerprint="f" * 64, num_layers=2, kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
CHOICES = [KVChoice(first_token=7, generator_state=bytes(range(256)) * 20), KVChoice(first_token=9)]
NUM_TOKENS = 10  # a hand-off's prompt: 3 blocks of LAYOUT.block_size 4
Answer = Callable[[KVGetRequest], list[Any]]  # the request -> the frames to send back


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


BLOCKS = make_blocks(LAYOUT, NUM_TOKENS)  # a hand-off's blocks (random, made once)


@contextmanager
def serving(store: KVStore, curve: CurveConfig | None = None,
            max_reply_bytes: int = MAX_KV_REPLY_BYTES) -> Iterator[KVServer]:
    server = KVServer(store, curve=curve, max_reply_bytes=max_reply_bytes).start()
    try:
        yield server
    finally:
        server.close()


@contextmanager
def fake_producer(answer: Answer, probe: ShmHandle | None = None) -> Iterator[str]:
    """A raw ROUTER in a thread answering each kv_get with `answer(request)` (nothing when it returns []), and each
    shared-memory probe with `probe` (None: no shared memory, so clients ask for frames)."""
    sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if sock.poll(50):
                identity, *frames = sock.recv_multipart()
                request, _ = decode_message(frames)
                if isinstance(request, ShmProbe):
                    out = encode_message(ShmProbeReply(req_id=request.req_id, epoch="fake", handle=probe))
                else:
                    assert isinstance(request, KVGetRequest)
                    out = answer(request)
                if out:
                    sock.send_multipart([identity, *out], copy=False)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(GUARD_S)
        sock.close()


def waited_s(error: KVUnavailable) -> float:
    """How long a fetch that got no reply waited for one: the seconds its refusal names ("no reply ... within Xs")."""
    found = re.search(r"no reply from .* within ([0-9.]+)s", error.reason)
    assert found, error.reason
    return float(found[1])
