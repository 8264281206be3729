"""disagg-epd-proxy: launcher mode (spawn workers here) or attach mode (workers started elsewhere)."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable

from connector.control.curve_flags import pop_curve
from connector.control.security import CurveConfig
from epd_common.logs import setup_logging
from epd_common.server import HttpLimits, serve
from epd_common.startup import fail, run_main
from epd_common.tracing import require_sdk
from epd_launcher.disk_dir import refuse_unsafe_disk_dir
from epd_launcher.flags import parse_args
from epd_launcher.group import STOP_MARGIN_S, RestartPolicy, Secrets, WorkerGroup
from epd_launcher.preflight import check_launch, check_port_free
from epd_launcher.proxy_procs import serve_proxies
from proxy.app import create_app
from proxy.config import ProxyConfig
from proxy.workers import check_worker_url, served_name

logger = logging.getLogger("epd.proxy")
PROG = "disagg-epd-proxy"


def main(argv: list[str] | None = None) -> None:
    run_main(PROG, _main, argv)


def _main(argv: list[str]) -> None:
    parser, args = parse_args(argv)
    curve = pop_curve(parser, args)
    try:
        encode_urls, decode_urls = _worker_urls(args.encode_servers_urls), _worker_urls(args.decode_servers_urls)
        args.prefill_urls = _prefill_urls(args.prefill_servers_urls)
        policy = RestartPolicy(args.max_restarts, args.restart_window, args.restart_backoff, args.restart_backoff_max)
    except (ValueError, AssertionError) as exc:
        parser.error(str(exc) or "invalid --max-restarts / --restart-* values")
    if args.otlp_traces_endpoint:  # the proxy and every worker it spawns would need it
        require_sdk()
    setup_logging("proxy", args.log_level)
    if args.attach:
        attach(parser, args, encode_urls, decode_urls, curve, policy)
    else:
        launch(args, policy, curve)


def attach(parser: argparse.ArgumentParser, args: argparse.Namespace, encode_urls: tuple[str, ...],
           decode_urls: tuple[str, ...], curve: CurveConfig | None, policy: RestartPolicy) -> None:
    """Serve the proxy in front of workers started elsewhere. Loads neither torch nor transformers."""
    if args.dynamic_registration and not args.internal_key:
        parser.error("--dynamic-registration needs --internal-key (or env EPD_INTERNAL_KEY): it guards /instances")
    if not args.dynamic_registration and (not decode_urls or not (encode_urls or args.aggregated)):
        raise SystemExit("attach mode needs both --encode-servers-urls and --decode-servers-urls "
                         "(only the decoders with --aggregated)")
    insecure = _require_credentials(parser, args, curve)
    cfg = _config(args, encode_urls, decode_urls, curve, args.served_model_name, insecure)  # None: workers' model
    check_port_free(cfg.host, cfg.port)
    _serve(cfg, args.proxy_workers, policy)


def launch(args: argparse.Namespace, policy: RestartPolicy, curve: CurveConfig | None) -> None:
    """Check what can be checked (preflight), spawn the workers with fresh keys, serve the proxy in front of them
    (with --autoscale, an Autoscaler sizes them from the proxy's start on), stop them all on exit."""
    from epd_launcher.spawn import start_workers  # NOTE: torch; attach mode never needs it

    if curve is not None:
        logger.warning("launcher mode generates its own CURVE keys per start: the EPD_EC_CURVE_* keys are not used")
    refuse_unsafe_disk_dir(args)  # before any worker starts
    model_dir = check_launch(args)
    keys = Secrets.generate(args.internal_key)
    args.internal_key = keys.internal_key
    # NOTE: uvicorn re-raises SIGTERM after its graceful shutdown; turn it into SystemExit so the
    # `finally` below stops the workers and the launcher exits 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    group = WorkerGroup(env={"EPD_INSECURE": ""}, policy=policy)  # workers get keys: they need no waiver
    autoscaler = None
    try:
        try:
            spawner, workers = start_workers(group, args, keys, model_dir)
        except RuntimeError as exc:  # a worker exited or never answered while loading: its own log says why
            fail(PROG, f"{exc} (its log above says why)", code=1)
        args.prefill_urls = tuple(w.url for w in workers["prefill"])
        cfg = _config(args, tuple(w.url for w in workers["encoder"]), tuple(w.url for w in workers["decoder"]),
                      keys.proxy_curve(), args.served_model_name or served_name(args.model))
        group.supervise()
        if args.autoscale:
            from epd_launcher.autoscale import Autoscaler
            from epd_launcher.autoscale_flags import autoscale_config

            url = _local_url(cfg.host, cfg.port)
            autoscaler = Autoscaler(spawner, url, keys.internal_key, autoscale_config(args, url, keys.internal_key),
                                    workers, args.startup_timeout, args.shutdown_timeout)

        def ready() -> None:
            _print_banner(cfg)
            if autoscaler is not None:
                autoscaler.start()

        _serve(cfg, args.proxy_workers, policy, on_ready=ready)
    except KeyboardInterrupt:  # Ctrl-C before the server took over the signals
        raise SystemExit(130) from None
    finally:
        if autoscaler is not None:
            autoscaler.stop()
        group.stop(args.shutdown_timeout + STOP_MARGIN_S)  # the workers drain under the same --shutdown-timeout


def _local_url(host: str, port: int) -> str:
    """The proxy's URL from this machine (a wildcard bind is reached on loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _serve(cfg: ProxyConfig, num_procs: int, policy: RestartPolicy,
           on_ready: Callable[[], None] | None = None) -> None:
    """One proxy process (uvicorn binds the port), or several sharing it (epd_launcher/proxy_procs.py)."""
    if num_procs == 1:
        serve(create_app(cfg, on_ready=on_ready), cfg.host, cfg.port, cfg.log_level, HttpLimits.of(cfg))
    else:
        serve_proxies(cfg, num_procs, policy, on_ready)


def _urls(values: list[str] | None) -> tuple[str, ...]:
    """Accept both `--x a b` and `--x a,b`."""
    return tuple(u.strip().rstrip("/") for v in values or [] for u in v.split(",") if u.strip())


def _prefill_urls(values: list[str] | None) -> tuple[str, ...]:
    """--prefill-servers-urls: the prefill workers' URLs; none for vLLM's disable / none / "" (E + PD)."""
    urls = [v for v in values or [] if v != "disable"]
    if urls and len(urls) != len(values or []):
        raise ValueError("--prefill-servers-urls: give prefill worker URLs, or disable / none / \"\", not both")
    return _worker_urls(urls)


def _worker_urls(values: list[str] | None) -> tuple[str, ...]:
    """As _urls; ValueError for a URL that is not http(s)://HOST[:PORT] (no scheme, bad port, a path)."""
    return tuple(check_worker_url(u) for u in _urls(values))


def _config(args: argparse.Namespace, encode_urls: tuple[str, ...], decode_urls: tuple[str, ...],
            curve: CurveConfig | None, served_model_name: str | None, insecure: bool = False) -> ProxyConfig:
    return ProxyConfig(
        encode_urls=encode_urls, decode_urls=decode_urls, prefill_urls=getattr(args, "prefill_urls", ()),
        served_model_name=served_model_name,
        host=args.host, port=args.port, max_images_per_request=args.max_images_per_request,
        max_image_bytes=args.max_image_bytes, **{n: getattr(args, n) for n in HttpLimits.__dataclass_fields__},
        max_image_pixels=args.max_image_pixels, max_videos_per_request=args.max_videos_per_request,
        max_video_bytes=args.max_video_bytes, max_video_duration=args.max_video_duration,
        max_video_frames=args.max_video_frames, max_video_frame_pixels=args.max_video_frame_pixels,
        video_chunk_frames=args.video_chunk_frames, max_video_fanout_bytes=args.max_video_fanout_bytes,
        max_video_decode_frames=args.max_video_decode_frames, max_audios_per_request=args.max_audios_per_request,
        max_audio_bytes=args.max_audio_bytes, max_audio_seconds=args.max_audio_seconds,
        audio_chunk_seconds=args.audio_chunk_seconds, max_audio_fanout_bytes=args.max_audio_fanout_bytes,
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=_urls(args.allowed_media_domains), media_fetch_timeout=args.media_fetch_timeout,
        media_fetch_deadline=args.media_fetch_deadline, max_concurrent_fetches=args.max_concurrent_fetches,
        worker_timeout=args.worker_timeout, encoder_busy_timeout=args.encoder_busy_timeout,
        startup_timeout=args.startup_timeout, log_level=args.log_level, pipeline_encode=args.pipeline_encode,
        aggregated=args.aggregated, api_key=args.api_key, internal_key=args.internal_key,
        dynamic_registration=args.dynamic_registration, health_interval=args.health_interval,
        health_timeout=args.health_timeout, health_failures=args.health_failures,
        prefix_affinity=args.prefix_affinity, affinity_load_gap=args.affinity_load_gap, curve=curve,
        insecure=insecure, otlp_traces_endpoint=args.otlp_traces_endpoint,
        otlp_traces_sample_ratio=args.otlp_traces_sample_ratio,
    )


def _require_credentials(parser: argparse.ArgumentParser, args: argparse.Namespace, curve: CurveConfig | None) -> bool:
    """Attach mode: internal HTTP and ZeroMQ are authenticated unless --insecure says otherwise (logged); True when
    the proxy runs open (--insecure, a key missing)."""
    missing = [] if args.internal_key else ["--internal-key (env EPD_INTERNAL_KEY or EPD_INTERNAL_KEY_FILE): anyone "
                                            "who reaches a worker can call its /encode and /generate"]
    if curve is None and not args.aggregated:
        missing.append("CURVE keys (--ec-curve-key and --ec-curve-server-key, or env EPD_EC_CURVE_SECRET_KEY and "
                       "EPD_EC_CURVE_SERVER_KEY or their _FILE forms; make them with `epd-ec-keygen env DIR`): "
                       "anyone who reaches an encoder's ZeroMQ port can list and read every embedding")
    if not missing:
        return False
    if not args.insecure:
        parser.error("attach mode is authenticated by default; missing " + "; ".join(missing) +
                     ". Pass --insecure (or env EPD_INSECURE=1) to run open on a trusted network")
    logger.warning("INSECURE (--insecure): running without " + "; and without ".join(missing) +
                   "; GET /instances lists the workers without the internal key")
    return True


def _print_banner(cfg: ProxyConfig) -> None:
    url = f"http://{cfg.host}:{cfg.port}"
    print(f"\nEPD is up: {url}/v1  (model {cfg.served_model_name!r}; "
          f"{len(cfg.encode_urls)} encoder(s), {len(cfg.decode_urls)} decoder(s)"
          f"{f', {len(cfg.prefill_urls)} prefill worker(s)' if cfg.prefill_urls else ''})\n"
          f"Try:  .venv/bin/python -m proxy.example --base-url {url}/v1\n", flush=True)


if __name__ == "__main__":
    main()
