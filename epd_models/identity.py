"""What makes an encoder and a decoder compatible: one checkpoint's identity, reported in every worker's /health."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def model_identity(model_dir: str | Path) -> dict[str, Any]:
    """{family, fingerprint, hidden_size} of the checkpoint in model_dir.

    The fingerprint is a hash of config.json's canonical JSON: the same checkpoint gives the same value on every
    host and path; an encoder and a decoder whose fingerprints differ must not be paired (their embeddings
    would be read by the wrong language model).
    """
    config = json.loads((Path(model_dir) / "config.json").read_text())
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    text = config.get("text_config") or {}
    hidden = text.get("hidden_size", config.get("hidden_size"))
    return {"family": str(config.get("model_type", "unknown")), "fingerprint": hashlib.sha256(canonical).hexdigest()[:16],
            "hidden_size": int(hidden) if hidden is not None else None}
