"""What the end-to-end family and video tests share: an in-process aggregated stack to compare EPD with, and the
answer's tokens and logprobs as the API gives them."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from decoder_service.config import DecoderConfig
from decoder_service.server import create_app as decoder_app
from epd_common.server import HttpLimits
from proxy.app import create_app as proxy_app
from proxy.config import ProxyConfig
from tests.hostile.http_client import served


@contextmanager
def aggregated(model_dir: Path, **cfg: Any) -> Iterator[str]:
    """An aggregated decoder (both halves; `cfg`: more of its DecoderConfig) and a proxy in front of it, each behind
    uvicorn in a thread."""
    dapp = decoder_app(DecoderConfig(model=str(model_dir), aggregated=True, **cfg))
    with served(dapp, HttpLimits()) as dport:
        pcfg = ProxyConfig(encode_urls=(), decode_urls=(f"http://127.0.0.1:{dport}",), aggregated=True,
                           served_model_name=None)  # the name the decoder reports, as in attach mode
        with served(proxy_app(pcfg), HttpLimits()) as pport:
            yield f"http://127.0.0.1:{pport}"


def tokens(answer: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The generated tokens as (token, bytes): the API's token identity (ids are not exposed).

    NOTE: a token that ends the answer without text (a special token, half a UTF-8 character) has no entry
    (decoder_service/engine/sequence.py sends entries only with text); both paths drop the same ones."""
    return [(e["token"], tuple(e["bytes"])) for e in answer["choices"][0]["logprobs"]["content"]]


def logprobs(answer: dict[str, Any]) -> list[float]:
    return [e["logprob"] for e in answer["choices"][0]["logprobs"]["content"]]
