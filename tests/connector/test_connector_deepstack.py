"""Qwen3-VL's DeepStack features on the connector: a second tensor frame per item, carried unchanged, counted in
every byte budget, and a reply that describes it wrongly is a WireError (the item is missing, nothing crashes)."""
from __future__ import annotations

import threading
from collections.abc import Iterator

import msgspec
import pytest
import torch
import zmq

from connector.control.wire import WireError, decode_message, encode_message
from connector.tensors.consumer import ECConsumer
from connector.tensors.errors import MissingEmbeddings
from connector.tensors.frames import WireItem
from connector.tensors.producer import ECProducer
from connector.tensors.replies import get_reply, parse_get_reply
from epd_contracts.ec import MAX_SPAN_IDS, GetItem, GetReply, GetRequest
from epd_contracts.embeddings import SPAN_ID_BYTES, ImageFeatures

TIMEOUT_S = 5.0
LAYERS, TOKENS, WIDTH = 3, 5, 8


def features(dtype: torch.dtype = torch.float32, seed: int = 0) -> ImageFeatures:
    """One image's rows and DeepStack features (non-contiguous: the producer makes them contiguous)."""
    g = torch.Generator().manual_seed(seed)
    deepstack = torch.randn(WIDTH, TOKENS, LAYERS, generator=g).permute(2, 1, 0).to(dtype)
    return ImageFeatures(torch.randn(TOKENS, WIDTH, generator=g).to(dtype), grid_thw=(1, 2, 10),
                         span=(7, 9, 9, 9, 9, 9, 8), deepstack=deepstack)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepstack_goes_through_unchanged(producer: ECProducer, consumer: ECConsumer, dtype: torch.dtype) -> None:
    sent = features(dtype)
    assert sent.deepstack is not None and not sent.deepstack.is_contiguous()
    producer.save_caches("a", sent)
    got = consumer.gather(["a"], {"a": producer.address}, timeout=TIMEOUT_S)["a"]
    assert got.deepstack is not None
    assert got.deepstack.dtype == dtype and got.deepstack.shape == (LAYERS, TOKENS, WIDTH)
    assert torch.equal(got.deepstack, sent.deepstack) and torch.equal(got.embeds, sent.embeds)
    assert got.span == sent.span and got.grid_thw == sent.grid_thw


def test_every_byte_count_includes_deepstack(producer: ECProducer, consumer: ECConsumer) -> None:
    sent = features()
    assert sent.deepstack is not None
    tensor_bytes = sent.embeds.nbytes + sent.deepstack.nbytes
    assert sent.deepstack.nbytes == LAYERS * sent.embeds.nbytes
    assert sent.nbytes == tensor_bytes + SPAN_ID_BYTES * len(sent.span or ())
    producer.save_caches("a", sent)
    consumer.gather(["a"], {"a": producer.address}, timeout=TIMEOUT_S)
    assert producer.stats()["bytes"] == sent.nbytes and consumer.stats()["bytes"] == sent.nbytes
    assert producer.stats()["bytes_sent"] == tensor_bytes  # both tensor frames
    assert consumer.stats()["bytes_received"] == sent.nbytes


def test_reply_byte_cap_counts_deepstack_and_sends_the_rest_as_more() -> None:
    one = features()
    # room for 1.5 items with DeepStack (4 tensors' worth each); without it, all three items would fit
    cap = one.nbytes * 3 // 2
    held = {h: WireItem(features(seed=i)) for i, h in enumerate("abc")}
    header, frames = get_reply(1, list(held), held, max_bytes=cap)
    assert [(i.found, i.more) for i in header.items] == [(True, False), (False, True), (False, True)]
    assert len(frames) == 2 and [i.deepstack_frame for i in header.items] == [1, None, None]

    p = ECProducer(max_reply_bytes=cap).start()
    consumer = ECConsumer()
    try:
        for h, item in held.items():
            p.save_caches(h, item.features)
        got = consumer.gather(list(held), dict.fromkeys(held, p.address), timeout=TIMEOUT_S)
        assert all(torch.equal(got[h].deepstack, held[h].features.deepstack) for h in held)  # type: ignore[arg-type]
        assert consumer.stats()["remote_fetches"] == 3 and p.stats()["gets_served"] == 3
    finally:
        consumer.close()
        p.close()


def test_consumer_reply_cap_counts_deepstack(producer: ECProducer) -> None:
    sent = features()
    producer.save_caches("a", sent)
    consumer = ECConsumer(max_reply_bytes=2 * sent.embeds.nbytes)  # the embeddings fit, with DeepStack they do not
    try:
        with pytest.raises(MissingEmbeddings):
            consumer.gather(["a"], {"a": producer.address}, timeout=TIMEOUT_S)
        assert not consumer.has_cache_item("a")
    finally:
        consumer.close()


