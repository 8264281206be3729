"""mm_hash: computed by the proxy over the image bytes and the model identity, never taken from a client."""
from __future__ import annotations

import hashlib


def mm_hash(model_identity: str, data: bytes) -> str:
    h = hashlib.sha256()
    h.update(model_identity.encode())
    h.update(b"\0")  # NOTE: separator, so (model, bytes) pairs cannot collide by shifting bytes
    h.update(data)
    return h.hexdigest()
