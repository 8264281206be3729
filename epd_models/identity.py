"""What makes an encoder and a decoder compatible: one checkpoint's identity, reported in every worker's /health."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from epd_models.video_config import video_config


def served_name(model: str) -> str:
    """The name clients send for a --model: 'demo' and 'bench' as they are, a path or hub id by its last part.

    NOTE: the same rule as proxy.workers.served_name, which the proxy applies to /health `model`; the proxy may
    not import epd_models (the torch-free-front import contract), so the three lines live in both places.
    """
    return model if model in ("demo", "bench") else os.path.basename(os.path.normpath(model))


def model_identity(model_dir: str | Path, model: str | None = None) -> dict[str, Any]:
    """{family, served_name, fingerprint, hidden_size, video} of the checkpoint in model_dir, served as --model
    `model` (None: the directory itself).

    The fingerprint is a hash of config.json's canonical JSON: the same checkpoint gives the same value on every
    host and path; an encoder and a decoder whose fingerprints differ must not be paired (their embeddings
    would be read by the wrong language model). The served name is only what clients call it: two workers
    that name one checkpoint differently still pair. hidden_size is the language model's (the width of an
    image's rows on the connector). video is its VideoConfig as a dict (epd_models/video_config.py: how the proxy
    samples a video's frames for this model), or None when the model takes no video.
    """
    config = json.loads((Path(model_dir) / "config.json").read_text())
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    # NOTE: from the config class, not the JSON: a checkpoint may leave out a default (llava-1.5-7b-hf's
    # text_config has no hidden_size: LlamaConfig's 4096)
    hidden = AutoConfig.from_pretrained(model_dir).get_text_config().hidden_size
    family = str(config.get("model_type", "unknown"))
    video = video_config(model_dir, family)
    return {"family": family, "served_name": served_name(str(model_dir) if model is None else model),
            "fingerprint": hashlib.sha256(canonical).hexdigest()[:16], "hidden_size": int(hidden),
            "video": video.as_dict() if video is not None else None}
