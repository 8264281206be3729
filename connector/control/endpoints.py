"""Endpoint strings of a producer: what peers on other hosts can reach, and where its cache events are published."""

from __future__ import annotations


def advertised(endpoint: str, host: str | None) -> str:
    """`endpoint` with its tcp host replaced by `host` (what peers on other hosts can reach); ipc unchanged."""
    if not host or not endpoint.startswith("tcp://"):
        return endpoint
    port = endpoint.rpartition(":")[2]
    return f"tcp://{f'[{host}]' if ':' in host else host}:{port}"


def events_endpoint(bind: str) -> str:
    """Where the PUB socket binds by default: beside the ROUTER endpoint."""
    if bind.startswith("ipc://"):
        return bind + ".events"
    host, _, port = bind.rpartition(":")
    return f"{host}:{int(port) + 1 if port.isdigit() and int(port) else 0}"
