"""Media loading in the proxy: data:, http(s):// (SSRF-guarded, capped, redirects re-checked) and file:// URLs.

The http tests run a real HTTP server on loopback in a thread. "No connection was made" is checked by
counting the connections the server accepted: after the request under test, one more (sentinel) request is
made, and since the listening socket hands out connections in order, any connection made by the request
under test would have been accepted first.
"""
from __future__ import annotations

import base64
import io
import os
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image, ImageFile

from common.errors import APIError
from models.images import ImageError, ImageTooLargeError, load_image, open_image
from proxy import media
from proxy.config import ProxyConfig
from proxy.hashing import mm_hash
from proxy.prepare import prepare_chat
from proxy.protocol import ChatCompletionRequest
from tests.factories import make_image

PARAM = "messages.0.content.0.image_url.url"
Route = Callable[[BaseHTTPRequestHandler], None]


def config(**overrides: Any) -> ProxyConfig:
    values: dict[str, Any] = {"encode_urls": ("http://e",), "decode_urls": ("http://d",), "served_model_name": "demo",
                              "media_fetch_timeout": 0.5, **overrides}
    return ProxyConfig(**values)


def request(*urls: str) -> ChatCompletionRequest:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    msg = {"role": "user", "content": [*parts, {"type": "text", "text": "Describe the image."}]}
    return ChatCompletionRequest.model_validate({"model": "demo", "messages": [msg]})


def refused(cfg: ProxyConfig, *urls: str) -> APIError:
    with pytest.raises(APIError) as err:
        prepare_chat(request(*urls), cfg)
    assert err.value.status == 400
    return err.value


def fetched(cfg: ProxyConfig, url: str) -> bytes:
    chat = prepare_chat(request(url), cfg)
    assert len(chat.items) == 1
    return chat.items[0].data


def encode(img: Image.Image, fmt: str = "PNG", **params: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **params)
    return buf.getvalue()


def as_data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


PNG = encode(make_image(32, 24))


# --- a real loopback HTTP server ----------------------------------------------------------------------------

