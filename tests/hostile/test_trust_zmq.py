"""The ZeroMQ data plane: without an allowed CURVE key a client gets nothing (get, has, snapshot, events), and a
consumer refuses replies whose sizes are over its caps or disagree with what they declare, with memory bounded."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import zmq

from connector.control.security import CurveConfig, secure_client
from connector.control.wire import decode_message
from connector.tensors.consumer import ECConsumer
from connector.tensors.errors import MissingEmbeddings
from connector.tensors.producer import ECProducer
from epd_contracts.ec import CacheEvent, Message
from epd_contracts.embeddings import ImageFeatures
from tests.e2e.stack import ROOT
from tests.hostile.memory import peak_rss_bytes, rss_bytes

GUARD_S = 10.0
REFUSED_TIMEOUT_S = 0.5  # how long a refused client waits before it gives up (nothing ever arrives)
HUGE = 192 << 20  # what the fake producer sends
CONSUMER_PEAK_BOUND = 96 << 20  # the consumer's peak RSS may grow at most this much while refusing HUGE replies


def pair() -> tuple[bytes, bytes]:
    public, secret = zmq.curve_keypair()
    return public, secret


@pytest.fixture
def secured() -> Iterator[tuple[ECProducer, CurveConfig]]:
    """A producer with CURVE and an allow-list holding one item; yields it and an allowed client's keys."""
    (spub, ssec), (cpub, csec) = pair(), pair()
    producer = ECProducer(curve=CurveConfig(ssec, spub, allowed_clients=frozenset({cpub}))).start()
    producer.save_caches("x", ImageFeatures(torch.ones(2, 4)))
    yield producer, CurveConfig(csec, cpub, server_key=spub)
    producer.close()


def strangers(server_key: bytes) -> dict[str, CurveConfig | None]:
    public, secret = pair()
    return {"plaintext": None, "unlisted_key": CurveConfig(secret, public, server_key=server_key)}


def test_a_client_without_an_allowed_key_can_neither_get_has_snapshot_nor_hear_events(
        secured: tuple[ECProducer, CurveConfig]) -> None:
    producer, allowed = secured
    assert allowed.server_key is not None
    subscribers = {name: subscriber(producer.events_address, curve)
                   for name, curve in {**strangers(allowed.server_key), "allowed": allowed}.items()}
    try:
        for name, curve in strangers(allowed.server_key).items():
            consumer = ECConsumer(cache_bytes=0, curve=curve)
            try:
                with pytest.raises(MissingEmbeddings):
                    consumer.gather(["x"], {"x": producer.address}, timeout=REFUSED_TIMEOUT_S)
                assert consumer.query(producer.address, ["x"], timeout=REFUSED_TIMEOUT_S) == [False], name
                assert consumer.snapshot(producer.address, timeout=REFUSED_TIMEOUT_S) is None, name
                assert not consumer.ping(producer.address, timeout=REFUSED_TIMEOUT_S), name
            finally:
                consumer.close()
        assert producer.stats()["gets_served"] == 0
        # events: the allowed subscriber hears heartbeats and a new store; the others hear nothing at all
        producer.save_caches("y", ImageFeatures(torch.ones(1, 4)))
        heard = drain(subscribers, until=lambda got: any(stored(e) for e in got["allowed"]))
        assert any(stored(e) and e.hashes == ["y"] for e in heard["allowed"])
        assert heard["plaintext"] == [] and heard["unlisted_key"] == []
        good = ECConsumer(cache_bytes=0, curve=allowed)  # and the allowed client gets everything
        try:
            assert good.snapshot(producer.address, timeout=GUARD_S) is not None
            assert good.query(producer.address, ["x", "y"], timeout=GUARD_S) == [True, True]
            assert torch.equal(good.gather(["x"], {"x": producer.address}, GUARD_S)["x"].embeds, torch.ones(2, 4))
        finally:
            good.close()
    finally:
        for sock in subscribers.values():
            sock.close(linger=0)


def subscriber(address: str, curve: CurveConfig | None) -> zmq.Socket[Any]:
    sock = zmq.Context.instance().socket(zmq.SUB)
    secure_client(sock, curve)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(address)
    return sock


def stored(event: Message) -> bool:
    return isinstance(event, CacheEvent) and event.kind == "stored"


