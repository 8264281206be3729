"""Connector paths end to end: an ipc:// encoder, two proxies sharing one cache view, pipelined encode."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.e2e.stack import ask_colour, demo_png, health, metric, start, stop, wait_healthy
from tests.ports import PortHolds

pytestmark = pytest.mark.e2e


@dataclass
class Fleet:
    encoder: str
    decoder: str
    plain: str  # proxy that encodes, then decodes
    pipelined: str  # proxy started with --pipeline-encode


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("paths")
    holds = PortHolds()  # each port held for its process's life (it binds beside the hold)
    enc_port, dec_port, p1, p2 = holds.take(), holds.take(), holds.take(), holds.take()
    ipc = f"ipc://{tmp}/encoder.sock"
    procs = [start("encoder_service.cli", ["--port", str(enc_port), "--ec-bind", ipc], tmp / "enc.log", held=True),
             start("decoder_service.cli", ["--port", str(dec_port)], tmp / "dec.log", held=True)]
    urls = ["--encode-servers-urls", f"http://127.0.0.1:{enc_port}", "--decode-servers-urls",
            f"http://127.0.0.1:{dec_port}"]
    procs.append(start("epd_launcher.cli", ["--port", str(p1), *urls], tmp / "p1.log", held=True))
    procs.append(start("epd_launcher.cli", ["--port", str(p2), "--pipeline-encode", *urls], tmp / "p2.log", held=True))
    try:
        for port, log in ((p1, "p1.log"), (p2, "p2.log")):
            wait_healthy(f"http://127.0.0.1:{port}", procs[2 if log == "p1.log" else 3], tmp / log)
        yield Fleet(f"http://127.0.0.1:{enc_port}", f"http://127.0.0.1:{dec_port}",
                    f"http://127.0.0.1:{p1}", f"http://127.0.0.1:{p2}")
    finally:
        for p in reversed(procs):
            stop(p)
        holds.close()


def answer(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def scrape(url: str, name: str) -> float:
    return metric(httpx.get(f"{url}/metrics", timeout=10).text, name)


def test_encoder_serves_embeddings_over_ipc(fleet: Fleet) -> None:
    info: dict[str, Any] = health(fleet.encoder)
    assert info["ec_address"].startswith("ipc://") and info["ec_events_address"].startswith("ipc://")
    assert answer(ask_colour(fleet.plain, demo_png("red", 1))) == "red"


def test_a_second_proxy_skips_what_the_first_had_encoded(fleet: Fleet) -> None:
    image = demo_png("blue", 2)
    encoded_before = health(fleet.encoder)["num_encoded"]
    assert answer(ask_colour(fleet.plain, image)) == "blue"
    skipped_before = scrape(fleet.pipelined, "epd_proxy_items_skipped_cached_total")
    assert answer(ask_colour(fleet.pipelined, image)) == "blue"  # the second proxy learnt it from cache events
    assert scrape(fleet.pipelined, "epd_proxy_items_skipped_cached_total") == skipped_before + 1
    assert health(fleet.encoder)["num_encoded"] == encoded_before + 1


def test_pipelined_encode_gives_the_same_answers(fleet: Fleet) -> None:
    for colour, seed in (("green", 3), ("red", 4), ("blue", 5)):
        pipelined = answer(ask_colour(fleet.pipelined, demo_png(colour, seed)))
        assert pipelined == colour == answer(ask_colour(fleet.plain, demo_png(colour, seed + 10)))
    assert scrape(fleet.encoder, "epd_ec_producer_gets_served") >= 6


def test_pipelined_bad_image_is_a_400_and_the_next_request_succeeds(fleet: Fleet) -> None:
    truncated = demo_png("green", 6)[:60]  # header intact, pixels cut
    resp = ask_colour(fleet.pipelined, truncated)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_image"
    assert scrape(fleet.encoder, "epd_ec_producer_gets_waiting") == 0  # the decoder's wait ended with the failure
    assert answer(ask_colour(fleet.pipelined, demo_png("green", 7))) == "green"
