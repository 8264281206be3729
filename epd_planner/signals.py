"""Collecting a `Sample`: the proxy's /instances (which workers, by role) and /metrics, then each healthy worker's
/metrics (and a decoder's /health, for its --max-num-seqs), in parallel, each under a timeout.

Nothing a server answers can crash the read or reach the model as a number: a refused connection, a 500, a
timeout, a body that is not Prometheus text, NaN, a negative or huge value, a metric the role must export that is
missing: that endpoint's Scrape carries the reason in `error` and no values (model.decide then keeps that role's
count). Worker /metrics is open on every service (epd_common/http.py `install_metrics`); the internal key is sent
anyway, and /instances needs it unless the proxy runs --insecure.
"""
from __future__ import annotations

import json
import math
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from epd_planner.sample import ROLES, BadValue, Histogram, Sample, Scrape, checked_value

MAX_BODY_BYTES = 8 << 20  # a /metrics body past this is not one of ours
DECODER_KIND = {"values": ("epd_decoder_kv_blocks_total", "epd_decoder_kv_blocks_free", "epd_decoder_waiting",
                           "epd_decoder_generated_tokens_total", "epd_decoder_prompt_tokens_total",
                           "epd_decoder_preemptions_total", "epd_decoder_requests_total"),
                "histograms": ("epd_decoder_request_queue_time_seconds", "epd_decoder_request_prefill_time_seconds",
                               "epd_decoder_request_decode_time_seconds"),
                "quantiles": ("epd_decoder_inter_token_latency_seconds", "epd_decoder_time_to_first_token_seconds"),
                "required": ("epd_decoder_kv_blocks_total", "epd_decoder_kv_blocks_free", "epd_decoder_waiting",
                             "epd_decoder_request_queue_time_seconds", "epd_decoder_request_prefill_time_seconds",
                             "epd_decoder_request_decode_time_seconds")}
# metric name -> what is kept of it, per endpoint kind: plain values, histograms (sum, count), histograms with buckets
KEPT: dict[str, dict[str, tuple[str, ...]]] = {
    "proxy": {"values": ("epd_proxy_requests_total", "epd_proxy_requests_in_flight",
                         "epd_proxy_encoder_items_outstanding", "epd_proxy_items_scheduled_total",
                         "epd_proxy_generation_tokens_total"),
              "histograms": ("epd_proxy_encode_seconds",),
              "quantiles": ("epd_proxy_time_to_first_token_seconds", "epd_proxy_inter_token_latency_seconds"),
              "required": ("epd_proxy_time_to_first_token_seconds", "epd_proxy_inter_token_latency_seconds")},
    "encoder": {"values": ("epd_encoder_run_seconds_total", "epd_encoder_items_encoded_total",
                           "epd_encoder_queue_depth"),
                "histograms": ("epd_encoder_queue_wait_seconds", "epd_encoder_encode_seconds"),
                "quantiles": (),
                "required": ("epd_encoder_run_seconds_total", "epd_encoder_items_encoded_total",
                             "epd_encoder_queue_wait_seconds")},
    "decoder": DECODER_KIND,
    "prefill": DECODER_KIND,  # a decoder started with --role prefill: the same metrics
}


def collect(proxy_url: str, internal_key: str | None = None, timeout: float = 2.0, all_addresses: bool = False,
            client: httpx.Client | None = None) -> Sample:
    """One read of the fleet behind `proxy_url`. `all_addresses`: read every address its host resolves to (a
    headless Service lists each proxy pod; their histograms add up). Never raises for what a server answers."""
    headers = {"Authorization": f"Bearer {internal_key}"} if internal_key else {}
    own = client is None
    http = client if client is not None else httpx.Client(timeout=timeout, follow_redirects=False)
    try:
        return _collect(_Reader(http, headers), proxy_url.rstrip("/"), all_addresses)
    finally:
        if own:
            http.close()


def _collect(http: _Reader, proxy_url: str, all_addresses: bool) -> Sample:
    sample = Sample(t=time.monotonic(), wall=time.time())
    try:
        listed = parse_instances(json.loads(http.get(f"{proxy_url}/instances")))
    except Exception as exc:  # noqa: BLE001 (anything it answers is a reason, never a crash)
        sample.error = f"cannot read {proxy_url}/instances: {_why(exc)}"
        listed = []
    proxies = proxy_addresses(proxy_url) if all_addresses else [proxy_url]
    if not proxies:
        sample.error = sample.error or f"{proxy_url}: its host resolves to no address"
    jobs = [(url, "proxy", True) for url in proxies] + listed
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(jobs)))) as pool:
        scrapes = list(pool.map(lambda job: read_endpoint(http, *job), jobs))
    sample.proxies = [s for s in scrapes if s.role == "proxy"]
    sample.workers = [s for s in scrapes if s.role != "proxy"]
    return sample


