"""Adapters applied by modality, as vLLM's `default_mm_loras`: a request that names no adapter and holds an image,
video or audio clip runs under that modality's adapter.

Some checkpoints answer correctly only so: Phi-4-multimodal ships `speech-lora/` and `vision-lora/` beside its
weights, trained for its audio and image paths (its FamilySpec.shipped_loras). Those are applied by default when the
folders are there; `--default-mm-loras` (vLLM's JSON, `{"audio": "/path/speech-lora"}`) names others, and
`--default-mm-loras '{}'` turns them off. They load at start whether or not --enable-lora is given, as part of the
checkpoint: not listed in /v1/models, not counted in --max-loras, not unloadable, and their rank may be up to 512
(a checkpoint's own adapters are as trusted as its weights; shapes and values are checked as any adapter's). A
request holding several modalities takes the first of image, video, audio that has one (Phi-4's rule: an image
beside speech takes the vision adapter). Its prefix blocks are salted with the adapter, as a named one's."""
from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from epd_contracts.generate import ImageRef

MODALITIES = ("image", "video", "audio")  # in the order a request with several takes its adapter
PREFIX = "default-mm:"  # the names they load under; --lora-modules and runtime loads may not take one


def mm_loras_argument(value: str) -> tuple[tuple[str, str], ...]:
    """argparse's type for --default-mm-loras: a JSON object {modality: adapter folder}."""
    try:
        raw: Any = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--default-mm-loras: not JSON: {exc}") from None
    if not isinstance(raw, dict) or set(raw) - set(MODALITIES) or \
            not all(isinstance(v, str) and v for v in raw.values()):
        raise argparse.ArgumentTypeError(f"--default-mm-loras: a JSON object from {list(MODALITIES)} to adapter "
                                         "folders, e.g. '{\"audio\": \"/models/phi4/speech-lora\"}'")
    return tuple((m, raw[m]) for m in MODALITIES if m in raw)


def default_folders(model_dir: Path, shipped: Iterable[tuple[str, str]],
                    given: tuple[tuple[str, str], ...] | None) -> dict[str, Path]:
    """modality -> adapter folder: `given` (--default-mm-loras), else the checkpoint's `shipped` subfolders that
    exist in `model_dir`."""
    if given is not None:
        return {m: Path(p).expanduser() for m, p in given}
    return {m: model_dir / sub for m, sub in shipped if (model_dir / sub).is_dir()}


def loaded_names(folders: dict[str, Path]) -> tuple[dict[str, str], dict[str, Path]]:
    """(modality -> adapter name, adapter name -> folder): one adapter per folder, named by its first modality."""
    by_folder: dict[Path, str] = {}
    for modality, folder in folders.items():
        by_folder.setdefault(folder, PREFIX + modality)
    return {m: by_folder[f] for m, f in folders.items()}, {n: f for f, n in by_folder.items()}


def modalities(refs: Iterable[ImageRef]) -> set[str]:
    """The modalities a request's items are (a video's sound track is both video and audio)."""
    found: set[str] = set()
    for ref in refs:
        found.add("audio" if ref.audio is not None else "video" if ref.video is not None else "image")
        if ref.in_video:
            found.add("video")
    return found


def default_for(defaults: dict[str, str], refs: Iterable[ImageRef]) -> str:
    """The adapter name a request that names none runs under ("" the base model)."""
    if not defaults:
        return ""
    held = modalities(refs)
    return next((defaults[m] for m in MODALITIES if m in held and m in defaults), "")


def is_reserved(name: str) -> bool:
    return name.startswith(PREFIX)
