"""Who else listens on a TCP port, from the kernel's socket tables (Linux /proc/net/tcp and tcp6).

A server that binds its port with SO_REUSEPORT (beside the launcher's reservation: epd_common.server, EPD_REUSE_PORT)
would, once it listens, join the listening group of any other process of the same user that listens there too, and
the kernel would spread connections over both: two stacks on one --worker-base-port answered each other's clients.
An `ExclusiveListenSocket`'s server looks just before it listens and refuses to start instead.
"""
from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
_LISTEN = "0A"  # TCP_LISTEN in the st column


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp's address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(packed)
    return addr.ipv4_mapped or addr if isinstance(addr, ipaddress.IPv6Address) else addr


def _overlap(a: ipaddress.IPv4Address | ipaddress.IPv6Address,
             b: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Both take connections to one address (the same one, or either is a wildcard)."""
    return a == b or a.is_unspecified or b.is_unspecified


def listeners(host: str, port: int) -> int:
    """How many sockets listen on `port` at an address that overlaps `host` (a numeric address); 0 where the
    tables cannot be read (not Linux)."""
    mine = ipaddress.ip_address(host)
    mine = mine.ipv4_mapped or mine if isinstance(mine, ipaddress.IPv6Address) else mine
    found = 0
    for table in _TABLES:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, _, hex_port = fields[1].partition(":")
            if fields[3] == _LISTEN and int(hex_port, 16) == port and _overlap(_address(addr), mine):
                found += 1
    return found


def refuse_if_listened(host: str, port: int) -> None:
    """SystemExit naming the port when a socket already listens on it (at an overlapping address)."""
    if listeners(host, port):
        raise SystemExit(f"error: another process already listens on {host}:{port}; refusing to share the port "
                         "(another EPD stack on the same --worker-base-port or --port?)")


class ExclusiveListenSocket(socket.socket):
    """A socket to listen on only where no other socket listens: with SO_REUSEPORT the kernel would let it join that
    listener's group. Whoever makes it listen calls `refuse_if_listened` just before (epd_common.admission's
    GracefulServer does, after the app's startup: uvloop listens in C, past any Python override of listen())."""

    def refuse_if_listened(self) -> None:
        refuse_if_listened(*self.getsockname()[:2])
