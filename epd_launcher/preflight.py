"""What the launcher checks before it starts anything: the GPUs the decoders need, the model, each decoder's K/V
arithmetic and the ports; a failure is a ConfigError (one line, exit 2), not a worker's traceback a minute later."""
from __future__ import annotations

import argparse
import contextlib
import os
import socket
from pathlib import Path

from epd_common.server import ENV_REUSE_PORT
from epd_common.startup import ConfigError
from epd_launcher.group import reserve_port
from epd_launcher.placement import placements


def check_launch(args: argparse.Namespace) -> Path:
    """Launcher mode, before any worker is spawned: the model's directory (ConfigError when it cannot be had)."""
    placements(args)  # --tensor-parallel-size N: N GPUs of its own for each decoder and prefill worker
    model_dir = resolve(args.model)
    check_quant(args, model_dir)
    check_kv(args, model_dir)
    check_port_free(args.host, args.port)
    check_worker_ports(args)
    return model_dir


def resolve(model: str) -> Path:
    """--model as a checkpoint directory with a config.json."""
    from epd_models.resolve import resolve_model  # NOTE: here: attach mode and --help never load it

    try:
        model_dir = resolve_model(model)
    except FileNotFoundError as exc:
        raise ConfigError(f"--model: {exc}") from None
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"--model {model}: {model_dir} has no config.json: not a checkpoint directory")
    return model_dir


def check_quant(args: argparse.Namespace, model_dir: Path) -> None:
    """A quantized checkpoint EPD will not load, or a --quantization that disagrees with it (the decoder's check)."""
    from decoder_service.preflight import check_quantized

    check_quantized(model_dir, args.quantization)


def check_kv(args: argparse.Namespace, model_dir: Path) -> None:
    """An explicit --max-model-len that an explicit --kv-cache-memory cannot hold, or a model that does not split
    over --tensor-parallel-size (its K/V heads), with the decoder's own numbers (decoder_service.preflight.check_kv_fits,
    from the checkpoint's config: no weights are loaded)."""
    ranks = args.tensor_parallel_size or 1
    if not (args.max_model_len and args.kv_cache_memory) and ranks == 1:
        return
    import torch

    from decoder_service.config import DecoderConfig
    from decoder_service.preflight import check_kv_fits

    try:
        check_kv_fits(model_dir, dtype=args.dtype or DecoderConfig.dtype, device="cuda" if torch.cuda.device_count() else "cpu",
                      block_size=args.block_size or DecoderConfig.block_size, max_model_len=args.max_model_len or 0,
                      kv_cache_memory=args.kv_cache_memory or 0, ranks=ranks)
    except ConfigError as exc:
        raise ConfigError(f"each decoder: {exc}") from None


def check_port_free(host: str, port: int) -> None:
    """ConfigError now, before any worker is spawned or waited for, if the proxy could not listen."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
        if os.environ.get(ENV_REUSE_PORT) == "1":  # as epd_common.server.serve will bind it: beside a reservation
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (another process uses the "
                              "port? pick one with --port)") from None


def check_worker_ports(args: argparse.Namespace) -> None:
    """With --worker-base-port: every worker's port can be reserved now (the spawn reserves each again)."""
    if not args.worker_base_port:
        return
    apart = not args.aggregated
    roles = (["an encoder"] * (args.num_encoders if apart else 0) + ["a decoder"] * args.num_decoders
             + ["a prefill worker"] * (args.num_prefills if apart else 0))  # spawn.py's order of ports
    with contextlib.ExitStack() as held:
        for port, role in enumerate(roles, start=args.worker_base_port):
            try:
                held.enter_context(reserve_port(args.worker_host, port))
            except OSError as exc:
                raise ConfigError(f"cannot reserve port {port} on {args.worker_host} for {role} "
                                  f"({exc.strerror or exc}); pick another --worker-base-port") from None