def parse_instances(body: Any) -> list[tuple[str, str, bool]]:
    """(url, role, healthy) of every worker in the proxy's /instances body ({"encoders": [{"url", "healthy", ...}],
    "decoders": [...], "prefills": [...]}); ValueError for any other shape."""
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    found = []
    for role in ROLES:
        workers = body.get(f"{role}s", [])
        if not isinstance(workers, list):
            raise ValueError(f"{role}s is not a list")
        for w in workers:
            if not (isinstance(w, dict) and isinstance(w.get("url"), str) and isinstance(w.get("healthy"), bool)):
                raise ValueError(f"a {role} entry without a url and healthy: {str(w)[:100]}")
            if urlsplit(w["url"]).scheme not in ("http", "https"):
                raise ValueError(f"a {role} url that is not http(s): {w['url'][:100]}")
            found.append((w["url"].rstrip("/"), role, w["healthy"]))
    return found


def proxy_addresses(proxy_url: str) -> list[str]:
    """The proxy URL once per address its host resolves to (sorted; [] when it resolves to none)."""
    parts = urlsplit(proxy_url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(parts.hostname or "", port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    hosts = sorted({str(info[4][0]) for info in infos})
    return [f"{parts.scheme}://{f'[{h}]' if ':' in h else h}:{port}" for h in hosts]


def read_endpoint(http: _Reader, url: str, role: str, healthy: bool) -> Scrape:
    """One endpoint's Scrape: its kept metrics, or the reason it could not be read (an unhealthy worker is not
    read: the proxy sends it no work)."""
    scrape = Scrape(url=url, role=role, t=time.monotonic(), healthy=healthy)
    if not healthy:
        return scrape
    try:
        text = http.get(f"{url}/metrics").decode("utf-8", errors="replace")
        scrape.values, scrape.histograms = parse_metrics(text, KEPT[role])
        if role in ("decoder", "prefill"):
            scrape.values["max_num_seqs"] = max_num_seqs(json.loads(http.get(f"{url}/health")))
    except Exception as exc:  # noqa: BLE001 (anything it answers is a reason, never a crash)
        scrape.values, scrape.histograms = {}, {}
        scrape.error = f"cannot read {url}: {_why(exc)}"
    return scrape


def max_num_seqs(health: Any) -> float:
    """A decoder's --max-num-seqs from its /health body."""
    value = health.get("max_num_seqs") if isinstance(health, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 20:
        raise BadValue(f"/health max_num_seqs = {str(value)[:40]}: not a whole number in [1, {1 << 20}]")
    return float(value)


def parse_metrics(text: str, kept: dict[str, tuple[str, ...]]) -> tuple[dict[str, float], dict[str, Histogram]]:
    """The kept values (summed over labels) and histograms of a Prometheus text body; ValueError (BadValue) when it
    does not parse, a kept number is not sane, or a required metric is missing."""
    values: dict[str, float] = {}
    sums: dict[str, dict[str, float]] = {}  # histogram name -> {"sum", "count", "le=<bound>"}
    wanted = set(kept["histograms"]) | set(kept["quantiles"])
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in kept["values"]:
                values[s.name] = values.get(s.name, 0.0) + checked_value(s.name, s.value)
                continue
            base, _, part = s.name.rpartition("_")
            if base in wanted and part in ("sum", "count", "bucket"):
                key = f"le={float(s.labels.get('le', 'nan'))}" if part == "bucket" else part
                h = sums.setdefault(base, {})
                h[key] = h.get(key, 0.0) + checked_value(s.name, s.value)
    histograms = {name: _histogram(name, h, name in kept["quantiles"]) for name, h in sums.items()}
    missing = [n for n in kept["required"] if n not in values and n not in histograms]
    if missing:
        raise BadValue(f"missing {', '.join(missing)}")
    return values, histograms


def _histogram(name: str, parts: dict[str, float], keep_buckets: bool) -> Histogram:
    buckets = sorted((float(k[3:]), v) for k, v in parts.items() if k.startswith("le="))
    if any(math.isnan(le) for le, _ in buckets):
        raise BadValue(f"{name}: a bucket without its le")
    h = Histogram(parts.get("sum", math.nan), parts.get("count", math.nan), buckets if keep_buckets else [])
    h.check(name)
    if buckets:  # checked even where they are not kept
        Histogram(h.sum, h.count, buckets).check(name)
    return h


class _Reader:
    """GETs with the internal key, under the client's timeout."""

    def __init__(self, http: httpx.Client, headers: dict[str, str]) -> None:
        self.http, self.headers = http, headers

    def get(self, url: str) -> bytes:
        """The body of a 200; ValueError for another status or a body past MAX_BODY_BYTES."""
        with self.http.stream("GET", url, headers=self.headers) as response:
            if response.status_code != 200:
                raise ValueError(f"HTTP {response.status_code}")
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise ValueError(f"its answer is over {MAX_BODY_BYTES} bytes")
        return bytes(body)


def _why(exc: BaseException) -> str:
    """A one-line reason: the kind of failure and its text, cut short."""
    kind = "timeout" if isinstance(exc, httpx.TimeoutException) else type(exc).__name__
    text = " ".join(str(exc).split())[:200]
    return f"{kind}: {text}" if text and kind not in text else text or kind
