"""Value checks of disagg-epd-proxy's flags (argparse types): each turns one flag's text into its value or a usage
error naming the bound."""
from __future__ import annotations

import argparse
from collections.abc import Callable

from epd_common.cli import byte_size
from epd_contracts.video import MAX_VIDEO_FRAMES

MAX_PROXY_WORKERS = 64  # more proxy processes than this on one host is a typo, not a plan
MAX_TENSOR_PARALLEL = 64  # epd-decoder's own bound on --tensor-parallel-size (tests/launcher check they agree)
NO_PREFILL = ("disable", "none", "")  # vLLM's spellings of "E + PD": no separate prefill stage


def prefill_url(value: str) -> str:
    """--prefill-servers-urls: a prefill worker's URL, or vLLM's "no separate prefill stage" (disable, none, "")."""
    return "disable" if value.strip().lower() in NO_PREFILL else value


def positive_bytes(value: str) -> int:
    """A bytes flag (epd_common.cli.byte_size) that must be at least 1."""
    number = byte_size(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1 byte")
    return number


def choice(values: tuple[str, ...]) -> Callable[[str], str]:
    """A flag with a fixed set of values (a type, so the launcher's table of passed-on flags can hold it)."""
    def check(value: str) -> str:
        if value not in values:
            raise argparse.ArgumentTypeError(f"{value!r}: expected one of {', '.join(values)}")
        return value
    return check


def positive(value: str) -> int:
    """An int flag that must be >= 1."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1")
    return number


def tensor_parallel_size(value: str) -> int:
    """--tensor-parallel-size: 1 .. MAX_TENSOR_PARALLEL, what each spawned decoder takes."""
    number = int(value)
    if not 1 <= number <= MAX_TENSOR_PARALLEL:
        raise argparse.ArgumentTypeError(f"{value}: must be in 1..{MAX_TENSOR_PARALLEL}")
    return number


def speculative_config(value: str) -> str:
    """--speculative-config: vLLM's JSON, checked as epd-decoder checks it (parse_spec_config: json and dataclasses
    only, no torch) and passed on to the workers as given."""
    # NOTE: imported here: the proxy image has no decoder_service (tests/test_torch_free.py), and only launcher mode,
    # which spawns decoders from it, takes this flag
    from decoder_service.engine.spec.config import parse_spec_config

    try:
        parse_spec_config(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--speculative-config: ")) from None
    return value


def lora_module(value: str) -> str:
    """One --lora-modules item (name=path or vLLM's JSON), checked as epd-decoder checks it and passed on as given."""
    from epd_common.lora_flags import lora_module_argument

    lora_module_argument(value)
    return value


def default_mm_loras(value: str) -> str:
    """--default-mm-loras: vLLM's JSON {modality: adapter folder}, checked as epd-decoder checks it, passed as given."""
    from decoder_service.lora_defaults import mm_loras_argument  # NOTE: here, as speculative_config's

    mm_loras_argument(value)
    return value


def proxy_workers(value: str) -> int:
    """--proxy-workers: 1 .. MAX_PROXY_WORKERS."""
    number = int(value)
    if not 1 <= number <= MAX_PROXY_WORKERS:
        raise argparse.ArgumentTypeError(f"{value}: must be in 1..{MAX_PROXY_WORKERS}")
    return number


def video_frames(value: str) -> int:
    """--max-video-frames: 1 .. the contract's MAX_VIDEO_FRAMES."""
    number = int(value)
    if not 1 <= number <= MAX_VIDEO_FRAMES:
        raise argparse.ArgumentTypeError(f"{value}: must be in 1..{MAX_VIDEO_FRAMES}")
    return number



def base_port(text: str) -> int:
    port = int(text)
    if not (port == 0 or 1024 <= port <= 65535 - 256):
        raise argparse.ArgumentTypeError(f"must be 0 or a port from 1024 to {65535 - 256}, got {text}")
    return port

