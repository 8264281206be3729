"""A decoder's /generate stream as the contract's events, line by line: an unreadable line or a lost connection is an
error event, never an exception inside the client's response."""
from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from epd_contracts.generate import Event


class StreamEnded(Exception):
    """The decoder's stream closed before its first event."""


_EVENT = msgspec.json.Decoder(Event)


def decode_event(line: bytes) -> Event:
    """A line that is not an event of the contract ends this stream with an error event, never with an exception
    inside the client's response."""
    try:
        return _EVENT.decode(line)
    except msgspec.MsgspecError as exc:
        return Event(type="error", message=f"the decoder sent an unreadable event: {exc}")


def lost(exc: Exception) -> Event:
    return Event(type="error", message=f"decoder connection lost: {type(exc).__name__}")


async def next_event(lines: AsyncIterator[bytes]) -> Event:
    """The first non-empty line as an event."""
    async for line in lines:
        if line:
            return decode_event(line)
    raise StreamEnded
