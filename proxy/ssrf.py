"""Which hosts a media download may contact (the SSRF guard): the host is resolved once and every address it
resolves to must be public, cloud metadata names are refused before resolving, and hosts listed in
--allowed-media-domains skip the address check; proxy/fetch.py then connects to a checked address only."""
from __future__ import annotations

import ipaddress
import re
import socket

import httpx

from proxy.config import ProxyConfig
from proxy.media_rules import MediaBytes

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Names of cloud metadata services, refused even before resolving (they may be reachable without resolving to
# a link-local address, e.g. through a resolver search domain or a metadata proxy).
METADATA_HOSTS = frozenset({
    "metadata", "metadata.google.internal", "metadata.goog", "instance-data", "instance-data.ec2.internal",
    "metadata.azure.internal", "metadata.tencentyun.com", "metadata.oraclecloud.com",
})
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_HOSTNAME = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?")


def check_fetch_target(url: httpx.URL, cfg: ProxyConfig, kind: MediaBytes) -> list[IPAddress]:
    """Resolve the URL's host and return the addresses that may be connected to, refusing non-public ones.

    Runs before any connection. A host listed in cfg.allowed_media_domains (exact, case-insensitive; names or
    IP literals) may resolve anywhere; for any other host every resolved address must be public, so a name
    with one public and one private address is refused too.
    """
    names = _host_names(url)
    allowed = not names.isdisjoint(_allowed_hosts(cfg))
    if not allowed and not names.isdisjoint(METADATA_HOSTS):
        raise kind.error("forbidden", f"{kind.name} host {host_of(url)!r} is a cloud metadata service")
    addresses = resolve(url, kind)
    if not allowed and not all(is_public_address(a) for a in addresses):
        raise kind.error("forbidden", f"{kind.name} host {host_of(url)!r} resolves to a non-public address (loopback, "
                                      "private, link-local or reserved); the server must list it in "
                                      "--allowed-media-domains")
    return addresses


def resolve(url: httpx.URL, kind: MediaBytes) -> list[IPAddress]:
    """All addresses the URL's host resolves to (an IP literal resolves to itself, in any inet_aton form)."""
    host = url.raw_host.decode("ascii")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise kind.error("failed", f"cannot resolve {kind.name} host {host_of(url)!r}") from exc
    addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos
                                   if info[0] in (socket.AF_INET, socket.AF_INET6)))
    if not addresses:
        raise kind.error("failed", f"cannot resolve {kind.name} host {host_of(url)!r}")
    return addresses


def is_public_address(ip: IPAddress) -> bool:
    """False for loopback, private (RFC 1918, fc00::/7), link-local, unspecified, multicast, reserved and any
    other non-global range (e.g. 100.64/10), also when wrapped in an IPv6 form that routes to IPv4."""
    return not any(a.is_loopback or a.is_private or a.is_link_local or a.is_unspecified or a.is_multicast
                   or a.is_reserved or not a.is_global for a in _address_forms(ip))


def _address_forms(ip: IPAddress) -> list[IPAddress]:
    """The addresses that decide where a connection to `ip` really goes.

    IPv4-mapped (::ffff:a.b.c.d) and NAT64 (64:ff9b::a.b.c.d) addresses reach the embedded IPv4 address, so
    that is what is judged (the IPv6 forms themselves are 'reserved'); a 6to4 address must be public in both
    forms.
    """
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return [ip.ipv4_mapped]
        if ip in _NAT64:
            return [ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)]
        if ip.sixtofour is not None:
            return [ip, ip.sixtofour]
    return [ip]


def host_of(url: httpx.URL) -> str:
    return url.host


def _host_names(url: httpx.URL) -> set[str]:
    """The host as written and in its IDNA (ASCII) form, lower case, without a trailing dot."""
    return {_normalise_host(url.host), _normalise_host(url.raw_host.decode("ascii"))}


def _allowed_hosts(cfg: ProxyConfig) -> set[str]:
    return {_normalise_host(h) for h in cfg.allowed_media_domains if h.strip()}


def _normalise_host(host: str) -> str:
    return host.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")


def valid_host(host: str) -> bool:
    """A DNS name (IDNA-encoded already) or an IP literal; httpx lets through hosts like 'exa mple.com'."""
    return bool(_HOSTNAME.fullmatch(host)) or is_ip_literal(host)


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