class CountingServer(HTTPServer):
    """Records every accepted connection and every request (path, Host header)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.accepted = 0
        self.seen: list[tuple[str, str]] = []
        self.routes: dict[str, Route] = {}

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def get_request(self) -> tuple[socket.socket, Any]:
        conn = super().get_request()
        self.accepted += 1
        return conn

    def paths(self) -> list[str]:
        return [path for path, _ in self.seen]


class Handler(BaseHTTPRequestHandler):
    server: CountingServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.server.seen.append((self.path, self.headers.get("Host", "")))
        route = self.server.routes.get(self.path)
        try:
            if route is None:
                self.send_error(404)
            else:
                route(self)
        except (BrokenPipeError, ConnectionResetError):  # the client hung up on purpose (cap, deadline)
            pass

    def log_message(self, format: str, *args: Any) -> None:
        pass


def serve(body: bytes, content_type: str = "image/png", with_length: bool = True) -> Route:
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        if with_length:
            h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
    return route


def redirect(location: str, status: int = 302) -> Route:
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()
    return route


def endless(pause: float = 0.0, chunk: bytes = b"\0" * 65536) -> Route:
    """200 image/png with no Content-Length and a body that never ends (until the client hangs up)."""
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "image/png")
        h.end_headers()
        h.wfile.write(PNG[:16])
        while True:
            h.wfile.write(chunk)
            h.wfile.flush()
            if pause:
                time.sleep(pause)  # a slow server, not a wait in the test
    return route


@contextmanager
def running(srv: CountingServer) -> Iterator[CountingServer]:
    srv.routes["/__sync__"] = serve(b"", "text/plain")
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join()


@pytest.fixture
def server() -> Iterator[CountingServer]:
    with running(CountingServer()) as srv:
        yield srv


def connections_made(srv: CountingServer) -> int:
    """Connections the server accepted before now (a sentinel request flushes the accept queue)."""
    with httpx.Client(trust_env=False) as client:
        assert client.get(srv.url("/__sync__")).status_code == 200
    assert srv.seen[-1][0] == "/__sync__"
    return srv.accepted - 1


# --- SSRF guard ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "2130706433", "127.1", "[::ffff:127.0.0.1]"])
def test_loopback_is_refused_before_any_connection(server: CountingServer, host: str) -> None:
    server.routes["/x.png"] = serve(PNG)
    err = refused(config(), server.url("/x.png", host))
    assert err.code == "image_url_forbidden" and err.param == PARAM
    assert "allowed-media-domains" in err.message
    assert connections_made(server) == 0 and server.paths() == ["/__sync__"]


def test_allowed_host_is_fetched_and_hashed_server_side(server: CountingServer) -> None:
    server.routes["/x.png"] = serve(PNG)
    chat = prepare_chat(request(server.url("/x.png")), config(allowed_media_domains=("127.0.0.1",)))
    assert chat.items[0].data == PNG and chat.items[0].mm_hash == mm_hash("demo", PNG)
    assert server.seen == [("/x.png", f"127.0.0.1:{server.port}")]


def test_allowed_hosts_match_case_insensitively_and_fall_back_across_addresses(server: CountingServer) -> None:
    """localhost may resolve to ::1 first while the server listens on 127.0.0.1 only."""
    server.routes["/x.png"] = serve(PNG)
    assert fetched(config(allowed_media_domains=("LocalHost",)), server.url("/x.png", "localhost")) == PNG


def test_an_allowance_for_one_host_does_not_cover_another(server: CountingServer) -> None:
    server.routes["/x.png"] = serve(PNG)
    err = refused(config(allowed_media_domains=("localhost",)), server.url("/x.png"))
    assert err.code == "image_url_forbidden"
    assert connections_made(server) == 0


@pytest.fixture
def no_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a TCP connection fails the test."""
    def forbidden(*args: object, **kwargs: object) -> socket.socket:
        raise AssertionError(f"a connection was attempted: {args}")
    monkeypatch.setattr(socket, "create_connection", forbidden)