def drain(subs: dict[str, zmq.Socket[Any]], until: Any) -> dict[str, list[Any]]:
    """Read every subscriber until `until(got)` holds (or the guard deadline), then a last non-blocking sweep."""
    got: dict[str, list[Any]] = {name: [] for name in subs}
    deadline = time.monotonic() + GUARD_S
    poller = zmq.Poller()
    for sock in subs.values():
        poller.register(sock, zmq.POLLIN)
    names = {sock: name for name, sock in subs.items()}
    while time.monotonic() < deadline and not until(got):
        for sock, _ in poller.poll(100):
            got[names[sock]].append(decode_message(sock.recv_multipart())[0])
    for name, sock in subs.items():
        while sock.poll(0):
            got[name].append(decode_message(sock.recv_multipart())[0])
    return got


# --- a hostile producer ----------------------------------------------------------------------------------

FAKE_PRODUCER = r"""
import sys, msgpack, zmq
MAGIC_VERSION = b"EPDC" + bytes([3])  # connector.control.wire's, without importing the connector
mode, huge = sys.argv[1], int(sys.argv[2])
sock = zmq.Context.instance().socket(zmq.ROUTER)
port = sock.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
blob = bytearray(huge)
while True:
    ident, *frames = sock.recv_multipart()
    header = msgpack.unpackb(frames[0][len(MAGIC_VERSION):], raw=False)
    h = header["hashes"][0]
    def item(shape, frame):
        return {"mm_hash": h, "found": True, "num_tokens": shape[0], "grid_thw": None, "dtype": "uint8",
                "shape": shape, "frame": frame}
    if mode == "one_huge_frame":        # one frame over the consumer's per-frame cap
        items, frames = [item([huge, 1], 0)], [blob]
    elif mode == "many_frames":         # every frame under the frame cap, together over the reply cap
        n = 16
        items, frames = [item([huge // n, 1], i) for i in range(n)], [memoryview(blob)[: huge // n]] * n
    else:                               # declares 4 bytes, sends a frame under the frame cap but far larger
        items, frames = [item([4, 1], 0)], [memoryview(blob)[: huge // 16]]
    reply = {"op": "get_reply", "req_id": header["req_id"], "items": items}
    sock.send_multipart([ident, MAGIC_VERSION + msgpack.packb(reply, use_bin_type=True), *frames], copy=False)
"""


@contextmanager
def fake_producer(mode: str, nbytes: int) -> Iterator[str]:
    """A producer in a child process (its memory is not ours) answering every get in the hostile `mode`."""
    proc = subprocess.Popen([sys.executable, "-c", FAKE_PRODUCER, mode, str(nbytes)], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None
        port = proc.stdout.readline().strip()  # printed once bound: the readiness signal
        assert port.isdigit(), f"fake producer failed to start (exit {proc.poll()})"
        yield f"tcp://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def reset_peak_rss() -> None:
    """Make VmHWM start again from the current RSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@pytest.mark.parametrize("mode", ["one_huge_frame", "many_frames", "lies_about_size"])
def test_consumer_refuses_oversized_or_mislabelled_replies_with_memory_bounded(mode: str) -> None:
    consumer = ECConsumer(max_message_bytes=32 << 20, max_reply_bytes=64 << 20)
    try:
        with fake_producer(mode, HUGE) as address:
            reset_peak_rss()
            base = rss_bytes()
            with pytest.raises(MissingEmbeddings):
                consumer.gather(["x"], {"x": address}, timeout=2.0 if mode == "one_huge_frame" else GUARD_S)
            assert not consumer.has_cache_item("x")
            if mode == "one_huge_frame":  # libzmq drops the peer from the frame's size prefix: never allocated
                assert peak_rss_bytes() - base < CONSUMER_PEAK_BOUND
            # NOTE: libzmq delivers a multipart message whole, so a reply of many frames under the frame cap is
            # held once before it is judged; it is refused before any tensor is built and freed at once
            assert rss_bytes() - base < CONSUMER_PEAK_BOUND
        ok = ECProducer().start()  # and the consumer still works
        try:
            ok.save_caches("x", ImageFeatures(torch.ones(2, 4)))
            assert torch.equal(consumer.gather(["x"], {"x": ok.address}, GUARD_S)["x"].embeds, torch.ones(2, 4))
        finally:
            ok.close()
    finally:
        consumer.close()
