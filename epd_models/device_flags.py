"""The --device and --dtype flags of the workers (where and in what precision a half runs)."""
from __future__ import annotations

import argparse
from typing import Any

from epd_common.weight_flags import (
    DTYPE_CHOICES,
    QUANTIZATION_CHOICES,
    QUANTIZATION_HELP,
    QUANTIZED_WEIGHTS_CHOICES,
    QUANTIZED_WEIGHTS_HELP,
)


def device_arg(value: str) -> str:
    """--device: auto (cuda if available, else cpu), cpu, cuda, cuda:N -> the resolved device, e.g. 'cuda:0'."""
    from epd_models.device import resolve_device  # NOTE: local import: torch is loaded only when parsing

    try:
        return str(resolve_device(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_device_flags(p: argparse._ActionsContainer, defaults: Any) -> None:
    p.add_argument("--device", type=device_arg, default=defaults.device,
                   help="where the model runs: auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=defaults.dtype,
                   help="weights' dtype (of what a quantized checkpoint leaves unquantized, and what its weights "
                        "dequantize to); auto: the checkpoint's own (config.json dtype), float32 if it names none")


def add_quant_flags(p: argparse._ActionsContainer, defaults: Any) -> None:
    """The decoder's (and the launcher's, passed on) flags for quantized checkpoints."""
    p.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=defaults.quantization,
                   help=QUANTIZATION_HELP)
    p.add_argument("--quantized-weights", choices=QUANTIZED_WEIGHTS_CHOICES, default=defaults.quantized_weights,
                   help=QUANTIZED_WEIGHTS_HELP)
