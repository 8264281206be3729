"""http(s) media downloads (images, videos, audio), each hop to an address the SSRF guard checked.

The host is resolved once and every address it resolves to must be public (``proxy/ssrf.py``: not loopback,
private, link-local -- which includes the 169.254.169.254 cloud metadata address --, unspecified, multicast,
reserved or otherwise non-global); the connection goes to the address that was checked, so a second DNS answer
cannot rebind it to an internal one. Hosts named in ``ProxyConfig.allowed_media_domains`` skip the address check
(but are still pinned). Redirects are followed by hand, at most ``MAX_REDIRECTS``, and each target is checked
by the same rules before it is contacted. The body is capped at its kind's byte limit (``MediaBytes.max_bytes``:
--max-image-bytes, --max-video-bytes, --max-audio-bytes) while it is read.

Time is bounded twice: each download by ``TOTAL_TIMEOUT_FACTOR`` x ``media_fetch_timeout`` (400), and all of a
request's media by the request's deadline (``media_fetch_deadline``, 408), both enforced inside the reading
thread (per-read timeouts shortened to what is left, the clock checked after every chunk), so a download stops
when its time is up instead of reading on in the background. ``proxy/fetch_slots.py`` caps the downloads
running at once over all requests, on threads of their own, so slow hosts cannot take the threads others need.
NOTE: what no clock in the thread reaches: name resolution (getaddrinfo) has no timeout of its own, and a
read already waiting when the deadline passes ends by its own timeout (at most min(media_fetch_timeout, the
time left when the hop began) after the last byte). The thread holds its fetch slot until then; the request
itself gets its 408 from the event loop one second after its deadline (``proxy/fetch_slots.py``).
"""
from __future__ import annotations

import functools
import os
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from epd_common.tracing import span
from proxy.config import ProxyConfig
from proxy.media_rules import MediaBytes, MediaError
from proxy.ssrf import IPAddress, check_fetch_target, host_of, is_ip_literal, valid_host

MAX_REDIRECTS = 5
# The whole download (all hops, connect to last byte) must finish within this many media_fetch_timeouts;
# the per-read timeout alone would let a server that trickles a byte at a time hold a worker thread for hours.
TOTAL_TIMEOUT_FACTOR = 3
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
# Generic binary types some servers use for media; accepted because the bytes are then identified by content
# (open_image accepts only a recognised image format, probe_video only an allowed container and codec), so nothing
# but an image (a video) gets through either way.
_GENERIC_CONTENT_TYPES = frozenset({"", "application/octet-stream", "binary/octet-stream"})


@dataclass(frozen=True)
class Deadline:
    """When a download must be over (time.monotonic()), and whose limit that is."""

    at: float
    of_request: bool  # the request's media deadline (a 408), not the download's own time limit (a 400)
    kind: MediaBytes

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def error(self, url: httpx.URL) -> MediaError:
        k = self.kind.name
        if self.of_request:
            return self.kind.error("timeout", f"the request's media were not loaded within the media fetch deadline "
                                              f"(still fetching {k} from {host_of(url)!r})", status=408)
        return self.kind.error("failed", f"timed out fetching {k} from {host_of(url)!r}")


def download_deadline(cfg: ProxyConfig, request_deadline: float | None, kind: MediaBytes) -> Deadline:
    """The earlier of the download's own limit and the request's deadline (if any)."""
    own = time.monotonic() + TOTAL_TIMEOUT_FACTOR * cfg.media_fetch_timeout
    if request_deadline is not None and request_deadline <= own:
        return Deadline(request_deadline, of_request=True, kind=kind)
    return Deadline(own, of_request=False, kind=kind)