@pytest.fixture
def connection_log(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every TCP connection opened (address, port), opened for real."""
    real = socket.create_connection
    log: list[tuple[str, int]] = []

    def create_connection(address: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
        log.append(address)
        return real(address, *args, **kwargs)
    monkeypatch.setattr(socket, "create_connection", create_connection)
    return log


@pytest.mark.usefixtures("no_connections")
@pytest.mark.parametrize("url", [
    "http://10.0.0.1/x.png", "http://172.16.5.4/x.png", "http://192.168.1.1/x.png",  # RFC 1918
    "http://169.254.169.254/latest/meta-data/", "http://[fe80::1]/x.png",  # link-local, cloud metadata
    "http://[fc00::1]/x.png", "http://[fd00:ec2::254]/latest/",  # unique local (AWS IMDS over IPv6)
    "http://[::1]/x.png", "http://0.0.0.0/x.png", "http://[::]/x.png",  # loopback, unspecified
    "http://224.0.0.1/x.png", "http://[ff02::1]/x.png", "http://240.0.0.1/x.png",  # multicast, reserved
    "http://100.100.100.200/latest/meta-data/",  # shared address space (Alibaba metadata)
    "https://[::ffff:10.0.0.1]/x.png", "http://[2002:a9fe:a9fe::]/x.png",  # IPv4 wrapped in IPv6
    "http://metadata.google.internal/computeMetadata/v1/", "http://METADATA.GOOGLE.INTERNAL./x",
])
def test_non_public_addresses_are_refused(url: str) -> None:
    err = refused(config(), url)
    assert err.code == "image_url_forbidden", err.message


def fake_dns(monkeypatch: pytest.MonkeyPatch, answers: dict[str, list[list[str]]]) -> dict[str, int]:
    """getaddrinfo answers the given names (one address list per successive call); others resolve for real."""
    real = socket.getaddrinfo
    calls: dict[str, int] = {}

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in answers:
            return real(host, port, *args, **kwargs)
        calls[host] = calls.get(host, 0) + 1
        addresses = answers[host][min(calls[host], len(answers[host])) - 1]
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, int(port)))
                for a in addresses]
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return calls


@pytest.mark.usefixtures("no_connections")
@pytest.mark.parametrize("addresses", [["10.1.2.3"], ["93.184.216.34", "10.1.2.3"], ["2606:4700::1", "::1"]])
def test_a_name_is_refused_if_any_address_it_resolves_to_is_not_public(
        monkeypatch: pytest.MonkeyPatch, addresses: list[str]) -> None:
    fake_dns(monkeypatch, {"images.example.test": [addresses]})
    err = refused(config(), "https://images.example.test/cat.png")
    assert err.code == "image_url_forbidden" and "images.example.test" in err.message
    assert not any(a in err.message for a in addresses)  # the resolved address is not disclosed


def test_the_connection_goes_to_the_address_that_was_resolved_once(
        server: CountingServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """DNS rebinding: a second lookup would answer 10.9.9.9; the fetch must not look again."""
    calls = fake_dns(monkeypatch, {"pinned.test": [["127.0.0.1"], ["10.9.9.9"]]})
    server.routes["/x.png"] = serve(PNG)
    assert fetched(config(allowed_media_domains=("pinned.test",)), server.url("/x.png", "pinned.test")) == PNG
    assert calls == {"pinned.test": 1}
    assert server.seen == [("/x.png", f"pinned.test:{server.port}")]  # virtual hosting still works


def test_pinned_https_request_keeps_the_name_for_sni_and_certificate_checks() -> None:
    url = httpx.URL("https://images.example.com:8443/a.png?size=2")
    req = media.pinned_request(url, media.ipaddress.ip_address("2606:4700::1"), 2.5)
    assert str(req.url) == "https://[2606:4700::1]:8443/a.png?size=2"
    assert req.headers["host"] == "images.example.com:8443"
    assert req.extensions["sni_hostname"] == "images.example.com"
    assert req.extensions["timeout"] == {"connect": 2.5, "read": 2.5, "write": 2.5, "pool": 2.5}
    ip_url = media.pinned_request(httpx.URL("https://93.184.216.34/a.png"),
                                  media.ipaddress.ip_address("93.184.216.34"), 2.5)
    assert "sni_hostname" not in ip_url.extensions  # an IP host is checked against the certificate as is


def self_signed(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """(certificate, key) for `name`; the certificate doubles as the CA the client trusts."""
    cert, key = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={name}",
                    "-addext", f"subjectAltName=DNS:{name}"], check=True, capture_output=True)
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
@pytest.mark.parametrize("cert_name,ok", [("images.test", True), ("other.test", False)])
def test_https_is_pinned_yet_verified_against_the_host_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cert_name: str, ok: bool) -> None:
    """The connection goes to the checked IP, but SNI and certificate checks use the URL's name."""
    cert, key = self_signed(tmp_path, cert_name)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # httpx's transport trusts this bundle
    calls = fake_dns(monkeypatch, {"images.test": [["127.0.0.1"]]})
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    names: list[str | None] = []
    tls.sni_callback = lambda sock, name, ctx: names.append(name)
    srv = CountingServer()
    srv.socket = tls.wrap_socket(srv.socket, server_side=True)
    srv.routes["/x.png"] = serve(PNG)
    cfg = config(allowed_media_domains=("images.test",))
    with running(srv):
        url = f"https://images.test:{srv.port}/x.png"
        if ok:
            assert fetched(cfg, url) == PNG and srv.seen == [("/x.png", f"images.test:{srv.port}")]
        else:
            err = refused(cfg, url)
            assert err.code == "image_fetch_failed" and srv.seen == []
    assert names == ["images.test"] and calls == {"images.test": 1}


@pytest.mark.parametrize("address,public", [
    ("93.184.216.34", True), ("2606:4700::1111", True), ("8.8.8.8", True),
    ("127.0.0.1", False), ("10.0.0.1", False), ("169.254.169.254", False), ("::1", False), ("fe80::1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:8.8.8.8", True), ("2002:7f00:1::", False), ("64:ff9b::a00:1", False),
    ("64:ff9b::808:808", True), ("255.255.255.255", False), ("198.18.0.1", False),
])
def test_public_address_classification(address: str, public: bool) -> None:
    assert media.is_public_address(media.ipaddress.ip_address(address)) is public


# --- redirects ----------------------------------------------------------------------------------------------

ALLOW_LOOPBACK = {"allowed_media_domains": ("127.0.0.1",)}


@pytest.mark.parametrize("location", [
    "http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/x.png", "file:///etc/passwd",
    as_data_url(PNG), "http://metadata.google.internal/",
])
def test_redirects_to_forbidden_targets_are_not_followed(
        server: CountingServer, connection_log: list[tuple[str, int]], location: str) -> None:
    server.routes["/r"] = redirect(location)
    err = refused(config(**ALLOW_LOOPBACK), server.url("/r"))
    assert err.code == "image_url_forbidden"
    assert server.paths() == ["/r"] and connection_log == [("127.0.0.1", server.port)]


def test_a_redirect_to_a_host_not_allowed_is_refused_even_on_the_same_server(server: CountingServer) -> None:
    server.routes["/r"] = redirect(server.url("/x.png", "localhost"))
    server.routes["/x.png"] = serve(PNG)
    assert refused(config(**ALLOW_LOOPBACK), server.url("/r")).code == "image_url_forbidden"
    assert connections_made(server) == 1 and server.paths() == ["/r", "/__sync__"]


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_allowed_redirects_are_followed(server: CountingServer, status: int) -> None:
    server.routes["/r"] = redirect("/r2", status)
    server.routes["/r2"] = redirect(server.url("/x.png"))
    server.routes["/x.png"] = serve(PNG)
    assert fetched(config(**ALLOW_LOOPBACK), server.url("/r")) == PNG
    assert server.paths() == ["/r", "/r2", "/x.png"]


def test_redirect_loops_stop(server: CountingServer) -> None:
    server.routes["/loop"] = redirect("/loop")
    err = refused(config(**ALLOW_LOOPBACK), server.url("/loop"))
    assert err.code == "image_fetch_failed" and "redirects" in err.message
    assert server.paths() == ["/loop"] * (media.MAX_REDIRECTS + 1)


# --- what a server sends ------------------------------------------------------------------------------------

@pytest.mark.parametrize("content_type", ["text/html; charset=utf-8", "application/json", "text/plain"])
def test_non_image_content_types_are_refused(server: CountingServer, content_type: str) -> None:
    server.routes["/x"] = serve(b"<html>secret internal page</html>", content_type)
    err = refused(config(**ALLOW_LOOPBACK), server.url("/x"))
    assert err.code == "invalid_image" and "secret" not in err.message


def test_octet_stream_is_accepted_only_when_the_bytes_are_an_image(server: CountingServer) -> None:
    server.routes["/img"] = serve(PNG, "application/octet-stream")
    server.routes["/junk"] = serve(b"MZ\x90\0 not an image", "application/octet-stream")
    assert fetched(config(**ALLOW_LOOPBACK), server.url("/img")) == PNG
    assert refused(config(**ALLOW_LOOPBACK), server.url("/junk")).code == "invalid_image"


def test_http_errors_are_reported(server: CountingServer) -> None:
    err = refused(config(**ALLOW_LOOPBACK), server.url("/missing.png"))
    assert err.code == "image_fetch_failed" and "404" in err.message


@pytest.mark.parametrize("with_length", [True, False])
def test_bodies_over_the_cap_are_refused(server: CountingServer, with_length: bool) -> None:
    server.routes["/big.png"] = serve(PNG + b"\0" * (1 << 20), with_length=with_length)
    err = refused(config(max_image_bytes=64 << 10, **ALLOW_LOOPBACK), server.url("/big.png"))
    assert err.code == "image_too_large"


def test_an_endless_body_is_abandoned_at_the_cap(server: CountingServer) -> None:
    server.routes["/endless.png"] = endless()
    start = time.monotonic()
    err = refused(config(max_image_bytes=256 << 10, **ALLOW_LOOPBACK), server.url("/endless.png"))
    assert err.code == "image_too_large" and time.monotonic() - start < 10  # an endless body: any finite end


def test_a_server_that_never_answers_times_out() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # connections queue in the backlog, never accepted
        port = silent.getsockname()[1]
        start = time.monotonic()
        err = refused(config(media_fetch_timeout=0.3, allowed_media_domains=("127.0.0.1",)),
                      f"http://127.0.0.1:{port}/x.png")
        elapsed = time.monotonic() - start
    assert err.code == "image_fetch_failed" and "timed out" in err.message
    assert 0.25 < elapsed < 10  # waited for the timeout, and no longer than a generous bound (noisy machines)


def test_a_trickling_server_is_cut_off_by_the_overall_deadline(server: CountingServer) -> None:
    server.routes["/slow.png"] = endless(pause=0.05, chunk=b"\0")  # each read is quick; the whole never ends
    start = time.monotonic()
    err = refused(config(media_fetch_timeout=0.2, **ALLOW_LOOPBACK), server.url("/slow.png"))
    elapsed = time.monotonic() - start
    assert err.code == "image_fetch_failed" and "timed out" in err.message
    assert 0.5 <= elapsed < 10  # TOTAL_TIMEOUT_FACTOR (3) x 0.2 s; the server alone would never stop


def test_too_many_images_are_refused_before_anything_is_fetched(server: CountingServer) -> None:
    server.routes["/x.png"] = serve(PNG)
    err = refused(config(**ALLOW_LOOPBACK), *[server.url(f"/x.png?{i}") for i in range(300)])
    assert err.code == "too_many_images" and err.param == "messages"
    assert connections_made(server) == 0


def test_a_url_repeated_in_a_request_is_fetched_once(server: CountingServer) -> None:
    server.routes["/x.png"] = serve(PNG)
    chat = prepare_chat(request(server.url("/x.png"), server.url("/x.png")), config(**ALLOW_LOOPBACK))
    assert [i.data for i in chat.items] == [PNG, PNG] and server.paths() == ["/x.png"]


# --- URL forms ----------------------------------------------------------------------------------------------

@pytest.mark.usefixtures("no_connections")
@pytest.mark.parametrize("url", ["ftp://example.com/x.png", "gopher://example.com/", "javascript:alert(1)",
                                 "//example.com/x.png", "x.png", "", "http:///x.png", "http://exa mple.com/"])
def test_other_schemes_and_malformed_urls_are_invalid(url: str) -> None:
    assert refused(config(), url).code == "invalid_image_url"


def test_oversized_data_urls_are_refused_before_decoding() -> None:
    err = refused(config(max_image_bytes=100), as_data_url(PNG))
    assert err.code == "image_too_large"


# --- file:// URLs -------------------------------------------------------------------------------------------

@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "cat.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    return root


def test_file_urls_under_the_allowed_directory_are_read(media_dir: Path) -> None:
    cfg = config(allowed_local_media_path=str(media_dir))
    assert fetched(cfg, f"file://{media_dir}/sub/cat.png") == PNG
    assert fetched(cfg, f"file://localhost{media_dir}/sub/../sub/cat.png") == PNG
    (media_dir / "alias.png").symlink_to(media_dir / "sub" / "cat.png")  # a link that stays inside is fine
    assert fetched(cfg, f"file://{media_dir}/alias.png") == PNG


def test_the_allowed_directory_may_itself_be_a_symlink(media_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(media_dir)
    assert fetched(config(allowed_local_media_path=str(tmp_path / "link")), f"file://{media_dir}/sub/cat.png") == PNG


def test_file_urls_escaping_the_allowed_directory_are_refused(media_dir: Path, tmp_path: Path) -> None:
    cfg = config(allowed_local_media_path=str(media_dir))
    (media_dir / "escape.png").symlink_to(tmp_path / "secret.png")
    (tmp_path / "media-evil").mkdir()  # a sibling sharing the prefix is not inside
    (tmp_path / "media-evil" / "x.png").write_bytes(PNG)
    for url in [f"file://{media_dir}/../secret.png", f"file://{media_dir}/%2e%2e/secret.png",
                f"file://{media_dir}/escape.png", f"file://{tmp_path}/media-evil/x.png", "file:///etc/passwd"]:
        err = refused(cfg, url)
        assert (err.code, err.param) == ("image_url_forbidden", PARAM), url


@pytest.mark.parametrize("url", ["file:///etc/passwd", "file:///dev/zero", "file://localhost/etc/hostname"])
def test_file_urls_are_refused_when_no_directory_is_allowed(url: str) -> None:
    err = refused(config(), url)
    assert err.code == "image_url_forbidden" and "not enabled" in err.message


def test_unreadable_or_special_files_are_refused_without_blocking(media_dir: Path) -> None:
    cfg = config(allowed_local_media_path=str(media_dir), max_image_bytes=len(PNG))
    os.mkfifo(media_dir / "pipe.png")  # opening a FIFO for reading would block without O_NONBLOCK
    (media_dir / "big.png").write_bytes(PNG + b"\0")
    cases = {"pipe.png": "image_fetch_failed", "sub": "image_fetch_failed", "none.png": "image_fetch_failed",
             "big.png": "image_too_large"}
    for name, code in cases.items():
        assert refused(cfg, f"file://{media_dir}/{name}").code == code, name
    assert refused(cfg, f"file://otherhost{media_dir}/sub/cat.png").code == "invalid_image_url"


# --- image checks -------------------------------------------------------------------------------------------

@cache
def huge_png(side: int = 30_000) -> bytes:
    """A valid side x side 1-bit PNG of zeros: ~100 KB on disk, 900 Mpixels (the IDAT is zlib'd zero rows)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = bytes((1 + (side + 7) // 8) * 1000)  # filter byte + packed bits, 1000 rows
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(rows) for _ in range(side // 1000)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_a_huge_image_is_refused_on_its_header_quickly_and_in_little_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    url = as_data_url(huge_png())
    with monkeypatch.context() as m:  # quickly: refused from the header, not one pixel decoded
        m.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("pixels were decoded"))
        err = refused(config(), url)
    assert err.code == "image_too_large" and "pixels" in err.message
    tracemalloc.start()
    try:
        refused(config(), url)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 50 << 20
    with pytest.raises(ImageTooLargeError):
        load_image(huge_png())


def webp_header(width: int, height: int) -> bytes:
    """An extended (VP8X) WebP header declaring a width x height canvas: a few dozen bytes."""
    vp8x = b"\0" * 4 + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    body = b"WEBP" + b"VP8X" + struct.pack("<I", len(vp8x)) + vp8x
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_a_webp_canvas_over_the_limit_is_refused_before_libwebp_allocates_it() -> None:
    """Pillow would create libwebp's decoder (a canvas of 4 bytes per pixel, twice) inside Image.open."""
    err = refused(config(), as_data_url(webp_header(13_000, 13_000), "image/webp"))
    assert err.code == "image_too_large" and "13000x13000" in err.message  # our check, not Pillow's
    with pytest.raises(ImageTooLargeError, match="7000x7000"):
        open_image(webp_header(7000, 7000))


def test_the_pixel_limit_is_the_configured_one() -> None:
    err = refused(config(max_image_pixels=32 * 24 - 1), as_data_url(PNG))
    assert err.code == "image_too_large" and "32x24" in err.message
    assert open_image(PNG, 32 * 24).size == (32, 24)


@pytest.mark.parametrize("raw", [
    encode(make_image(16, 16), "ICO"), encode(make_image(16, 16), "TGA"), encode(make_image(16, 16), "PCX"),
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", b"<svg xmlns='http://www.w3.org/2000/svg'/>",
    PNG[:20], b"",
], ids=["ico", "tga", "pcx", "eps", "svg", "truncated_header", "empty"])
def test_unsupported_or_broken_formats_are_refused(raw: bytes) -> None:
    err = refused(config(), as_data_url(raw))
    assert err.code == "invalid_image" and "0x" not in err.message  # no object reprs leak


def _grey16() -> Image.Image:
    img = Image.new("I;16", (20, 10))
    img.putpixel((0, 0), 65535)
    return img


def _palette_with_transparency() -> bytes:
    img = Image.new("P", (12, 8), 1)
    img.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    img.putpixel((0, 0), 0)
    return encode(img, "PNG", transparency=0)


ODD_IMAGES = {
    "cmyk_jpeg": (encode(Image.new("CMYK", (20, 10), (0, 255, 255, 0)), "JPEG"), (20, 10)),
    "grey16_png": (encode(_grey16(), "PNG"), (20, 10)),
    "palette_transparency_png": (_palette_with_transparency(), (12, 8)),
    "rgba_png": (encode(Image.new("RGBA", (9, 7), (255, 0, 0, 0)), "PNG"), (9, 7)),
    "la_png": (encode(Image.new("LA", (5, 5), (10, 128)), "PNG"), (5, 5)),
    "one_by_one": (encode(Image.new("RGB", (1, 1), "blue"), "PNG"), (1, 1)),
    "very_wide": (encode(Image.new("L", (4000, 2), 200), "PNG"), (4000, 2)),
    "bilevel_tiff": (encode(Image.new("1", (30, 3), 1), "TIFF"), (30, 3)),
    "animated_gif": (encode(Image.new("P", (6, 6)), "GIF", save_all=True,
                            append_images=[Image.new("P", (6, 6), 3)]), (6, 6)),
    "webp": (encode(Image.new("RGB", (8, 8), "green"), "WEBP"), (8, 8)),
    "bmp": (encode(Image.new("RGB", (3, 5), "green"), "BMP"), (3, 5)),
    "lossless_webp": (encode(Image.new("RGBA", (7, 4), (0, 0, 255, 128)), "WEBP", lossless=True), (7, 4)),
    "mpo": (encode(Image.new("RGB", (8, 6), "red"), "MPO", save_all=True,
                   append_images=[Image.new("RGB", (8, 6), "blue")]), (8, 6)),  # JPEG with extra frames
}


@pytest.mark.parametrize("name", list(ODD_IMAGES))
def test_odd_but_valid_images_are_accepted_and_decode_to_rgb(name: str) -> None:
    raw, size = ODD_IMAGES[name]
    assert fetched(config(), as_data_url(raw, "image/x-any")) == raw
    img = load_image(raw)
    assert (img.mode, img.size) == ("RGB", size)


def test_conversions_keep_the_picture() -> None:
    rgba = load_image(ODD_IMAGES["rgba_png"][0])
    assert rgba.getpixel((0, 0)) == (255, 255, 255)  # fully transparent red composites to white
    palette = load_image(ODD_IMAGES["palette_transparency_png"][0])
    assert palette.getpixel((0, 0)) == (255, 255, 255) and palette.getpixel((1, 1)) == (255, 0, 0)
    grey = load_image(ODD_IMAGES["grey16_png"][0])
    assert grey.getpixel((0, 0)) == (255, 255, 255) and grey.getpixel((1, 0)) == (0, 0, 0)
    cmyk = load_image(ODD_IMAGES["cmyk_jpeg"][0]).getpixel((5, 5))
    assert isinstance(cmyk, tuple) and cmyk[0] > 200 and cmyk[1] < 60 and cmyk[2] < 60  # red


def test_corrupt_pixels_are_an_image_error() -> None:
    with pytest.raises(ImageError):
        load_image(PNG[: len(PNG) // 2])
