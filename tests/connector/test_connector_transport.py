"""Producer and consumer talking over TCP loopback, including misbehaving peers."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import msgpack
import pytest
import torch
import zmq

from connector.control.wire import MAGIC_VERSION, decode_message, encode_message
from connector.tensors.consumer import ECConsumer
from connector.tensors.errors import MissingEmbeddings
from connector.tensors.producer import ECProducer
from epd_contracts.ec import ErrorReply, GetRequest, HasReply, Pong
from epd_contracts.embeddings import ImageFeatures

GUARD_MS = 5000  # upper bound on any wait in these tests; never reached when things work




def save(producer: ECProducer, mm_hash: str, embeds: torch.Tensor, grid: tuple[int, int, int] | None = None) -> ImageFeatures:
    out = ImageFeatures(embeds, grid)
    producer.save_caches(mm_hash, out)
    return out


def unbound_address() -> str:
    """A loopback endpoint nobody listens on."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(linger=0)
    return f"tcp://127.0.0.1:{port}"


def run_fake_producer(handle: Callable[[zmq.Socket, list[bytes]], None], num_requests: int) -> tuple[str, threading.Thread]:
    """A ROUTER in a thread that passes each of `num_requests` requests to `handle`."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def serve() -> None:
        try:
            for _ in range(num_requests):
                if not sock.poll(GUARD_MS):
                    return
                handle(sock, sock.recv_multipart())
        finally:
            sock.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"tcp://127.0.0.1:{port}", thread


def test_gather_returns_identical_tensors_and_grid_thw(producer: ECProducer, consumer: ECConsumer) -> None:
    a = save(producer, "a", torch.randn(7, 32).to(torch.bfloat16), (1, 14, 2))
    b = save(producer, "b", torch.randn(3, 16).T)  # non-contiguous in, contiguous out
    got = consumer.gather(["a", "b"], {"a": producer.address, "b": producer.address}, timeout=GUARD_MS / 1000)
    assert list(got) == ["a", "b"]
    for h, want in (("a", a), ("b", b)):
        assert got[h].embeds.dtype == want.embeds.dtype
        assert torch.equal(got[h].embeds, want.embeds)
        assert got[h].grid_thw == want.grid_thw
    assert producer.stats()["gets_served"] == 1 and consumer.stats()["bytes_received"] == a.nbytes + b.nbytes


def test_second_gather_is_served_from_local_cache(producer: ECProducer, consumer: ECConsumer) -> None:
    save(producer, "a", torch.randn(4, 8))
    sources = {"a": producer.address}
    first = consumer.gather(["a"], sources)
    second = consumer.gather(["a"], sources)
    assert torch.equal(first["a"].embeds, second["a"].embeds)
    assert consumer.stats()["remote_fetches"] == 1 and consumer.stats()["hits"] == 1
    assert producer.stats()["gets_served"] == 1 and consumer.has_cache_item("a")


def test_gather_of_unknown_hash_names_it(producer: ECProducer, consumer: ECConsumer) -> None:
    save(producer, "known", torch.randn(2, 4))
    with pytest.raises(MissingEmbeddings, match="unknown") as info:
        consumer.gather(["known", "unknown"], {"known": producer.address, "unknown": producer.address})
    assert info.value.missing == ["unknown"]
    assert consumer.has_cache_item("known")  # what was found is still kept


def test_gather_without_source_raises(consumer: ECConsumer) -> None:
    with pytest.raises(MissingEmbeddings) as info:
        consumer.gather(["orphan"], {})
    assert info.value.missing == ["orphan"]


def test_gather_from_dead_source_raises_at_its_timeout(consumer: ECConsumer) -> None:
    """A gather from an address nobody answers ends when its timeout (0.2 s) passes, long before the guard."""
    box: dict[str, BaseException] = {}

    def gather() -> None:
        try:
            consumer.gather(["x"], {"x": unbound_address()}, timeout=0.2)
        except MissingEmbeddings as e:
            box["error"] = e

    thread = threading.Thread(target=gather, daemon=True)
    thread.start()
    thread.join(GUARD_MS / 1000)
    assert not thread.is_alive()
    error = box.get("error")
    assert isinstance(error, MissingEmbeddings) and error.missing == ["x"]


def test_gather_from_two_producers_at_once(consumer: ECConsumer) -> None:
    producers = [ECProducer().start() for _ in range(2)]
    try:
        outs = [save(p, f"h{i}", torch.full((2, 3), float(i))) for i, p in enumerate(producers)]
        got = consumer.gather(["h0", "h1"], {"h0": producers[0].address, "h1": producers[1].address})
        assert all(torch.equal(got[f"h{i}"].embeds, o.embeds) for i, o in enumerate(outs))
        assert consumer.stats()["remote_fetches"] == 2
    finally:
        for p in producers:
            p.close()


def test_query_reports_which_items_the_producer_holds(producer: ECProducer, consumer: ECConsumer) -> None:
    save(producer, "a", torch.randn(2, 2))
    assert consumer.query(producer.address, ["a", "b"]) == [True, False]
    assert consumer.ping(producer.address) and producer.has_cache_item("a")
    assert not consumer.has_cache_item("a")  # query never fetches


def test_query_of_unreachable_producer_is_all_false(consumer: ECConsumer) -> None:
    address = unbound_address()
    assert consumer.query(address, ["a", "b"], timeout=0.1) == [False, False]
    assert not consumer.ping(address, timeout=0.1)


def test_query_after_a_timeout_works_on_a_fresh_socket(consumer: ECConsumer) -> None:
    def ignore_first_then_answer(sock: zmq.Socket, frames: list[bytes]) -> None:
        if not ignored:
            ignored.append(frames)
            timed_out.wait(GUARD_MS / 1000)  # hold the reply back until the consumer gave up
            return
        req_id = decode_message(frames[1:])[0].req_id
        sock.send_multipart([frames[0], *encode_message(HasReply(req_id=req_id, has=[True]))])

    ignored: list[list[bytes]] = []
    timed_out = threading.Event()
    address, thread = run_fake_producer(ignore_first_then_answer, num_requests=2)
    assert consumer.query(address, ["a"], timeout=0.2) == [False]
    timed_out.set()
    assert consumer.query(address, ["a"], timeout=GUARD_MS / 1000) == [True]
    thread.join(GUARD_MS / 1000)
    assert not thread.is_alive()


def test_reply_with_another_req_id_is_discarded(consumer: ECConsumer) -> None:
    def stale_then_real(sock: zmq.Socket, frames: list[bytes]) -> None:
        req_id = decode_message(frames[1:])[0].req_id
        for rid, flag in ((req_id - 1, True), (req_id, False)):
            sock.send_multipart([frames[0], *encode_message(HasReply(req_id=rid, has=[flag]))])

    address, thread = run_fake_producer(stale_then_real, num_requests=1)
    assert consumer.query(address, ["a"], timeout=GUARD_MS / 1000) == [False]
    thread.join(GUARD_MS / 1000)
    assert not thread.is_alive()


def test_producer_keeps_serving_after_garbage(
    producer: ECProducer, consumer: ECConsumer, caplog: pytest.LogCaptureFixture
) -> None:
    garbage = [
        [b"garbage"],
        [b""],
        [MAGIC_VERSION + b"\xc1\xc1"],  # bad msgpack
        [MAGIC_VERSION[:4] + b"\x01\x80"],  # wrong version
        [b"EPDC\x01", b"\x82\xa2op\xa4ping\xa6req_id\x05"],  # a version 1 message
        [MAGIC_VERSION, b"\x82\xa2op\xa4ping\xa6req_id\x05"],  # header in its own frame
        [MAGIC_VERSION + b"\x82\xa2op\xa3get\xa6req_id\x05"],  # get without hashes
        [*encode_message(GetRequest(req_id=9, hashes=["a"])), b"unexpected tensor frame"],
        encode_message(Pong(req_id=4)),  # a reply sent as a request
    ]
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(producer.address)
    try:
        with caplog.at_level(logging.WARNING, logger="epd.connector"):
            for frames in garbage:
                raw.send_multipart(frames)
                assert raw.poll(GUARD_MS), "producer stopped answering"
                assert isinstance(decode_message(raw.recv_multipart())[0], ErrorReply)
    finally:
        raw.close()
    assert producer.stats()["bad_messages"] == len(garbage)
    assert sum("malformed" in r.getMessage() for r in caplog.records) == len(garbage)
    out = save(producer, "a", torch.randn(3, 3))
    assert torch.equal(consumer.gather(["a"], {"a": producer.address})["a"].embeds, out.embeds)


def test_error_reply_echoes_req_id_when_readable(producer: ECProducer) -> None:
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(producer.address)
    try:
        raw.send_multipart([MAGIC_VERSION + msgpack.packb({"op": "has", "req_id": 42, "hashes": [1, 2]})])
        assert raw.poll(GUARD_MS)
        header, _ = decode_message(raw.recv_multipart())
    finally:
        raw.close()
    assert isinstance(header, ErrorReply) and header.req_id == 42 and "hashes" in header.message


def test_close_stops_the_serving_thread() -> None:
    """close() returns once the serving thread has stopped (not once its join gave up on it)."""
    p = ECProducer().start()
    thread = p._server._thread
    assert thread is not None and thread.is_alive()
    p.close()
    assert not thread.is_alive()


def test_gathered_tensor_is_built_over_the_received_frame(
    producer: ECProducer, consumer: ECConsumer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import connector.tensors.frames

    def no_copy(*args: object) -> None:
        raise AssertionError("received frame was copied")

    # the only copy in the receive path is the read-only fallback; zmq frames must not need it
    monkeypatch.setattr(connector.tensors.frames, "bytearray", no_copy, raising=False)
    out = save(producer, "a", torch.randn(256, 64).to(torch.bfloat16))
    assert torch.equal(consumer.gather(["a"], {"a": producer.address})["a"].embeds, out.embeds)
