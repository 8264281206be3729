"""Consumer check hook and caps: refused items are not cached; replies over the caps are refused."""

from __future__ import annotations

import pytest
import torch

from connector.tensors.consumer import ECConsumer
from connector.tensors.errors import InvalidEmbeddings, MissingEmbeddings
from connector.tensors.producer import ECProducer
from epd_contracts.embeddings import ImageFeatures

TIMEOUT_S = 5.0


def width_check(width: int):  # type: ignore[no-untyped-def]
    def check(out: ImageFeatures) -> str | None:
        return None if out.embeds.shape[-1] == width else f"width {out.embeds.shape[-1]}, expected {width}"
    return check


def test_check_refuses_bad_items_caches_good_ones(producer: ECProducer) -> None:
    producer.save_caches("good", ImageFeatures(torch.ones(2, 8)))
    producer.save_caches("bad", ImageFeatures(torch.ones(2, 5)))
    consumer = ECConsumer(check=width_check(8))
    try:
        src = {"good": producer.address, "bad": producer.address}
        with pytest.raises(InvalidEmbeddings) as info:
            consumer.gather(["good", "bad"], src, timeout=TIMEOUT_S)
        assert list(info.value.reasons) == ["bad"] and "width 5" in info.value.reasons["bad"]
        assert consumer.has_cache_item("good") and not consumer.has_cache_item("bad")
        assert consumer.stats()["refused"] == 1
        assert torch.equal(consumer.gather(["good"], {}, timeout=TIMEOUT_S)["good"].embeds, torch.ones(2, 8))
    finally:
        consumer.close()


def test_a_check_that_raises_refuses_the_item(producer: ECProducer) -> None:
    producer.save_caches("x", ImageFeatures(torch.ones(1, 4)))

    def boom(out: ImageFeatures) -> str | None:
        raise RuntimeError("nope")

    consumer = ECConsumer(check=boom)
    try:
        with pytest.raises(InvalidEmbeddings) as info:
            consumer.gather(["x"], {"x": producer.address}, timeout=TIMEOUT_S)
        assert "RuntimeError" in info.value.reasons["x"] and not consumer.has_cache_item("x")
    finally:
        consumer.close()


def test_gather_splits_gets_by_max_items_per_get(producer: ECProducer) -> None:
    hashes = [f"h{i}" for i in range(7)]
    for h in hashes:
        producer.save_caches(h, ImageFeatures(torch.full((1, 4), float(len(h)))))
    consumer = ECConsumer(max_items_per_get=3)
    try:
        got = consumer.gather(hashes, dict.fromkeys(hashes, producer.address), timeout=TIMEOUT_S)
        assert list(got) == hashes and consumer.stats()["remote_fetches"] == 3
    finally:
        consumer.close()


def test_reply_over_max_reply_bytes_is_refused_and_not_cached(producer: ECProducer) -> None:
    for h in ("a", "b"):
        producer.save_caches(h, ImageFeatures(torch.ones(16, 16)))  # 1 KiB each
    consumer = ECConsumer(max_reply_bytes=1500)
    try:
        with pytest.raises(MissingEmbeddings):
            consumer.gather(["a", "b"], {"a": producer.address, "b": producer.address}, timeout=TIMEOUT_S)
        assert not consumer.has_cache_item("a")
        assert list(consumer.gather(["a"], {"a": producer.address}, timeout=TIMEOUT_S)) == ["a"]  # one fits
    finally:
        consumer.close()


def test_producer_reply_byte_cap_sends_the_rest_as_more_and_the_consumer_asks_again() -> None:
    p = ECProducer(max_reply_bytes=1500).start()  # one 1 KiB item per reply
    consumer = ECConsumer()
    try:
        hashes = ["a", "b", "c"]
        for i, h in enumerate(hashes):
            p.save_caches(h, ImageFeatures(torch.full((16, 16), float(i))))
        got = consumer.gather(hashes, dict.fromkeys(hashes, p.address), timeout=TIMEOUT_S)
        assert [float(got[h].embeds[0, 0]) for h in hashes] == [0.0, 1.0, 2.0]
        assert consumer.stats()["remote_fetches"] == 3 and p.stats()["gets_served"] == 3
    finally:
        consumer.close()
        p.close()


def test_producer_refuses_a_get_over_max_items_per_get() -> None:
    p = ECProducer(max_items_per_get=2).start()
    consumer = ECConsumer()  # asks for up to 256 per get: the producer says no
    try:
        p.save_caches("a", ImageFeatures(torch.ones(1, 2)))
        with pytest.raises(MissingEmbeddings):
            consumer.gather(["a", "x", "y"], dict.fromkeys(["a", "x", "y"], p.address), timeout=TIMEOUT_S)
        assert p.stats()["bad_messages"] == 1
        assert consumer.query(p.address, ["a", "x", "y"]) == [False] * 3  # refused has: all unknown
        assert consumer.query(p.address, ["a", "x"]) == [True, False]
    finally:
        consumer.close()
        p.close()


def test_parked_gets_are_capped_by_hashes_held() -> None:
    p = ECProducer(max_parked_hashes=3).start()
    consumer = ECConsumer(cache_bytes=0)
    try:
        # 4 hashes that may wait: over the cap, so the get is answered at once (not parked) with nothing
        hashes = ["w1", "w2", "w3", "w4"]
        with pytest.raises(MissingEmbeddings):
            consumer.gather(hashes, dict.fromkeys(hashes, p.address), timeout=TIMEOUT_S, wait_for=hashes)
        assert p.stats()["gets_waited"] == 0 and p.stats()["hashes_waiting"] == 0
    finally:
        consumer.close()
        p.close()
