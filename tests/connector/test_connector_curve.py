"""CURVE on the real producer, consumer and cache index: right keys work, a wrong key is refused."""

from __future__ import annotations

import pytest
import torch
import zmq

from connector.control.cache_index import FleetCacheIndex
from connector.control.security import CurveConfig
from connector.tensors.consumer import ECConsumer
from connector.tensors.errors import MissingEmbeddings
from connector.tensors.producer import ECProducer
from epd_contracts.embeddings import ImageFeatures

GUARD_S = 10.0


def keypair() -> tuple[bytes, bytes]:
    public, secret = zmq.curve_keypair()
    return secret, public


def server(allowed: frozenset[bytes] | None = None) -> CurveConfig:
    secret, public = keypair()
    return CurveConfig(secret, public, allowed_clients=allowed)


def client_of(srv: CurveConfig, pair: tuple[bytes, bytes] | None = None) -> CurveConfig:
    secret, public = pair or keypair()
    return CurveConfig(secret, public, server_key=srv.public_key)


def saved(producer: ECProducer) -> torch.Tensor:
    embeds = torch.randn(3, 8, dtype=torch.float16)
    producer.save_caches("x", ImageFeatures(embeds))
    return embeds


def test_gather_and_events_work_with_the_right_keys() -> None:
    srv = server()
    producer = ECProducer(curve=srv).start()
    consumer = ECConsumer(cache_bytes=0, curve=client_of(srv))
    index = FleetCacheIndex(client_of(srv))
    try:
        embeds = saved(producer)
        assert torch.equal(consumer.gather(["x"], {"x": producer.address}, GUARD_S)["x"].embeds, embeds)
        index.add(producer.address, producer.events_address)
        assert index.wait_for(lambda: index.has_cache_item("x"), GUARD_S)
    finally:
        index.close()
        consumer.close()
        producer.close()


@pytest.mark.parametrize("who", ["wrong_server_key", "plaintext"])
def test_a_consumer_without_the_right_server_key_gets_nothing(who: str) -> None:
    srv = server()
    producer = ECProducer(curve=srv).start()
    curve = client_of(server()) if who == "wrong_server_key" else None  # trusts some other producer's key
    consumer = ECConsumer(cache_bytes=0, curve=curve)
    try:
        saved(producer)
        with pytest.raises(MissingEmbeddings):
            consumer.gather(["x"], {"x": producer.address}, timeout=1.0)
        assert producer.stats()["gets_served"] == 0 and producer.stats()["bad_messages"] == 0
    finally:
        consumer.close()
        producer.close()


def test_an_allow_list_admits_listed_clients_only() -> None:
    listed = keypair()
    srv = server(allowed=frozenset({listed[1]}))
    producer = ECProducer(curve=srv).start()
    good, stranger = ECConsumer(cache_bytes=0, curve=client_of(srv, listed)), ECConsumer(cache_bytes=0,
                                                                                        curve=client_of(srv))
    try:
        embeds = saved(producer)
        with pytest.raises(MissingEmbeddings):
            stranger.gather(["x"], {"x": producer.address}, timeout=1.0)
        assert torch.equal(good.gather(["x"], {"x": producer.address}, GUARD_S)["x"].embeds, embeds)
        assert producer.stats()["gets_served"] == 1
    finally:
        good.close()
        stranger.close()
        producer.close()
