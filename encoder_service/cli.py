"""The `epd-encoder` command line: flags -> config -> the worker's HTTP server."""
from __future__ import annotations

import argparse

from connector.control.curve_flags import GROUP, add_curve_flags, curve_gaps, pop_curve
from connector.tensors.ungathered import UNGATHERED_MAX_AGE_S
from encoder_service.config import EncoderConfig
from encoder_service.lora import add_encoder_lora_flags
from epd_common.cli import Gap, byte_size, key_gaps, refuse_open, run_refusable, worker_parser
from epd_common.startup import ConfigError, run_main
from epd_common.tracing import add_tracing_flags, require_sdk
from epd_models.audio_jobs import add_audio_flags
from epd_models.device_flags import add_device_flags
from epd_models.video_config import add_video_flags

PROG = "epd-encoder"


def build_parser() -> argparse.ArgumentParser:
    """Every epd-encoder flag with its default (docs/FLAGS.md is generated from it)."""
    d = EncoderConfig()
    p = worker_parser(PROG, "EPD encoder worker (vision tower + projector only)", d)
    add_device_flags(p, d)
    p.add_argument("--ec-bind", default=d.ec_bind, help="ZeroMQ endpoint for embeddings (tcp://HOST:PORT or ipc://)")
    p.add_argument("--ec-events-bind", default=d.ec_events_bind,
                   help="ZeroMQ PUB endpoint for cache events (default: beside --ec-bind, port + 1 or random)")
    p.add_argument("--ec-advertise-host", default=d.ec_advertise_host,
                   help="host other machines reach this encoder's ZeroMQ endpoints at (needed when --ec-bind is "
                        "tcp://0.0.0.0:PORT) (default: the bound address)")
    p.add_argument("--ec-cache-bytes", type=int, default=d.ec_cache_bytes,
                   help="bytes of embeddings this encoder keeps (LRU; in-flight items are never evicted); this "
                        "also bounds its shared memory")
    p.add_argument("--ec-shm", choices=("auto", "off"), default=d.ec_shm,
                   help="auto: hold each embedding in its own shared-memory segment (memfd, nothing in /dev/shm) "
                        "that decoders on this host map without a copy (others use ZeroMQ); off: heap and ZeroMQ "
                        "only")
    g = p.add_argument_group("disk tier (embeddings kept through restarts)")
    g.add_argument("--ec-disk-dir", default=d.ec_disk_dir,
                   help="folder every embedding is also written to (under a subfolder per model fingerprint); a "
                        "restarted encoder indexes it and serves repeats from it without encoding them again; one "
                        "encoder per folder (default: off)")
    g.add_argument("--ec-disk-bytes", type=byte_size, default=d.ec_disk_bytes,
                   help="bytes of files the disk tier keeps, least recently used evicted first, e.g. 16GiB")
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size,
                   help="images per vision forward of one call's in-process encode (execute_mm_encoder)")
    _add_scheduler_flags(p.add_argument_group("encode scheduler (batches across requests; admission)"), d)
    p.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels,
                   help="width x height above this is refused before decoding")
    p.add_argument("--max-items-per-request", type=int, default=d.max_items_per_request,
                   help="items one /encode may carry; more get a 400 too_many_items")
    p.add_argument("--max-encode-bytes", type=int, default=d.max_encode_bytes,
                   help="decoded image and video bytes one /encode may carry; more get a 413 request_too_large")
    add_video_flags(p.add_argument_group("video limits"), d)
    add_audio_flags(p.add_argument_group("audio limits"), d)
    add_encoder_lora_flags(p, d)
    _add_producer_limits(p.add_argument_group("connector limits (ZeroMQ producer)"), d)
    add_curve_flags(p.add_argument_group(GROUP), allowed_clients=True)
    add_tracing_flags(p)
    return p


