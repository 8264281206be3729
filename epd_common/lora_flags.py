"""What the LoRA flags of every worker mean (torch-free): `--lora-modules` items, as vLLM's (`name=path` or the JSON
object with `base_model_name`), and `--max-lora-rank`'s choices. The decoder reads the adapters' language-model
weights (decoder_service/lora.py), an encoder their vision-tower weights (encoder_service/lora.py)."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

MAX_NAME_CHARS = 256
RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def lora_module_argument(value: str) -> LoRAModule:
    """argparse's type for one --lora-modules item: `name=path` or vLLM's JSON object."""
    if value.lstrip().startswith("{"):
        try:
            raw: Any = json.loads(value)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules: not JSON: {exc}") from None
        if not isinstance(raw, dict) or set(raw) - {"name", "path", "base_model_name"} or \
                not all(isinstance(raw.get(k), str) and raw[k] for k in ("name", "path")):
            raise argparse.ArgumentTypeError('--lora-modules: JSON needs "name" and "path" strings (and optionally '
                                             '"base_model_name"), nothing else')
        module = LoRAModule(raw["name"], raw["path"], raw.get("base_model_name"))
    else:
        name, eq, path = value.partition("=")
        if not eq or not name or not path:
            raise argparse.ArgumentTypeError(f"--lora-modules: {value!r} is not name=path")
        module = LoRAModule(name, path)
    if len(module.name) > MAX_NAME_CHARS or not module.name.isprintable():
        raise argparse.ArgumentTypeError(f"--lora-modules: a name is printable and at most {MAX_NAME_CHARS} chars")
    return module
