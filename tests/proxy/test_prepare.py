"""Request checks in the proxy: every bad input becomes a 4xx naming the problem."""
from __future__ import annotations

import base64
import io

import pytest

from epd_common.errors import APIError
from epd_contracts.hashing import mm_hash
from proxy.config import ProxyConfig
from proxy.prepare import check_model, prepare_chat
from proxy.protocol import ChatCompletionRequest
from tests.factories import make_image

CFG = ProxyConfig(encode_urls=("http://e",), decode_urls=("http://d",), served_model_name="demo",
                  max_images_per_request=3)


def data_url(fmt: str = "PNG", size: int = 32) -> str:
    buf = io.BytesIO()
    make_image(size, size).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def request(*urls: str, model: str = "demo", **extra: object) -> ChatCompletionRequest:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    msg = {"role": "user", "content": [*parts, {"type": "text", "text": "What color is the shape?"}]}
    return ChatCompletionRequest.model_validate({"model": model, "messages": [msg], **extra})


def refused(req: ChatCompletionRequest) -> APIError:
    with pytest.raises(APIError) as err:
        prepare_chat(req, CFG)
    return err.value


def test_images_become_markers_in_order_with_server_side_hashes() -> None:
    a, b = data_url("PNG"), data_url("JPEG", 40)
    chat = prepare_chat(request(a, b, a), CFG)
    assert chat.messages[0]["content"][:3] == [{"type": "image"}] * 3
    assert [i.mm_hash for i in chat.items][0] == chat.items[2].mm_hash != chat.items[1].mm_hash
    assert chat.items[0].mm_hash == mm_hash(base64.b64decode(a.split(",", 1)[1]))


def test_hash_is_the_shared_tagged_definition() -> None:
    import hashlib

    assert mm_hash(b"x") != mm_hash(b"y") and len(mm_hash(b"x")) == 64
    assert mm_hash(b"x") != hashlib.sha256(b"x").hexdigest()  # domain/version tag is part of it


@pytest.mark.parametrize("url,code", [
    ("data:image/png;base64,!!!notbase64", "invalid_image_url"),
    ("data:image/png,rawbytes", "invalid_image_url"),
    ("data:text/plain;base64,aGVsbG8=", "invalid_image_url"),
    ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "invalid_image"),
    ("file:///etc/passwd", "image_url_forbidden"),
    ("http://127.0.0.1/x.png", "image_url_forbidden"),
    ("ftp://x/y.png", "invalid_image_url"),
])
def test_bad_image_urls_are_400(url: str, code: str) -> None:
    err = refused(request(url))
    assert err.status == 400 and err.code == code and err.param == "messages.0.content.0.image_url.url"


def test_more_images_than_the_maximum_is_400() -> None:
    err = refused(request(*[data_url()] * 4))
    assert err.status == 400 and err.code == "too_many_images" and "maximum is 3" in err.message


def test_hundreds_of_images_are_refused_before_any_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    def load(*args: object) -> bytes:
        raise AssertionError("an image was loaded")
    monkeypatch.setattr("proxy.image.load_media_bytes", load)
    err = refused(request(*["http://example.com/x.png"] * 300))
    assert err.code == "too_many_images" and "300 images" in err.message


def test_images_outside_user_messages_are_refused_before_any_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    def load(*args: object) -> bytes:
        raise AssertionError("an image was loaded")
    monkeypatch.setattr("proxy.image.load_media_bytes", load)
    image = {"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}
    req = ChatCompletionRequest.model_validate({"model": "demo", "messages": [
        {"role": "user", "content": [image]}, {"role": "assistant", "content": [image]}]})
    err = refused(req)
    assert err.status == 400 and err.param == "messages.1.content.0"


def test_unknown_model_is_404() -> None:
    with pytest.raises(APIError) as err:
        check_model(request(model="gpt-4o").model, CFG.served_model_name)
    assert err.value.status == 404


def test_penalties_are_passed_to_the_decoder() -> None:
    chat = prepare_chat(request(frequency_penalty=0.5, presence_penalty=-1.0), CFG)
    assert (chat.sampling.frequency_penalty, chat.sampling.presence_penalty) == (0.5, -1.0)
    assert prepare_chat(request(), CFG).sampling.frequency_penalty == 0.0
