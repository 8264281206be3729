"""http(s) image URLs: the SSRF guard, redirects re-checked, what a server sends (types, caps, timeouts).

The tests run a real HTTP server on loopback in a thread. "No connection was made" is checked by
counting the connections the server accepted: after the request under test, one more (sentinel) request is
made, and since the listening socket hands out connections in order, any connection made by the request
under test would have been accepted first.
"""
from __future__ import annotations

import ipaddress
import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from epd_contracts.hashing import mm_hash
from proxy import fetch, ssrf
from proxy.prepare import prepare_chat
from tests.proxy.media_helpers import (
    PARAM,
    PNG,
    CountingServer,
    as_data_url,
    config,
    connections_made,
    endless,
    fetched,
    redirect,
    refused,
    request,
    running,
    serve,
)

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
    assert chat.items[0].data == PNG and chat.items[0].mm_hash == mm_hash(PNG)
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
    req = fetch.pinned_request(url, ipaddress.ip_address("2606:4700::1"), 2.5, "image/*")
    assert str(req.url) == "https://[2606:4700::1]:8443/a.png?size=2"
    assert req.headers["host"] == "images.example.com:8443"
    assert req.extensions["sni_hostname"] == "images.example.com"
    assert req.extensions["timeout"] == {"connect": 2.5, "read": 2.5, "write": 2.5, "pool": 2.5}
    ip_url = fetch.pinned_request(httpx.URL("https://93.184.216.34/a.png"),
                                  ipaddress.ip_address("93.184.216.34"), 2.5, "image/*")
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
    assert ssrf.is_public_address(ipaddress.ip_address(address)) is public


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
    assert server.paths() == ["/loop"] * (fetch.MAX_REDIRECTS + 1)


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
    err = refused(config(max_image_bytes=256 << 10, **ALLOW_LOOPBACK), server.url("/endless.png"))
    assert err.code == "image_too_large"  # the event: the body was cut at the cap (a fetch that never ends would
    # hang here until pytest-timeout, so no wall-clock bound is asserted: one could fail on a busy machine)


def test_a_server_that_never_answers_times_out() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # connections queue in the backlog, never accepted
        port = silent.getsockname()[1]
        start = time.monotonic()
        err = refused(config(media_fetch_timeout=0.3, allowed_media_domains=("127.0.0.1",)),
                      f"http://127.0.0.1:{port}/x.png")
        elapsed = time.monotonic() - start
    assert err.code == "image_fetch_failed" and "timed out" in err.message
    assert elapsed > 0.25  # waited for the timeout (a lower bound: a busy machine only makes it longer; the
    # fetch ending at all is the event above, with pytest-timeout against a hang)


def test_a_trickling_server_is_cut_off_by_the_overall_deadline(server: CountingServer) -> None:
    server.routes["/slow.png"] = endless(pause=0.05, chunk=b"\0")  # each read is quick; the whole never ends
    start = time.monotonic()
    err = refused(config(media_fetch_timeout=0.2, **ALLOW_LOOPBACK), server.url("/slow.png"))
    elapsed = time.monotonic() - start
    assert err.code == "image_fetch_failed" and "timed out" in err.message
    assert elapsed >= 0.5  # TOTAL_TIMEOUT_FACTOR (3) x 0.2 s, a lower bound; the server alone would never stop


def test_too_many_images_are_refused_before_anything_is_fetched(server: CountingServer) -> None:
    server.routes["/x.png"] = serve(PNG)
    err = refused(config(**ALLOW_LOOPBACK), *[server.url(f"/x.png?{i}") for i in range(300)])
    assert err.code == "too_many_images" and err.param == "messages"
    assert connections_made(server) == 0


def test_a_url_repeated_in_a_request_is_fetched_once(server: CountingServer) -> None:
    server.routes["/x.png"] = serve(PNG)
    chat = prepare_chat(request(server.url("/x.png"), server.url("/x.png")), config(**ALLOW_LOOPBACK))
    assert [i.data for i in chat.items] == [PNG, PNG] and server.paths() == ["/x.png"]