def fetch_http(url: str, kind: MediaBytes, cfg: ProxyConfig, request_deadline: float | None = None) -> bytes:
    """GET an image or a video, following redirects by hand so each hop is checked before any connection is made."""
    deadline = download_deadline(cfg, request_deadline, kind)
    target = parse_http_url(url, kind)
    # traced without the URL's path and query (they may carry tokens): its scheme and host only, and no traceback
    # (a chained httpx error may quote the URL); a failure is its error code
    with span("media.fetch", {"epd.kind": kind.name, "url.scheme": target.scheme, "server.address": target.host},
              "client", record_exception=False) as traced:
        try:
            data = _follow(target, kind, cfg, deadline)
        except MediaError as exc:
            if traced is not None:
                traced.set_attribute("error.type", exc.code)
            raise
        if traced is not None:
            traced.set_attribute("epd.bytes", len(data))
        return data


def _follow(target: httpx.URL, kind: MediaBytes, cfg: ProxyConfig, deadline: Deadline) -> bytes:
    """The file at `target`, through at most MAX_REDIRECTS redirects, each hop checked before it is contacted."""
    for _ in range(MAX_REDIRECTS + 1):
        addresses = check_fetch_target(target, cfg, kind)
        outcome = fetch_once(target, addresses, cfg, deadline)
        if isinstance(outcome, bytes):
            return outcome
        target = outcome
    raise kind.error("failed", f"more than {MAX_REDIRECTS} redirects fetching {kind.name} from {host_of(target)!r}")


def parse_http_url(url: str, kind: MediaBytes) -> httpx.URL:
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise kind.error("invalid_url", f"{kind.name} URL is not a valid URL") from exc
    if parsed.scheme not in ("http", "https") or not valid_host(parsed.raw_host.decode("ascii")):
        raise kind.error("invalid_url", f"{kind.name} URL must be http(s)://host/... with a valid host name")
    return parsed


def pinned_request(url: httpx.URL, address: IPAddress, timeout: float, accept: str) -> httpx.Request:
    """A GET for `url` that connects to `address` (the one that was checked) instead of resolving again.

    The URL's host is replaced by the address; the Host header keeps the original name (and port), and for
    https the `sni_hostname` extension makes httpcore send the original name as SNI and verify the
    certificate against it. `timeout` applies to the connect and to each read and write; `accept` is the
    Accept header (the kind's media types).
    """
    headers = {"Host": url.netloc.decode("ascii"), "Accept": accept, "Accept-Encoding": "identity",
               "User-Agent": "epd-proxy"}
    extensions: dict[str, Any] = {"timeout": httpx.Timeout(timeout).as_dict()}
    if url.scheme == "https" and not is_ip_literal(url.raw_host.decode("ascii")):
        extensions["sni_hostname"] = url.raw_host.decode("ascii")
    return httpx.Request("GET", url.copy_with(host=str(address)), headers=headers, extensions=extensions)


def fetch_once(url: httpx.URL, addresses: list[IPAddress], cfg: ProxyConfig, deadline: Deadline) -> bytes | httpx.URL:
    """One hop: the file's bytes, or the (not yet checked) URL a redirect points to.

    Tries the checked addresses in turn while they refuse the connection (a name with an AAAA record on an
    IPv4-only network); never any address that was not checked.
    """
    try:
        for address in addresses[:-1]:
            try:
                return fetch_from(url, address, cfg, deadline)
            except httpx.ConnectError:
                continue
        return fetch_from(url, addresses[-1], cfg, deadline)
    except httpx.TimeoutException as exc:
        if deadline.remaining() <= 0.05:  # the read timeout was cut to the deadline: that is what ran out
            raise deadline.error(url) from exc
        raise deadline.kind.error("failed", f"timed out fetching {deadline.kind.name} from {host_of(url)!r}") from exc
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise deadline.kind.error("failed", f"could not fetch {deadline.kind.name} from {host_of(url)!r}") from exc


