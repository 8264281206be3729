"""What makes an encoder and a decoder compatible: one checkpoint's identity, reported in every worker's /health."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from epd_contracts.audio import AudioConfig
from epd_models.video_config import video_config


def served_name(model: str) -> str:
    """The name clients send for a --model: 'demo' and 'bench' as they are, a path or hub id by its last part.

    NOTE: the same rule as proxy.workers.served_name, which the proxy applies to /health `model`; the proxy may
    not import epd_models (the torch-free-front import contract), so the three lines live in both places.
    """
    return model if model in ("demo", "bench") else os.path.basename(os.path.normpath(model))


def model_identity(model_dir: str | Path, model: str | None = None) -> dict[str, Any]:
    """{family, served_name, fingerprint, hidden_size, image, video, audio} of the checkpoint in model_dir, served as
    --model `model` (None: the directory itself).

    The fingerprint is a hash of config.json's canonical JSON: the same checkpoint gives the same value on every
    host and path; an encoder and a decoder whose fingerprints differ must not be paired (their embeddings
    would be read by the wrong language model). The served name is only what clients call it: two workers
    that name one checkpoint differently still pair. hidden_size is the language model's (the width of an
    image's rows on the connector). image: whether the family takes images at all (Qwen2-Audio and Phi-4-multimodal
    do not: the proxy refuses an image for them before fetching it). video is its VideoConfig as a dict
    (epd_models/video_config.py: how the proxy samples a video's frames for this model), or None when the model takes
    no video; audio the same for its AudioConfig (epd_contracts/audio.py).
    """
    config = json.loads((Path(model_dir) / "config.json").read_text())
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    # NOTE: from the config class, not the JSON: a checkpoint may leave out a default (llava-1.5-7b-hf's
    # text_config has no hidden_size: LlamaConfig's 4096)
    hidden = AutoConfig.from_pretrained(model_dir).get_text_config().hidden_size  # a composite's: the served part's
    family = str(config.get("model_type", "unknown"))
    video = video_config(model_dir, _adapter_name(model_dir, family))
    audio = audio_config(model_dir)
    return {"family": family, "served_name": served_name(str(model_dir) if model is None else model),
            "fingerprint": hashlib.sha256(canonical).hexdigest()[:16], "hidden_size": int(hidden),
            "image": takes_images(model_dir), "video": video.as_dict() if video is not None else None,
            "audio": audio.as_dict() if audio is not None else None}


def _adapter_name(model_dir: str | Path, family: str) -> str:
    """The served family's adapter name (Qwen2.5-Omni's thinker checkpoints say qwen2_5_omni_thinker), else the
    model_type."""
    from epd_models.registry import adapter_for, load_config

    try:
        return adapter_for(load_config(model_dir)).name
    except ValueError:
        return family


def takes_images(model_dir: str | Path) -> bool:
    """Whether the checkpoint's family takes image input (an audio-only family has no image token: -1)."""
    from epd_models.registry import adapter_for, load_config

    try:
        cfg = load_config(model_dir)
        return adapter_for(cfg).image_token_id(cfg) >= 0
    except ValueError:  # not a family we serve: say nothing narrower than before
        return True


def audio_config(model_dir: str | Path) -> AudioConfig | None:
    """The checkpoint's AudioConfig (epd_models/audio.py: the rate clips are resampled to, the window its encoder
    encodes apart, where its processor cuts a clip), or None when its family takes no audio (then no processor is
    loaded)."""
    from epd_models.audio import AudioHooks
    from epd_models.processors import load_processor
    from epd_models.registry import adapter_for, load_config

    cfg = load_config(model_dir)
    adapter = adapter_for(cfg)
    if type(adapter).audio_config is AudioHooks.audio_config:
        return None
    return adapter.audio_config(cfg, load_processor(model_dir))


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def encoder_fingerprint(model_dir: str | Path, dtype: str, device: str) -> str:
    """The key an encoder's disk tier files its embeddings under (connector/tensors/disk_tier.py): anything that
    changes an embedding's bits changes it. config.json and the processor's JSON files by content, the weight files
    by name, size and modification time (hashing gigabytes at every start is not worth it; a file replaced in
    place changes its time), the dtype and device kind, and the torch and transformers versions (an upgrade may move
    the last bits of a vision forward, and parity is exact)."""
    import torch
    import transformers

    root = Path(model_dir)
    h = hashlib.sha256(b"epd-encoder-fingerprint/v1\0")
    for name in sorted(p.name for p in root.iterdir() if p.is_file()):
        path = root / name
        if name.endswith(".json"):
            h.update(f"{name}\0".encode() + path.read_bytes() + b"\0")
        elif name.endswith(_WEIGHT_SUFFIXES):
            st = path.stat()
            h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    h.update(f"{dtype}\0{device.split(':')[0]}\0{torch.__version__}\0{transformers.__version__}".encode())
    return h.hexdigest()[:32]
