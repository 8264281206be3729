"""Pipelined gather: a get for an item still being encoded waits at the producer until it is stored."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from connector.tensors.consumer import ECConsumer
from connector.tensors.errors import MissingEmbeddings
from connector.tensors.producer import ECProducer
from epd_contracts.embeddings import ImageFeatures

GUARD_S = 10.0  # upper bound on any wait here; never reached when things work
LONG_TIMEOUT_S = 60.0  # gather timeout far beyond GUARD_S: returning within GUARD_S proves no timeout was hit




def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run fn in a thread; its result or exception lands in the returned dict."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except Exception as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def wait_until_parked(producer: ECProducer, n: int = 1) -> None:
    """Block (bounded) until the producer holds n waiting gets; its serving thread counts them."""
    done = threading.Event()
    for _ in range(int(GUARD_S * 100)):
        if producer.stats()["gets_waiting"] >= n:
            done.set()
            break
        done.wait(0.01)
    assert done.is_set(), f"producer never parked {n} get(s): {producer.stats()}"


def test_get_for_an_item_not_yet_stored_waits_and_returns_it_once_saved(producer: ECProducer,
                                                                        consumer: ECConsumer) -> None:
    embeds = torch.randn(6, 16, dtype=torch.bfloat16)
    t, box = in_thread(lambda: consumer.gather(["x"], {"x": producer.address}, LONG_TIMEOUT_S, wait_for=["x"]))
    wait_until_parked(producer)
    producer.save_caches("x", ImageFeatures(embeds, (1, 2, 3)))
    t.join(GUARD_S)
    assert not t.is_alive() and "error" not in box, box
    got = box["result"]["x"]
    assert torch.equal(got.embeds, embeds) and got.grid_thw == (1, 2, 3)
    assert producer.stats()["gets_waited"] == 1 and producer.stats()["gets_waiting"] == 0


def test_a_failed_encode_answers_the_waiting_get_at_once(producer: ECProducer, consumer: ECConsumer) -> None:
    t, box = in_thread(lambda: consumer.gather(["bad"], {"bad": producer.address}, LONG_TIMEOUT_S, wait_for=["bad"]))
    wait_until_parked(producer)
    producer.mark_failed(["bad"])
    t.join(GUARD_S)
    assert not t.is_alive() and isinstance(box.get("error"), MissingEmbeddings)
    assert box["error"].missing == ["bad"]


def test_a_get_arriving_after_the_failure_fails_fast_too(producer: ECProducer, consumer: ECConsumer) -> None:
    producer.mark_failed(["bad"])
    producer.save_caches("other", ImageFeatures(torch.ones(1, 4)))  # the failure is processed first
    t, box = in_thread(lambda: consumer.gather(["bad"], {"bad": producer.address}, LONG_TIMEOUT_S, wait_for=["bad"]))
    t.join(GUARD_S)
    assert not t.is_alive() and isinstance(box.get("error"), MissingEmbeddings)


def test_wait_ends_at_the_timeout_with_missing_embeddings(producer: ECProducer, consumer: ECConsumer) -> None:
    with pytest.raises(MissingEmbeddings):
        consumer.gather(["never"], {"never": producer.address}, timeout=0.5, wait_for=["never"])
    assert producer.stats()["gets_waiting"] == 0


def test_an_item_not_marked_pending_is_answered_missing_without_waiting(producer: ECProducer,
                                                                        consumer: ECConsumer) -> None:
    t, box = in_thread(lambda: consumer.gather(["gone"], {"gone": producer.address}, LONG_TIMEOUT_S))
    t.join(GUARD_S)
    assert not t.is_alive() and isinstance(box.get("error"), MissingEmbeddings)
    assert producer.stats()["gets_waited"] == 0


def test_a_waiting_get_does_not_block_other_gathers_to_the_same_producer(producer: ECProducer,
                                                                         consumer: ECConsumer) -> None:
    producer.save_caches("ready", ImageFeatures(torch.ones(2, 4)))
    slow, slow_box = in_thread(lambda: consumer.gather(["later"], {"later": producer.address}, LONG_TIMEOUT_S,
                                                       wait_for=["later"]))
    wait_until_parked(producer)
    got = consumer.gather(["ready"], {"ready": producer.address}, GUARD_S)  # a second socket from the pool
    assert torch.equal(got["ready"].embeds, torch.ones(2, 4)) and slow.is_alive()
    producer.save_caches("later", ImageFeatures(torch.zeros(3, 4)))
    slow.join(GUARD_S)
    assert "later" in slow_box["result"]


def test_two_items_one_stored_one_pending_come_back_together(producer: ECProducer, consumer: ECConsumer) -> None:
    producer.save_caches("a", ImageFeatures(torch.ones(2, 4)))
    t, box = in_thread(lambda: consumer.gather(["a", "b"], {"a": producer.address, "b": producer.address},
                                               LONG_TIMEOUT_S, wait_for=["b"]))
    wait_until_parked(producer)
    producer.save_caches("b", ImageFeatures(torch.zeros(5, 4)))
    t.join(GUARD_S)
    assert set(box["result"]) == {"a", "b"} and box["result"]["b"].num_tokens == 5
