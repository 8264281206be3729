"""Counts and lengths every chat request is held to, at the proxy and again at the decoder (module constants).

Fixed, not flags: they bound the work one request can ask for (objects parsed, template loops), far above any
real conversation; body size (--max-body-bytes) and the context length stay the configurable limits.
"""
from __future__ import annotations

MAX_MESSAGES = 2048  # messages in one request
MAX_PARTS_PER_MESSAGE = 512  # content parts in one message
MAX_TOTAL_PARTS = 4096  # content parts in the whole request
MAX_NAME_CHARS = 256  # a message's `name`
MAX_MODEL_NAME_CHARS = 256  # the requested `model` (echoed in the 404 if unknown)


def parts_error(num_parts: list[int]) -> str | None:
    """Why a request whose messages have `num_parts` content parts each breaks a part cap, or None."""
    for i, n in enumerate(num_parts):
        if n > MAX_PARTS_PER_MESSAGE:
            return f"message {i} has {n} content parts; the maximum is {MAX_PARTS_PER_MESSAGE}"
    if sum(num_parts) > MAX_TOTAL_PARTS:
        return f"the request has {sum(num_parts)} content parts; the maximum is {MAX_TOTAL_PARTS}"
    return None
