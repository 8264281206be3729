"""LoRA adapters whose weights reach the vision tower (or projector), applied on the encoder: `--enable-lora
--lora-modules name=path` as the decoders get them (the launcher passes both to every worker), `--max-lora-rank`.

Each adapter's vision-half tensors are read and checked against this encoder's vision linears at start (its
language-model tensors are the decoders'; an adapter with none here is not this encoder's business: its requests'
images are the base model's). A request under such an adapter sends its images with `lora` set and their mm_hash
`epd_contracts.hashing.adapter_hash(image hash, name)`, which this encoder checks as it checks every hash: an image
encoded under one adapter is cached and served under that key only, never under another adapter or the base. Images
of different adapters never share a vision forward (`ImageJob.group`). Videos and audio under an adapter with vision
weights are refused (a 400): only images take them in this version."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epd_common.lora_flags import RANKS, lora_module_argument

if TYPE_CHECKING:
    from epd_models.halves import VisionHalf
    from epd_models.lora.layers import LoRASet


def add_encoder_lora_flags(p: argparse.ArgumentParser, d: Any) -> None:
    g = p.add_argument_group("LoRA adapters (their vision-tower weights)")
    g.add_argument("--enable-lora", action="store_true",
                   help="apply the vision-tower weights of the --lora-modules adapters to images sent under them")
    g.add_argument("--lora-modules", type=lora_module_argument, nargs="+", default=[],
                   help="the decoders' adapters: name=path, or JSON {\"name\", \"path\", \"base_model_name\"}")
    g.add_argument("--max-lora-rank", type=int, choices=RANKS, default=d.max_lora_rank,
                   help="the largest rank an adapter may have; a larger one is refused")


def attach_vision_loras(vision: VisionHalf, cfg: Any) -> LoRASet | None:
    """The adapters with vision-half tensors, read, checked and added to `vision`'s linears (LoRAError if one is
    refused: exit 2); None when --enable-lora is off or none has any."""
    if not cfg.enable_lora:
        return None
    from epd_models.lora.layers import LoRASet
    from epd_models.lora.peft_format import linear_shapes, read_adapter

    shapes = linear_shapes(vision.module, vision.adapter.vision_prefixes)
    adapters = [read_adapter(m.name, Path(m.path), family=vision.adapter, shapes=shapes, max_rank=cfg.max_lora_rank,
                             dtype=vision.dtype, base_model_name=m.base_model_name, vision=True)
                for m in cfg.lora_modules]
    mine = [a for a in adapters if a.weights]
    if not mine:
        return None
    vision.lora = LoRASet(vision.module, mine, len(mine), vision.dtype)
    return vision.lora