def fetch_from(url: httpx.URL, address: IPAddress, cfg: ProxyConfig, deadline: Deadline) -> bytes | httpx.URL:
    """GET `url` from `address` through a bare transport of its own.

    A bare transport, not an httpx.Client: no redirect handling of its own (the client would parse the
    Location, against the pinned URL, before we see it), no proxy from the environment (a proxy would resolve
    the name again itself), no cookies; and a fresh one per hop, so no pooled connection is ever reused for
    another host name.
    """
    remaining = deadline.remaining()
    if remaining <= 0:
        raise deadline.error(url)
    request = pinned_request(url, address, min(cfg.media_fetch_timeout, remaining), deadline.kind.accept)
    with httpx.HTTPTransport(verify=tls_context(), retries=0) as transport:
        response = transport.handle_request(request)
        try:
            return _read_response(url, response, deadline)
        finally:
            response.close()


def tls_context() -> ssl.SSLContext:
    """The context that verifies https media hosts: httpx's default CA bundle (certifi), or SSL_CERT_FILE /
    SSL_CERT_DIR when set. Built once per CA setting, not per fetch: loading the bundle takes ~50 ms of CPU."""
    return _tls_context_for(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@functools.lru_cache(maxsize=4)
def _tls_context_for(cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    """Keyed by the CA settings create_ssl_context reads from the environment."""
    return httpx.create_ssl_context()


def _read_response(url: httpx.URL, response: httpx.Response, deadline: Deadline) -> bytes | httpx.URL:
    kind = deadline.kind
    if response.status_code in _REDIRECTS:
        return redirect_target(url, response, kind)
    if response.status_code != 200:
        raise kind.error("failed", f"{kind.name} host {host_of(url)!r} answered HTTP {response.status_code}")
    check_content_type(url, response, kind)
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > kind.max_bytes:
        raise kind.error("too_large", f"{kind.name} is larger than {kind.max_bytes} bytes")
    return read_capped(url, response, deadline)


def redirect_target(url: httpx.URL, response: httpx.Response, kind: MediaBytes) -> httpx.URL:
    """Where a redirect points, resolved against the original (not the pinned) URL; only http(s) targets."""
    host = f"{kind.name} host {host_of(url)!r}"
    location = response.headers.get("location")
    if not location:
        raise kind.error("failed", f"{host} sent a redirect without a Location")
    scheme = urlsplit(location).scheme.lower()
    if scheme not in ("", "http", "https"):
        raise kind.error("forbidden", f"{host} redirected to a non-http(s) URL")
    try:
        target = url.join(location)
    except httpx.InvalidURL as exc:
        raise kind.error("failed", f"{host} redirected to an invalid URL") from exc
    if target.scheme not in ("http", "https"):
        raise kind.error("forbidden", f"{host} redirected to a non-http(s) URL")
    if not valid_host(target.raw_host.decode("ascii")):
        raise kind.error("failed", f"{host} redirected to an invalid URL")
    return target


def check_content_type(url: httpx.URL, response: httpx.Response, kind: MediaBytes) -> None:
    """The kind's types (image/*, video/*) are accepted; so are application/octet-stream and a missing type,
    because the bytes are then identified by content anyway. Anything else (text/html, JSON error pages, ...) is
    refused before the body is read."""
    content_type = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if not (content_type.startswith(f"{kind.name}/") or content_type in _GENERIC_CONTENT_TYPES):
        raise kind.error("invalid", f"{kind.name} URL on {host_of(url)!r} returned {content_type!r}, not {kind.accept}")
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):  # we asked for identity; decoding could expand far past the cap
        raise kind.error("failed", f"{kind.name} host {host_of(url)!r} sent a {encoding!r}-encoded body")


def read_capped(url: httpx.URL, response: httpx.Response, deadline: Deadline) -> bytes:
    """The body as it arrives, abandoned as soon as it passes the kind's byte cap or the overall deadline."""
    kind = deadline.kind
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_raw():
        size += len(chunk)
        if size > kind.max_bytes:
            raise kind.error("too_large", f"{kind.name} is larger than {kind.max_bytes} bytes")
        if deadline.remaining() <= 0:
            raise deadline.error(url)
        chunks.append(chunk)
    return b"".join(chunks)


