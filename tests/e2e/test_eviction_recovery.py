"""An embedding evicted between encode and decode is re-encoded, and the client still gets its answer."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.stack import ask_colour, demo_png, metric, start, stop, wait_healthy
from tests.ports import PortHolds

pytestmark = pytest.mark.e2e

ONE_EMBEDDING = 40_000  # bytes: the demo's 64 x 128 float32 embedding (32 KiB) fits, two do not


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("evict")
    holds = PortHolds()  # each port held for its process's life (it binds beside the hold)
    enc_port, dec_port, port = holds.take(), holds.take(), holds.take()
    procs = [start("encoder_service.cli", ["--port", str(enc_port), "--ec-cache-bytes", str(ONE_EMBEDDING)],
                   tmp / "enc.log", held=True),
             start("decoder_service.cli", ["--port", str(dec_port)], tmp / "dec.log", held=True)]
    procs.append(start("epd_launcher.cli", ["--port", str(port), "--encode-servers-urls", f"http://127.0.0.1:{enc_port}",
                                     "--decode-servers-urls", f"http://127.0.0.1:{dec_port}"], tmp / "p.log",
                       held=True))
    try:
        wait_healthy(f"http://127.0.0.1:{port}", procs[-1], tmp / "p.log")
        yield f"http://127.0.0.1:{port}"
    finally:
        for p in reversed(procs):
            stop(p)
        holds.close()


def ask(proxy: str, *images: bytes) -> str:
    resp = ask_colour(proxy, *images)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def retries(proxy: str) -> float:
    return metric(httpx.get(f"{proxy}/metrics", timeout=10).text, "epd_proxy_retries_total")


def test_an_image_evicted_before_the_decoder_gathers_it_is_re_encoded(proxy: str) -> None:
    a, b = demo_png("red", 1), demo_png("red", 2)
    # the encoder holds one embedding: storing b evicts a before the decoder asks for it
    first = ask(proxy, a, b)
    assert retries(proxy) == 1
    # now a is on the encoder and b in the decoder's cache: no miss, and the same answer
    assert ask(proxy, a, b) == first and retries(proxy) == 1
    assert ask(proxy, demo_png("blue", 3)) == "blue"  # single images still fit and work
