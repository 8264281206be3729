"""Prefix keys (proxy/prefix_keys.py) as prepare_chat and /v1/completions compute them: a follow-up repeats its
conversation's keys, and the salt, the tools and each image's content change them."""
from __future__ import annotations

from typing import Any

from proxy.completions import CompletionRequest
from proxy.config import ProxyConfig
from proxy.prefix_keys import chat_prefix_keys, prefix_secret, prompt_keys
from proxy.prepare import prepare_chat
from proxy.protocol import ChatCompletionRequest
from tests.factories import make_image
from tests.proxy.media_helpers import as_data_url, encode

CFG = ProxyConfig(encode_urls=("http://e",), decode_urls=("http://d",), served_model_name="demo")
RED, OTHER = as_data_url(encode(make_image(32, 24))), as_data_url(encode(make_image(40, 24)))
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def turn(text: str, image: str | None = None) -> dict[str, Any]:
    if image is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": text}]}


def keys(messages: list[dict[str, Any]], **extra: Any) -> list[str]:
    req = ChatCompletionRequest.model_validate({"model": "demo", "messages": messages, **extra})
    return prepare_chat(req, CFG).prefix_keys


CONVERSATION = [{"role": "system", "content": "Be brief."}, turn("What is this?", RED),
                {"role": "assistant", "content": "A red shape."}, turn("And its size?")]


def test_a_follow_up_repeats_the_keys_of_its_conversation_so_far() -> None:
    first, follow_up = keys(CONVERSATION[:2]), keys(CONVERSATION)
    assert follow_up[:2] == first and len(follow_up) == 4 and len(set(follow_up)) == 4
    assert all(len(k) == 32 and int(k, 16) >= 0 for k in follow_up)
    other_question = keys([*CONVERSATION[:3], turn("And its colour?")])
    assert other_question[:3] == follow_up[:3] and other_question[3] != follow_up[3]


def test_the_salt_changes_every_key() -> None:
    plain, salted, other = keys(CONVERSATION), keys(CONVERSATION, cache_salt="tenant-a"), \
        keys(CONVERSATION, cache_salt="tenant-b")
    assert salted == keys(CONVERSATION, cache_salt="tenant-a")
    assert not set(plain) & set(salted) and not set(salted) & set(other)


def test_the_tools_change_every_key() -> None:
    assert not set(keys(CONVERSATION)) & set(keys(CONVERSATION, tools=[TOOL]))


def test_the_same_picture_hits_and_a_different_one_never_does() -> None:
    again = keys([CONVERSATION[0], turn("What is this?", RED)])
    other = keys([CONVERSATION[0], turn("What is this?", OTHER)])
    assert again == keys(CONVERSATION[:2])
    assert other[0] == again[0] and other[1] != again[1]  # the same up to the message with the image
    low = [CONVERSATION[0], {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": RED, "detail": "low"}}, {"type": "text", "text": "What is this?"}]}]
    assert keys(low)[1] != again[1]  # encoded at another resolution: other image tokens


def test_images_count_by_position_and_text_by_content() -> None:
    two = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in (RED, OTHER)]}]
    swapped = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in (OTHER, RED)]}]
    assert keys(two) != keys(swapped)
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert keys(as_parts) == keys([turn("hi")]) != keys([turn("hi!")])
    assert keys([{"role": "system", "content": "hi"}]) != keys([turn("hi")])


def test_the_chain_is_the_documented_one() -> None:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]},
                {"role": "assistant", "content": "y", "tool_calls": [{"id": "c", "type": "function",
                                                                       "function": {"name": "f", "arguments": "{}"}}]}]
    chain = chat_prefix_keys(messages, ["h" * 64], [TOOL], "s")
    assert chain[0] == chat_prefix_keys(messages[:1], ["h" * 64], [TOOL], "s")[0]
    assert chain[0] != chat_prefix_keys(messages[:1], ["g" * 64], [TOOL], "s")[0]
    assert chain[1] != chat_prefix_keys([messages[0], {**messages[1], "tool_calls": None}], ["h" * 64], [TOOL], "s")[1]


def test_a_completions_prompt_has_one_key_of_its_own_kind() -> None:
    def prepared(prompt: Any, **extra: Any) -> list[str]:
        return CompletionRequest.model_validate({"model": "demo", "prompt": prompt, **extra}).prepare().prefix_keys

    text = prepared("Once upon a time")
    assert len(text) == 1 and text == prepared(["Once upon a time"]) == prompt_keys("Once upon a time")
    assert text != prepared("Once upon a time", cache_salt="s") and text != prepared("Once upon a time,")
    assert prepared([1, 2, 3]) != prepared("[1, 2, 3]") and len(prepared([1, 2, 3])) == 1
    assert text[0] not in chat_prefix_keys([{"role": "user", "content": "Once upon a time"}], [], [])


def test_keys_are_keyed_by_the_internal_key_so_a_guess_without_it_matches_nothing() -> None:
    messages = [{"role": "user", "content": "a private question"}]
    plain = chat_prefix_keys(messages, [], [], "")
    keyed = chat_prefix_keys(messages, [], [], "", prefix_secret("fleet-key"))
    assert keyed == chat_prefix_keys(messages, [], [], "", prefix_secret("fleet-key"))  # every proxy of the fleet
    assert keyed != plain and keyed != chat_prefix_keys(messages, [], [], "", prefix_secret("other-key"))
    assert prefix_secret(None) == prefix_secret("") == b""  # no internal key (--insecure): unkeyed
    assert prompt_keys("p", "", prefix_secret("fleet-key")) != prompt_keys("p")
