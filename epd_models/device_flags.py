"""The --device and --dtype flags of the workers (where and in what precision a half runs)."""
from __future__ import annotations

import argparse
from typing import Any

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def device_arg(value: str) -> str:
    """--device: auto (cuda if available, else cpu), cpu, cuda, cuda:N -> the resolved device, e.g. 'cuda:0'."""
    from epd_models.halves import resolve_device  # NOTE: local import: torch is loaded only when parsing

    try:
        return str(resolve_device(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_device_flags(p: argparse._ActionsContainer, defaults: Any) -> None:
    p.add_argument("--device", type=device_arg, default=defaults.device,
                   help="where the model runs: auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=defaults.dtype,
                   help="weights' dtype; auto: the checkpoint's own (config.json dtype), float32 if it names none")