def _add_producer_limits(g: argparse._ActionsContainer, d: EncoderConfig) -> None:
    """The bounds on what decoders may ask of this encoder (the connector's producer side)."""
    g.add_argument("--ec-max-items-per-get", type=int, default=d.ec_max_items_per_get,
                   help="hashes one get or has may ask for; more get an error reply")
    g.add_argument("--ec-max-reply-bytes", type=int, default=d.ec_max_reply_bytes,
                   help="tensor bytes of one get reply beyond its first item; the rest are sent on the next get")
    g.add_argument("--ec-max-parked-gets", type=int, default=d.ec_max_parked_gets,
                   help="gets held for items still encoding; more are answered at once with what is held")
    g.add_argument("--ec-max-parked-hashes", type=int, default=d.ec_max_parked_hashes,
                   help="hashes all held gets may name together (bounds their memory)")


def _add_scheduler_flags(g: argparse._ActionsContainer, d: EncoderConfig) -> None:
    """How the encode scheduler batches items across calls, and what it admits."""
    g.add_argument("--max-encode-batch-items", type=int, default=d.max_encode_batch_items,
                   help="items per vision forward, from any calls")
    g.add_argument("--max-encode-batch-tokens", type=int, default=d.max_encode_batch_tokens,
                   help="vision tokens per vision forward, counted by the family's processor (an item larger than "
                        "this still runs, alone)")
    g.add_argument("--max-pending-encode-tokens", type=int, default=d.max_pending_encode_tokens,
                   help="vision tokens waiting for the encode thread; a call past it gets 503 encoder_busy with "
                        "Retry-After (the proxy tries another encoder)")
    g.add_argument("--max-ungathered-bytes", type=byte_size, default=d.max_ungathered_bytes,
                   help="bytes of stored embeddings no decoder has fetched yet (each counted for at most "
                        f"{UNGATHERED_MAX_AGE_S:.0f} s); past it a call with items to encode gets 503 encoder_busy "
                        "(default: half of --ec-cache-bytes)")


def parse_args(argv: list[str] | None = None) -> EncoderConfig:
    p = build_parser()
    args = p.parse_args(argv)
    for flag in ("max_batch_size", "max_encode_batch_items", "max_encode_batch_tokens", "max_pending_encode_tokens",
                 "ec_disk_bytes", "max_ungathered_bytes"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    curve = pop_curve(p, args)
    args.lora_modules = tuple(args.lora_modules)
    if args.lora_modules and not args.enable_lora:
        p.error("--lora-modules needs --enable-lora")
    cfg = EncoderConfig(**vars(args), curve=curve)
    refuse_open(p, cfg, security_gaps(cfg))
    return cfg


def security_gaps(cfg: EncoderConfig) -> list[Gap]:
    return key_gaps(cfg) + curve_gaps(cfg)


def main(argv: list[str] | None = None) -> None:
    run_main(PROG, _main, argv)


def _main(argv: list[str]) -> None:
    cfg = parse_args(argv)  # NOTE: before torch and transformers load: --help and usage errors answer at once
    check_before_loading(cfg)
    from encoder_service.server import create_app

    run_refusable(PROG, "encoder", cfg, create_app, security_gaps(cfg), lambda app: app.state.encoder.refused)


def check_before_loading(cfg: EncoderConfig) -> None:
    """ConfigError for what can be told before the model loads: the tracing extra, the model, a disk-tier folder
    another user could change."""
    from connector.tensors.disk_tier import DiskTierError, check_tier_folder
    from epd_models.resolve import resolve_model

    if cfg.otlp_traces_endpoint:
        require_sdk()
    from epd_models.quant.load import check_checkpoint
    from epd_models.quant.scheme import QuantError

    try:
        check_checkpoint(resolve_model(cfg.model))  # a quantized tower is dequantized at load: its tensors must be sound
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    except QuantError as exc:
        raise ConfigError(f"model {cfg.model}: {exc}") from None
    if cfg.ec_disk_dir is not None:
        try:
            check_tier_folder(cfg.ec_disk_dir)
        except DiskTierError as exc:
            raise ConfigError(str(exc)) from None


if __name__ == "__main__":
    main()
