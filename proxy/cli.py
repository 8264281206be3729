"""disagg-epd-proxy: launcher mode (spawn workers here) or attach mode (workers started elsewhere)."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from common.cli import add_curve_flags, pop_curve
from common.http import serve
from common.logs import setup_logging
from connector.security import CurveConfig
from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.launcher import WorkerGroup

logger = logging.getLogger("epd.proxy")


def _urls(values: list[str] | None) -> tuple[str, ...]:
    """Accept both `--x a b` and `--x a,b`."""
    return tuple(u.strip().rstrip("/") for v in values or [] for u in v.split(",") if u.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("disagg-epd-proxy", description=__doc__)
    p.add_argument("--model", default="demo", help="launcher mode: 'demo', a checkpoint dir, or a hub id")
    p.add_argument("--num-encoders", type=int, default=1, help="launcher mode: encoder processes to spawn")
    p.add_argument("--num-decoders", type=int, default=1, help="launcher mode: decoder processes to spawn")
    p.add_argument("--encode-servers-urls", nargs="+", help="attach mode: encoder base URLs")
    p.add_argument("--decode-servers-urls", nargs="+", help="attach mode: decoder base URLs")
    p.add_argument("--served-model-name", default=None, help="name clients send as `model` (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--worker-host", default="127.0.0.1", help="launcher mode: address workers bind")
    p.add_argument("--max-images-per-request", type=int, default=16)
    p.add_argument("--max-image-bytes", type=int, default=20 << 20)
    p.add_argument("--max-body-bytes", type=int, default=64 << 20)
    p.add_argument("--max-image-pixels", type=int, default=40_000_000, help="larger images get a 400")
    p.add_argument("--allowed-local-media-path", default=None,
                   help="serve file:// image URLs from under this directory (default: file URLs are refused)")
    p.add_argument("--allowed-media-domains", nargs="+", default=[],
                   help="hosts whose http(s) image URLs are fetched even when they resolve to loopback, private "
                        "or link-local addresses (default: such addresses are refused before connecting)")
    p.add_argument("--media-fetch-timeout", type=float, default=10.0,
                   help="seconds to connect, and per read, when downloading an image URL")
    p.add_argument("--worker-timeout", type=float, default=300.0, help="seconds for one encode or generation")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--api-key", default=os.environ.get("EPD_API_KEY"),
                   help="clients must send `Authorization: Bearer <key>` on /v1/* (default: env EPD_API_KEY; "
                        "unset: open)")
    p.add_argument("--internal-key", default=os.environ.get("EPD_INTERNAL_KEY"),
                   help="Bearer key of the internal side: sent to workers (start them with the same --internal-key) "
                        "and required on /instances (default: env EPD_INTERNAL_KEY; unset: open, /instances off)")
    p.add_argument("--dynamic-registration", action="store_true",
                   help="attach mode where workers may also be added/removed at run time with POST/DELETE "
                        "/instances (the URL lists may then be empty); needs --internal-key")
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between /health probes of a worker")
    p.add_argument("--health-timeout", type=float, default=2.0, help="seconds one probe may take")
    p.add_argument("--health-failures", type=int, default=3,
                   help="failed probes in a row that take a worker out (a failed call takes it out at once)")
    p.add_argument("--aggregated", action="store_true",
                   help="no encoders: decoders load the vision tower too and encode images sent inline "
                        "(launcher: spawns --num-decoders aggregated decoders; the baseline EPD is compared with)")
    p.add_argument("--pipeline-encode", action="store_true",
                   help="send the decode request as soon as encodes are scheduled; the decoder's gather waits for "
                        "the embeddings (see docs/BENCHMARKS.md for the TTFT it saves)")
    p.add_argument("--log-level", default="info")
    add_curve_flags(p)
    return p


def _served_name(model: str) -> str:
    return model if model == "demo" else os.path.basename(os.path.normpath(model))


def _config(args: argparse.Namespace, encode_urls: tuple[str, ...], decode_urls: tuple[str, ...],
            curve: CurveConfig | None) -> ProxyConfig:
    return ProxyConfig(
        encode_urls=encode_urls, decode_urls=decode_urls,
        served_model_name=args.served_model_name or _served_name(args.model),
        host=args.host, port=args.port, max_images_per_request=args.max_images_per_request,
        max_image_bytes=args.max_image_bytes, max_body_bytes=args.max_body_bytes,
        max_image_pixels=args.max_image_pixels, allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=_urls(args.allowed_media_domains), media_fetch_timeout=args.media_fetch_timeout,
        worker_timeout=args.worker_timeout,
        startup_timeout=args.startup_timeout, log_level=args.log_level, pipeline_encode=args.pipeline_encode,
        aggregated=args.aggregated, api_key=args.api_key, internal_key=args.internal_key,
        dynamic_registration=args.dynamic_registration, health_interval=args.health_interval,
        health_timeout=args.health_timeout, health_failures=args.health_failures, curve=curve,
    )


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    curve = pop_curve(parser, args)
    setup_logging("proxy", args.log_level)
    encode_urls, decode_urls = _urls(args.encode_servers_urls), _urls(args.decode_servers_urls)
    if encode_urls or decode_urls or args.dynamic_registration:  # attach mode
        if args.dynamic_registration and not args.internal_key:
            parser.error("--dynamic-registration needs --internal-key (or env EPD_INTERNAL_KEY): it guards /instances")
        if not args.dynamic_registration and (not decode_urls or not (encode_urls or args.aggregated)):
            raise SystemExit("attach mode needs both --encode-servers-urls and --decode-servers-urls "
                             "(only the decoders with --aggregated)")
        cfg = _config(args, encode_urls, decode_urls, curve)
        serve(create_app(cfg), cfg.host, cfg.port, cfg.log_level)
        return
    if curve is not None:
        parser.error("CURVE keys are for attach mode (workers on other hosts); launcher mode keeps every "
                     "connector link on this host")
    # NOTE: uvicorn re-raises SIGTERM after its graceful shutdown; turn it into SystemExit so the
    # `finally` below stops the workers and the launcher exits 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    group = WorkerGroup(env={"EPD_INTERNAL_KEY": args.internal_key} if args.internal_key else {})
    try:
        cfg = _config(args, *_launch(group, args), curve)
        serve(create_app(cfg, on_ready=lambda: _print_banner(cfg)), cfg.host, cfg.port, cfg.log_level)
    finally:
        group.stop()


def _launch(group: WorkerGroup, args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    from models.resolve import resolve_model  # heavy (torch); attach mode never needs it

    model = str(resolve_model(args.model))
    num_encoders = 0 if args.aggregated else args.num_encoders
    threads = max(1, (os.cpu_count() or 1) // max(1, num_encoders + args.num_decoders))
    wh = args.worker_host
    common = ["--log-level", args.log_level]
    devices = _devices(num_encoders + args.num_decoders)
    enc = [group.spawn("encoder", model, wh, threads, ["--ec-bind", f"tcp://{wh}:0", *common, *devices[i]])
           for i in range(num_encoders)]
    dec_flags = [*common, "--aggregated"] if args.aggregated else common
    dec = [group.spawn("decoder", model, wh, threads, [*dec_flags, *devices[num_encoders + i]])
           for i in range(args.num_decoders)]
    group.wait_healthy(args.startup_timeout)
    return tuple(w.url for w in enc), tuple(w.url for w in dec)


def _devices(num_workers: int) -> list[list[str]]:
    """Spread spawned workers over the visible GPUs round-robin (`--device cuda:i`); no GPU: their default."""
    import torch

    gpus = torch.cuda.device_count()
    return [["--device", f"cuda:{i % gpus}"] if gpus else [] for i in range(num_workers)]


def _print_banner(cfg: ProxyConfig) -> None:
    url = f"http://{cfg.host}:{cfg.port}"
    print(f"\nEPD is up: {url}/v1  (model {cfg.served_model_name!r}; "
          f"{len(cfg.encode_urls)} encoder(s), {len(cfg.decode_urls)} decoder(s))\n"
          f"Try:  .venv/bin/python -m proxy.example --base-url {url}/v1\n", flush=True)


if __name__ == "__main__":
    main()
