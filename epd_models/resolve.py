"""Turn a --model argument into a local checkpoint directory."""
from __future__ import annotations

from pathlib import Path

# epd_builders/bench_model.py PRESETS (not imported: torch)
BENCH_MODELS = ("bench", "bench-lm", "bench-video", "bench-peer", "bench-qwen05", "bench-audio")


def resolve_model(name: str) -> Path:
    """'demo' -> the bundled demo model; 'bench', 'bench-lm', 'bench-video', 'bench-peer', 'bench-qwen05' or
    'bench-audio' -> a cached benchmark model (built on first use; epd_builders/bench_model.py); a directory -> itself; else a hub id (needs a
    network)."""
    if name == "demo":
        from epd_models.demo import find_demo_model

        return find_demo_model()
    if name in BENCH_MODELS:
        from epd_builders.bench_model import PRESETS, ensure_bench_model

        return ensure_bench_model(PRESETS[name], name)
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]))
    except Exception as exc:  # offline, unknown repo, ...
        known = ", ".join(repr(n) for n in ("demo", *BENCH_MODELS))
        raise FileNotFoundError(f"model {name!r} is neither one of {known}, a local directory, nor a reachable hub "
                                f"id: {exc}") from exc
