"""Checks the K/V store, server and client share, so each side refuses the same inconsistent hand-off. Torch-free."""
from __future__ import annotations

from epd_contracts.kv import KVLayout

MAX_KV_REPLY_BYTES = 4 << 30  # block bytes of one kv_reply: a prompt's blocks travel together, so this bounds a prompt


def layout_difference(want: KVLayout, have: KVLayout | None) -> str:
    """The fields where `have` differs from `want` ("" when equal), e.g. "kv_heads 8 (asked 4)"."""
    if have is None:
        return "no layout"
    diffs = [f"{name} {getattr(have, name)!r} (asked {getattr(want, name)!r})"
             for name in KVLayout.__struct_fields__ if getattr(have, name) != getattr(want, name)]
    return "; ".join(diffs)[:512]


def extent_error(layout: KVLayout, num_tokens: int, num_blocks: int) -> str:
    """Why `num_tokens` positions do not fill exactly `num_blocks` blocks (the last may be partial), or ""."""
    size = layout.block_size
    if num_tokens > num_blocks * size or (num_blocks and num_tokens <= (num_blocks - 1) * size):
        return f"{num_tokens} token(s) do not fill {num_blocks} block(s) of {size}"
    return ""
