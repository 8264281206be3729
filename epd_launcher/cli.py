"""disagg-epd-proxy: launcher mode (spawn workers here) or attach mode (workers started elsewhere)."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys

from connector.security import CurveConfig
from epd_common.cli import add_curve_flags, add_http_flags, pop_curve
from epd_common.http import HttpLimits, serve
from epd_common.logs import setup_logging
from epd_launcher.group import RestartPolicy, Secrets, WorkerGroup
from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.workers import check_worker_url

logger = logging.getLogger("epd.proxy")
_TRUE = ("1", "true", "yes", "on")


def _urls(values: list[str] | None) -> tuple[str, ...]:
    """Accept both `--x a b` and `--x a,b`."""
    return tuple(u.strip().rstrip("/") for v in values or [] for u in v.split(",") if u.strip())


def _worker_urls(values: list[str] | None) -> tuple[str, ...]:
    """As _urls; ValueError for a URL that is not http(s)://HOST[:PORT] (no scheme, bad port, a path)."""
    return tuple(check_worker_url(u) for u in _urls(values))


def _check_port_free(host: str, port: int) -> None:
    """Fail now, before any worker is spawned or waited for, if the proxy could not listen."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as exc:
            raise SystemExit(f"disagg-epd-proxy: error: cannot listen on {host}:{port}: {exc.strerror or exc} "
                             "(another process uses the port? pick one with --port)") from None


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
    p.add_argument("--max-image-pixels", type=int, default=40_000_000, help="larger images get a 400")
    p.add_argument("--allowed-local-media-path", default=None,
                   help="serve file:// image URLs from under this directory (default: file URLs are refused)")
    p.add_argument("--allowed-media-domains", nargs="+", default=[],
                   help="hosts whose http(s) image URLs are fetched even when they resolve to loopback, private "
                        "or link-local addresses (default: such addresses are refused before connecting)")
    p.add_argument("--media-fetch-timeout", type=float, default=10.0,
                   help="seconds to connect, and per read, when downloading an image URL")
    p.add_argument("--media-fetch-deadline", type=float, default=30.0,
                   help="seconds to load all of one request's images, waiting for a fetch slot included; past it "
                        "the download is aborted and the request gets a 408 naming the image")
    p.add_argument("--max-concurrent-fetches", type=int, default=16,
                   help="http(s) image downloads at once over all requests; a request that gets no slot within "
                        "its --media-fetch-deadline gets a 503")
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
    p.add_argument("--insecure", action="store_true",
                   default=os.environ.get("EPD_INSECURE", "").strip().lower() in _TRUE,
                   help="attach mode: run without --internal-key and CURVE keys (logs a WARNING naming what is "
                        "open; default: env EPD_INSECURE=1). Launcher mode always generates both per start")
    g = p.add_argument_group("supervision (launcher mode)")
    g.add_argument("--max-restarts", type=int, default=5,
                   help="restarts of one worker within --restart-window; past that it is left down")
    g.add_argument("--restart-window", type=float, default=600.0, help="seconds over which restarts are counted")
    g.add_argument("--restart-backoff", type=float, default=1.0,
                   help="seconds before the first restart of a worker that exited; doubles per restart in the window")
    g.add_argument("--restart-backoff-max", type=float, default=30.0, help="longest wait before a restart (seconds)")
    p.add_argument("--log-level", default="info")
    add_curve_flags(p)
    add_http_flags(p, ProxyConfig)
    return p


def _served_name(model: str) -> str:
    return model if model == "demo" else os.path.basename(os.path.normpath(model))


def _config(args: argparse.Namespace, encode_urls: tuple[str, ...], decode_urls: tuple[str, ...],
            curve: CurveConfig | None) -> ProxyConfig:
    return ProxyConfig(
        encode_urls=encode_urls, decode_urls=decode_urls,
        served_model_name=args.served_model_name or _served_name(args.model),
        host=args.host, port=args.port, max_images_per_request=args.max_images_per_request,
        max_image_bytes=args.max_image_bytes, **{n: getattr(args, n) for n in HttpLimits.__dataclass_fields__},
        max_image_pixels=args.max_image_pixels, allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=_urls(args.allowed_media_domains), media_fetch_timeout=args.media_fetch_timeout,
        media_fetch_deadline=args.media_fetch_deadline, max_concurrent_fetches=args.max_concurrent_fetches,
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
    try:
        encode_urls, decode_urls = _worker_urls(args.encode_servers_urls), _worker_urls(args.decode_servers_urls)
        policy = RestartPolicy(args.max_restarts, args.restart_window, args.restart_backoff, args.restart_backoff_max)
    except (ValueError, AssertionError) as exc:
        parser.error(str(exc) or "invalid --max-restarts / --restart-* values")
    setup_logging("proxy", args.log_level)
    if encode_urls or decode_urls or args.dynamic_registration:  # attach mode
        if args.dynamic_registration and not args.internal_key:
            parser.error("--dynamic-registration needs --internal-key (or env EPD_INTERNAL_KEY): it guards /instances")
        if not args.dynamic_registration and (not decode_urls or not (encode_urls or args.aggregated)):
            raise SystemExit("attach mode needs both --encode-servers-urls and --decode-servers-urls "
                             "(only the decoders with --aggregated)")
        _require_credentials(parser, args, curve)
        cfg = _config(args, encode_urls, decode_urls, curve)
        _check_port_free(cfg.host, cfg.port)
        serve(create_app(cfg), cfg.host, cfg.port, cfg.log_level, HttpLimits.of(cfg))
        return
    if curve is not None:
        logger.warning("launcher mode generates its own CURVE keys per start: the --ec-curve-* keys are not used")
    _check_port_free(args.host, args.port)
    keys = Secrets.generate(args.internal_key)
    args.internal_key = keys.internal_key
    # NOTE: uvicorn re-raises SIGTERM after its graceful shutdown; turn it into SystemExit so the
    # `finally` below stops the workers and the launcher exits 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    group = WorkerGroup(env={"EPD_INSECURE": ""}, policy=policy)  # workers get keys: they need no waiver
    try:
        cfg = _config(args, *_launch(group, args, keys), keys.proxy_curve())
        group.supervise()
        serve(create_app(cfg, on_ready=lambda: _print_banner(cfg)), cfg.host, cfg.port, cfg.log_level,
              HttpLimits.of(cfg))
    except KeyboardInterrupt:  # Ctrl-C before the server took over the signals
        raise SystemExit(130) from None
    finally:
        group.stop()


def _require_credentials(parser: argparse.ArgumentParser, args: argparse.Namespace, curve: CurveConfig | None) -> None:
    """Attach mode: internal HTTP and ZeroMQ are authenticated unless --insecure says otherwise (logged)."""
    missing = [] if args.internal_key else ["--internal-key (env EPD_INTERNAL_KEY): anyone who reaches a worker "
                                            "can call its /encode and /generate"]
    if curve is None and not args.aggregated:
        missing.append("CURVE keys (--ec-curve-key and --ec-curve-server-key, or env EPD_EC_CURVE_SECRET_KEY and "
                       "EPD_EC_CURVE_SERVER_KEY; make them with `python -m connector.security generate DIR`): "
                       "anyone who reaches an encoder's ZeroMQ port can list and read every embedding")
    if not missing:
        return
    if not args.insecure:
        parser.error("attach mode is authenticated by default; missing " + "; ".join(missing) +
                     ". Pass --insecure (or env EPD_INSECURE=1) to run open on a trusted network")
    logger.warning("INSECURE (--insecure): running without " + "; and without ".join(missing))


def _launch(group: WorkerGroup, args: argparse.Namespace,
            keys: Secrets) -> tuple[tuple[str, ...], tuple[str, ...]]:
    from epd_models.resolve import resolve_model  # heavy (torch); attach mode never needs it

    model = str(resolve_model(args.model))
    num_encoders = 0 if args.aggregated else args.num_encoders
    threads = max(1, (os.cpu_count() or 1) // max(1, num_encoders + args.num_decoders))
    wh = args.worker_host
    common = ["--log-level", args.log_level]
    devices = _devices(num_encoders + args.num_decoders)
    enc = [group.spawn("encoder", model, wh, threads, ["--ec-bind", f"tcp://{wh}:0", *common, *devices[i]],
                       keys.env("encoder")) for i in range(num_encoders)]
    dec_flags = [*common, "--aggregated"] if args.aggregated else common
    dec = [group.spawn("decoder", model, wh, threads, [*dec_flags, *devices[num_encoders + i]], keys.env("decoder"))
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
