"""Routing keys of a request's prompt prefixes: a decoder that served messages[:i+1] holds their K/V in its prefix
cache, and reports key_i in its /health while it does (scheduler/affinity.py routes a follow-up there).

A chat request has one key per message prefix, a hash chain: key_0 = H(salt, tools, message_0) and
key_i = H(key_{i-1}, message_i), so key_i names the whole of messages[:i+1] and a conversation's follow-up repeats
its earlier keys. A message is hashed as (role, parts, tool_calls, tool_call_id): text parts by their text, image
parts by their image's mm_hash (the same picture hits, a different picture never does), video parts by their video's
hash (its bytes and its sampling: epd_contracts.video.video_hash), audio parts by their clip's
(epd_contracts.audio.audio_hash); a string content is one text part. The salt is vLLM's cache_salt: requests with different salts share no key, as they share no K/V.

A /v1/completions prompt has one key, of the whole prompt (text or token ids): an identical prompt finds the decoder
that served it; a prompt that only extends another one does not (prefixes of a text are not at message bounds).

Keys are hints, never trusted for correctness: the decoder matches its cache by token ids. blake2b, 32 hex chars,
keyed with a secret derived from the fleet's internal key (`prefix_secret`): the decoder reports the keys it holds
in its open /health, and an unkeyed key of a guessed conversation would tell anyone whether someone sent it. Every
proxy of a fleet shares the internal key, so they compute the same keys. Without an internal key (--insecure) the
keys are unkeyed: nothing on the internal side is secret then (the decoder's /generate is open too).
"""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec

_ENCODE = msgspec.json.Encoder()  # unambiguous framing of the hashed fields (strings are quoted and escaped)
KEY_BYTES = 16  # 32 hex characters
_SECRET_TAG = b"epd-prefix-keys/v1\0"


def prefix_secret(internal_key: str | None) -> bytes:
    """The blake2b key of the prefix keys: derived from the internal key (b"" without one: unkeyed)."""
    return hashlib.sha256(_SECRET_TAG + internal_key.encode()).digest() if internal_key else b""


@functools.lru_cache(maxsize=4)
def _blake2b(secret: bytes) -> Any:
    """Copied per key: cheaper than a new one's parameter (and key block) set-up."""
    return hashlib.blake2b(digest_size=KEY_BYTES, key=secret)


def _key(fields: Any, secret: bytes) -> str:
    h = _blake2b(secret).copy()
    h.update(_ENCODE.encode(fields))
    return str(h.hexdigest())


def _canonical(message: dict[str, Any], media: Iterator[str]) -> tuple[Any, ...]:
    """(role, parts, tool_calls, tool_call_id) of one decoder message; each image, video or audio part takes the
    next hash."""
    content = message.get("content")
    if isinstance(content, list):
        parts: list[Any] = [{p["type"]: next(media, "")} if p.get("type") in ("image", "video", "audio")
                            else p.get("text", "")
                            for p in content]
    else:
        parts = [content or ""]
    return message.get("role"), parts, message.get("tool_calls"), message.get("tool_call_id")


def chat_prefix_keys(messages: Sequence[dict[str, Any]], mm_hashes: Sequence[str], tools: Sequence[dict[str, Any]],
                     salt: str = "", secret: bytes = b"") -> list[str]:
    """key_i of messages[:i+1] for each i; `messages` as the decoder gets them (image and video parts are
    {"type": "image"} / {"type": "video"}, their hashes in that order in `mm_hashes`); `secret`: prefix_secret."""
    media = iter(mm_hashes)
    keys: list[str] = []
    for i, message in enumerate(messages):
        head: tuple[Any, ...] = ("chat", salt, tools) if i == 0 else (keys[-1],)
        keys.append(_key((*head, _canonical(message, media)), secret))
    return keys


def prompt_keys(prompt: str | Sequence[int], salt: str = "", secret: bytes = b"") -> list[str]:
    """The one key of a completions prompt (its own domain: never equal to a chat key)."""
    return [_key(("prompt", salt, prompt), secret)]