# hostile replies: (what is wrong, the item's header, its tensor frames)


def _good() -> tuple[GetItem, list[memoryview]]:
    item = WireItem(features())
    return item.item("a", 0), item.buffers


def _hostile() -> Iterator[tuple[str, GetItem, list[memoryview]]]:
    item, (embeds, deep) = _good()
    yield "deepstack frame of the wrong size", item, [embeds, deep[:-4]]
    yield "deepstack frame repeats the main frame", msgspec.structs.replace(item, deepstack_frame=0), [embeds, deep]
    yield "deepstack frame repeats the main frame, one frame", msgspec.structs.replace(item, deepstack_frame=0), [embeds]
    yield "deepstack shape without frame", msgspec.structs.replace(item, deepstack_frame=None), [embeds]
    yield "deepstack frame without shape", msgspec.structs.replace(item, deepstack_shape=None), [embeds, deep]
    wrong = msgspec.structs.replace(item, deepstack_shape=[LAYERS * TOKENS, 1, WIDTH])  # same bytes, other rows
    yield "deepstack rows do not match the embeddings", wrong, [embeds, deep]
    # the span (the image's prompt tokens) is bounded on decode, before any tensor is built
    yield "span past its bound", msgspec.structs.replace(item, span=[7] * (MAX_SPAN_IDS + 1)), [embeds, deep]
    yield "span with a negative id", msgspec.structs.replace(item, span=[7, -1, 9]), [embeds, deep]
    yield "span with an id past int32", msgspec.structs.replace(item, span=[7, 2**31, 9]), [embeds, deep]


HOSTILE = {name: (item, frames) for name, item, frames in _hostile()}


def test_a_good_reply_parses() -> None:
    item, frames = _good()
    header, buffers = decode_message(encode_message(GetReply(req_id=1, items=[item]), frames))
    assert isinstance(header, GetReply)
    got = parse_get_reply(header, buffers)["a"]
    assert got.deepstack is not None and torch.equal(got.deepstack, features().deepstack)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_deepstack_reply_is_a_wire_error(case: str) -> None:
    item, frames = HOSTILE[case]
    with pytest.raises(WireError):
        header, buffers = decode_message(encode_message(GetReply(req_id=1, items=[item]), frames))
        assert isinstance(header, GetReply)
        parse_get_reply(header, buffers)


def _fake_producer(item: GetItem, frames: list[memoryview]) -> tuple[str, threading.Thread]:
    """A ROUTER that answers one get with `item` and `frames`."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def serve() -> None:
        try:
            if sock.poll(int(TIMEOUT_S * 1000)):
                identity, *request = sock.recv_multipart()
                get, _ = decode_message(request)
                assert isinstance(get, GetRequest)
                sock.send_multipart([identity, *encode_message(GetReply(req_id=get.req_id, items=[item]), frames)])
        finally:
            sock.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"tcp://127.0.0.1:{port}", thread


@pytest.mark.parametrize("case", HOSTILE)
def test_consumer_survives_a_hostile_deepstack_reply(consumer: ECConsumer, case: str) -> None:
    address, thread = _fake_producer(*HOSTILE[case])
    with pytest.raises(MissingEmbeddings):
        consumer.gather(["a"], {"a": address}, timeout=TIMEOUT_S)
    thread.join(TIMEOUT_S)
    assert not thread.is_alive() and not consumer.has_cache_item("a")
    good, frames = _good()
    address, thread = _fake_producer(good, frames)  # the same consumer still works
    assert torch.equal(consumer.gather(["a"], {"a": address}, timeout=TIMEOUT_S)["a"].embeds, features().embeds)
    thread.join(TIMEOUT_S)



@pytest.mark.parametrize("deepstack", [torch.zeros(LAYERS, TOKENS, WIDTH, dtype=torch.float16),  # another dtype
                                       torch.zeros(LAYERS, TOKENS + 1, WIDTH)])  # rows that are not the item's
def test_producer_refuses_deepstack_that_does_not_match_its_embeddings(producer: ECProducer, consumer: ECConsumer,
                                                                       deepstack: torch.Tensor) -> None:
    """Such an item is never stored (every get of it would fail), and a gather hears at once that it will not come."""
    bad = ImageFeatures(torch.zeros(TOKENS, WIDTH), span=None, deepstack=deepstack)
    producer.save_caches("bad", bad)
    assert not producer.has_cache_item("bad")
    with pytest.raises(MissingEmbeddings):
        consumer.gather(["bad"], {"bad": producer.address}, timeout=TIMEOUT_S)
    producer.save_caches("good", features())
    assert consumer.gather(["good"], {"good": producer.address}, timeout=TIMEOUT_S)["good"].deepstack is not None
