"""The proxy app in process (EPD mode) in front of fake workers, the workers closed together at the end."""
from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from fastapi.testclient import TestClient

from proxy.app import create_app
from proxy.config import ProxyConfig
from tests.proxy.fake_decoder import FakeDecoder
from tests.proxy.fake_encoder import FakeEncoder


@contextmanager
def proxy_in_front(decoder: FakeDecoder, encoders: Sequence[FakeEncoder], **cfg: Any) -> Iterator[TestClient]:
    """A client of the proxy (ProxyConfig `cfg`) routing to `encoders` and `decoder`; afterwards every worker is
    closed, at once (each server's shutdown waits for its poll interval)."""
    proxy = ProxyConfig(encode_urls=tuple(e.url for e in encoders), decode_urls=(decoder.url,), startup_timeout=10.0,
                        **cfg)
    try:
        with TestClient(create_app(proxy)) as client:
            yield client
    finally:
        closing = [threading.Thread(target=w.close) for w in (decoder, *encoders)]
        for t in closing:
            t.start()
        for t in closing:
            t.join()
