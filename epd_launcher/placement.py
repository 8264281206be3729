"""Which GPUs each worker the launcher spawns runs on (spawn.py), checked before anything starts (preflight.py).

One GPU per decoder (--tensor-parallel-size 1, the default): every worker, encoders first, then decoders, then
prefill workers, gets `--device cuda:i` round-robin over the visible GPUs. With --tensor-parallel-size N > 1 each
decoder and each prefill worker gets N consecutive GPUs of its own, none shared with another decoder or prefill
worker: it sees only them (CUDA_VISIBLE_DEVICES, the launcher's own visible list taken into account) and runs on
`--device cuda:0`, its ranks on cuda:0 .. cuda:N-1. Encoders stay round-robin over all the visible GPUs (they may
share one with a decoder, as with N = 1). No GPU: the workers' default device, the N ranks sharing the CPU.
torch-free at import: attach mode loads preflight.py, which loads this."""
from __future__ import annotations

import argparse
import os
from typing import NamedTuple

from epd_common.startup import ConfigError

VISIBLE = "CUDA_VISIBLE_DEVICES"


class Placement(NamedTuple):
    """Where one spawned worker runs: flags added to its command line, variables added to its environment."""

    flags: tuple[str, ...]
    env: dict[str, str]


def place_workers(num_encoders: int, num_decoders: int, num_prefills: int, tensor_parallel_size: int, gpus: int,
                  visible: str | None = None) -> list[Placement]:
    """The placement of each worker, encoders first, then decoders, then prefill workers (spawn.py's order), on
    `gpus` visible GPUs; `visible`: the launcher's own CUDA_VISIBLE_DEVICES (None: unset). ConfigError when the
    decoders and prefill workers need more GPUs than are visible."""
    num_engines = num_decoders + num_prefills
    if not gpus:
        return [Placement((), {}) for _ in range(num_encoders + num_engines)]
    if tensor_parallel_size <= 1:
        return [Placement(("--device", f"cuda:{i % gpus}"), {}) for i in range(num_encoders + num_engines)]
    ids = visible_ids(gpus, visible)
    if num_engines * tensor_parallel_size > len(ids):
        raise ConfigError(_too_few(num_decoders, num_prefills, tensor_parallel_size, ids, visible))
    tp = tensor_parallel_size
    encoders = [Placement(("--device", f"cuda:{i % gpus}"), {}) for i in range(num_encoders)]
    engines = [Placement(("--device", "cuda:0"), {VISIBLE: ",".join(ids[j * tp:(j + 1) * tp])})
               for j in range(num_engines)]
    return encoders + engines


def visible_ids(gpus: int, visible: str | None) -> list[str]:
    """The names of the `gpus` GPUs the launcher sees, as a child's CUDA_VISIBLE_DEVICES names them: its own list's
    entries (indices or UUIDs) when it was started with one, else 0 .. gpus-1."""
    if visible is None:
        return [str(i) for i in range(gpus)]
    return [entry.strip() for entry in visible.split(",") if entry.strip()][:gpus]


def _too_few(num_decoders: int, num_prefills: int, tp: int, ids: list[str], visible: str | None) -> str:
    workers = f"{num_decoders} decoder(s)" + (f" and {num_prefills} prefill worker(s)" if num_prefills else "")
    seen = f"{len(ids)} GPU(s) are visible" + (f" ({VISIBLE}={visible})" if visible is not None else "")
    return (f"--tensor-parallel-size {tp}: {workers} need {(num_decoders + num_prefills) * tp} GPUs ({tp} each, none "
            f"shared), but {seen}; lower --num-decoders, --num-prefills or --tensor-parallel-size, or make more GPUs "
            "visible")


def worker_counts(args: argparse.Namespace) -> tuple[int, int, int]:
    """(encoders, decoders, prefill workers) the launcher spawns: an aggregated set has only decoders."""
    apart = not args.aggregated
    return (args.num_encoders if apart else 0), args.num_decoders, (args.num_prefills if apart else 0)


def placements(args: argparse.Namespace) -> list[Placement]:
    """place_workers for this command line on the GPUs this process sees."""
    import torch  # NOTE: here: attach mode never loads it

    return place_workers(*worker_counts(args), args.tensor_parallel_size or 1, torch.cuda.device_count(),
                         os.environ.get(VISIBLE))
