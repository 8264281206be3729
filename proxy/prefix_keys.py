"""Routing keys of a request's prompt prefixes: a decoder that served messages[:i+1] holds their K/V in its prefix
cache, and reports key_i in its /health while it does (proxy/affinity.py routes a follow-up there).

A chat request has one key per message prefix, a hash chain: key_0 = H(salt, tools, message_0) and
key_i = H(key_{i-1}, message_i), so key_i names the whole of messages[:i+1] and a conversation's follow-up repeats
its earlier keys. A message is hashed as (role, parts, tool_calls, tool_call_id): text parts by their text, image
parts by their image's mm_hash (the same picture hits, a different picture never does), video parts by their video's
hash (its bytes and its sampling: epd_contracts.video.video_hash); a string content is one text part. The salt is vLLM's cache_salt: requests with different salts share no key, as they share no K/V.

A /v1/completions prompt has one key, of the whole prompt (text or token ids): an identical prompt finds the decoder
that served it; a prompt that only extends another one does not (prefixes of a text are not at message bounds).

Keys are hints, never trusted for correctness: the decoder matches its cache by token ids. blake2b, 32 hex chars.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec

_ENCODE = msgspec.json.Encoder()  # unambiguous framing of the hashed fields (strings are quoted and escaped)
KEY_BYTES = 16  # 32 hex characters
_BLAKE2B = hashlib.blake2b(digest_size=KEY_BYTES)  # copied per key: cheaper than a new one's parameter set-up


def _key(fields: Any) -> str:
    h = _BLAKE2B.copy()
    h.update(_ENCODE.encode(fields))
    return h.hexdigest()


def _canonical(message: dict[str, Any], media: Iterator[str]) -> tuple[Any, ...]:
    """(role, parts, tool_calls, tool_call_id) of one decoder message; each image or video part takes the next
    hash."""
    content = message.get("content")
    if isinstance(content, list):
        parts: list[Any] = [{p["type"]: next(media, "")} if p.get("type") in ("image", "video") else p.get("text", "")
                            for p in content]
    else:
        parts = [content or ""]
    return message.get("role"), parts, message.get("tool_calls"), message.get("tool_call_id")


def chat_prefix_keys(messages: Sequence[dict[str, Any]], mm_hashes: Sequence[str], tools: Sequence[dict[str, Any]],
                     salt: str = "") -> list[str]:
    """key_i of messages[:i+1] for each i; `messages` as the decoder gets them (image and video parts are
    {"type": "image"} / {"type": "video"}, their hashes in that order in `mm_hashes`)."""
    media = iter(mm_hashes)
    keys: list[str] = []
    for i, message in enumerate(messages):
        head: tuple[Any, ...] = ("chat", salt, tools) if i == 0 else (keys[-1],)
        keys.append(_key((*head, _canonical(message, media))))
    return keys


def prompt_keys(prompt: str | Sequence[int], salt: str = "") -> list[str]:
    """The one key of a completions prompt (its own domain: never equal to a chat key)."""
    return [_key(("prompt", salt, prompt))]
