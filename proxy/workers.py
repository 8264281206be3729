"""The proxy's view of its workers: membership (static or registered), health probes, load, marking down."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx

from epd_common.errors import APIError
from proxy.worker_state import Worker, describe_failure
from scheduler.affinity import Route, choose, least_loaded

logger = logging.getLogger("epd.proxy")
ROLES = ("encoder", "decoder", "prefill")  # prefill: a decoder started with --role prefill (E -> P -> D)
GENERATORS = ("decoder", "prefill")  # the roles that run /generate


_UNREACHABLE_LOG_S = 10.0  # while waiting at start, an unreachable worker is logged at most this often


class ModelMismatch(Exception):
    """The worker serves another model than the fleet (its /health `model_identity` differs)."""


def check_worker_url(url: str) -> str:
    """`url` without a trailing slash if it is a worker base URL (http(s)://host[:port]); ValueError naming
    what is wrong otherwise (no scheme, bad port, a path, a query)."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or "://" not in url:
        raise ValueError(f"worker URL {url!r} needs a scheme: http://HOST:PORT")
    try:
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number in 0..65535)
    except ValueError as exc:
        raise ValueError(f"worker URL {url!r} has a bad port: {exc}") from exc
    if not parts.hostname:
        raise ValueError(f"worker URL {url!r} names no host")
    if parts.path or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"worker URL {url!r} must be a base URL (http://HOST:PORT), without path, query or user")
    return url


def identity_of(info: dict[str, Any]) -> dict[str, Any] | None:
    """The `model_identity` a worker's /health reports, or None (unknown: an older or foreign worker)."""
    ident = info.get("model_identity")
    return ident if isinstance(ident, dict) and ident.get("fingerprint") else None


def served_name(model: str) -> str:
    """The name clients send for a --model: 'demo' and 'bench' as they are, a path or hub id by its last part."""
    return model if model in ("demo", "bench") else os.path.basename(os.path.normpath(model))


def _show(ident: dict[str, Any]) -> str:
    return f"{ident.get('family')}/{ident.get('fingerprint')} (hidden_size {ident.get('hidden_size')})"


def loras_of(worker: Worker) -> dict[str, str | None]:
    """The LoRA adapters a decoder's last /health listed: name -> base model name (None: not given)."""
    return {a["name"]: a.get("base_model_name") for a in _listed(worker)}


def _listed(worker: Worker) -> list[dict[str, Any]]:
    listed = worker.info.get("loras")
    return [a for a in listed if isinstance(a, dict) and isinstance(a.get("name"), str)] \
        if isinstance(listed, list) else []


class Workers:
    """Every worker the proxy knows, by URL. Probes run every `interval` s; `failures_to_down` failed probes
    in a row take a worker out, one good probe brings it back. A failed call (connection refused, reset,
    timed out) takes it out at once: that is stronger evidence than a probe. A worker that answers, even
    with an error about one request's content, stays in.

    Pairing: the first healthy worker that reports a `model_identity` fixes the fleet's; a worker whose
    identity differs is never taken into service (logged with both). A worker that reports none is
    unknown: taken, with a warning (older workers and test fakes report none).

    Decoders are chosen by prefix affinity (scheduler/affinity.py) within `load_gap` of the least-loaded one; a
    `load_gap` of None: by load alone. `on_route` hears how each choice was made (the affinity metric)."""

    def __init__(self, client: httpx.AsyncClient, interval: float, timeout: float, failures_to_down: int,
                 on_up: Callable[[Worker], None], on_down: Callable[[Worker], None], load_gap: int | None = None,
                 on_route: Callable[[Route], None] | None = None):
        self.client, self.interval, self.timeout, self.failures_to_down = client, interval, timeout, failures_to_down
        self.on_up, self.on_down, self.load_gap, self.on_route = on_up, on_down, load_gap, on_route
        self.by_url: dict[str, Worker] = {}
        self.identity: dict[str, Any] | None = None  # the fleet's model, fixed by its first healthy worker
        self.model_name: str | None = None  # served_name of the first healthy worker's /health `model`
        self._unknown: set[str] = set()  # URLs already warned about for reporting no identity
        self._task: asyncio.Task[None] | None = None

    def of(self, role: str) -> list[Worker]:
        return [w for w in self.by_url.values() if w.role == role]

    def healthy(self, role: str) -> list[Worker]:
        return [w for w in self.by_url.values() if w.role == role and w.healthy]

    def loras(self) -> dict[str, str | None]:
        """The LoRA adapters healthy decoders serve (their /health `loras`): name -> base model name, if given."""
        return {name: parent for role in GENERATORS for w in self.healthy(role) for name, parent in loras_of(w).items()}

    def vision_loras(self) -> set[str]:
        """The adapters whose weights reach the vision tower (a decoder's /health says `vision`): their images are
        encoded under them, on the encoders, and keyed apart (proxy/prepare.py `under_vision_adapter`)."""
        return {a["name"] for role in GENERATORS for w in self.healthy(role) for a in _listed(w) if a.get("vision")}

    def add(self, role: str, url: str) -> Worker:
        """Register a worker (idempotent); it takes work once a probe finds it healthy."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        existing = self.by_url.get(url)
        if existing is not None:
            if existing.role != role:
                raise ValueError(f"{url} is already registered as a {existing.role}")
            return existing
        worker = self.by_url[url] = Worker(role=role, url=url)
        logger.info("registered %s %s", role, url)
        return worker

    def remove(self, url: str) -> Worker | None:
        worker = self.by_url.pop(url, None)
        if worker is not None:
            self._set_down(worker, "deregistered")
            logger.info("deregistered %s %s", worker.role, url)
        return worker

    async def wait_healthy(self, urls: list[str], deadline: float) -> None:
        """Probe until each of `urls` answers /health (start-up of static workers); each one still
        unreachable is logged with its URL and why, at most every few seconds. A worker of another model
        fails the start at once (ModelMismatch): the configuration is wrong."""
        async def one(url: str) -> None:
            worker = self.by_url[url]
            while not await self.probe(worker):
                if worker.reason.startswith("model_mismatch"):
                    raise ModelMismatch(f"{worker.role} {url}: {worker.reason}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker {url} not healthy: {worker.reason}")
                if time.monotonic() - worker.logged_at >= _UNREACHABLE_LOG_S:
                    worker.logged_at = time.monotonic()
                    logger.warning("waiting for %s %s: %s", worker.role, url, worker.reason)
                await asyncio.sleep(0.2)
        await asyncio.gather(*(one(u) for u in urls))

    def start(self) -> None:
        self._task = asyncio.create_task(self._probe_forever(), name="epd-health-probes")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def probe(self, worker: Worker) -> bool:
        """One GET /health; True if healthy now."""
        mark = worker.prefixes.probe_started()
        try:
            resp = await self.client.get(f"{worker.url}/health", timeout=self.timeout)
            ok, info = resp.status_code == 200, (resp.json() if resp.status_code == 200 else {})
            reason = f"/health answered {resp.status_code}"
            if ok and not isinstance(info, dict):
                ok, info, reason = False, {}, "/health answered no JSON object"
        except httpx.HTTPError as exc:
            ok, info, reason = False, {}, f"/health failed: {describe_failure(exc)}"
        except ValueError:
            ok, info, reason = False, {}, "/health answered no JSON"
        if worker.url not in self.by_url:  # deregistered while probing
            return False
        if ok and not self._same_model(worker, info):
            return False
        if ok:
            worker.failures, worker.info = 0, dict(info)
            if worker.role == "prefill" and info.get("decoder_role") != "prefill":
                self.mark_down(worker, "not a prefill worker: its /health says decoder_role "
                                       f"{info.get('decoder_role')!r} (start it with epd-decoder --role prefill)")
                return False
            if worker.role in GENERATORS:
                worker.prefixes.update(info.get("prefix_cache"), mark)
            if self.model_name is None and isinstance(info.get("model"), str):
                self.model_name = served_name(info["model"])
            if not worker.healthy:
                worker.healthy, worker.down = True, asyncio.Event()
                logger.info("%s %s is healthy", worker.role, worker.url)
            self.on_up(worker)  # also when already up: an encoder may have restarted on a new address
            return True
        worker.failures += 1
        if worker.failures >= self.failures_to_down or not worker.info:
            self.mark_down(worker, f"{worker.failures} failed probe(s): {reason}")
        return False

    def _same_model(self, worker: Worker, info: dict[str, Any]) -> bool:
        """Whether the worker may serve with the fleet; the first identity seen becomes the fleet's."""
        ident = identity_of(info)
        if ident is None:
            if worker.url not in self._unknown:
                self._unknown.add(worker.url)
                logger.warning("%s %s reports no model_identity: cannot check that it serves the fleet's model",
                               worker.role, worker.url)
            return True
        if self.identity is None:
            self.identity = dict(ident)
            logger.info("fleet model: %s (from %s %s)", _show(ident), worker.role, worker.url)
        if ident.get("fingerprint") == self.identity.get("fingerprint"):
            return True
        reason = f"model_mismatch: it serves {_show(ident)}, the fleet serves {_show(self.identity)}"
        if worker.reason != reason:
            logger.error("%s %s refused: %s", worker.role, worker.url, reason)
        worker.info = {}
        self.mark_down(worker, reason)
        return False

    def mark_down(self, worker: Worker, reason: str) -> None:
        if worker.healthy:
            logger.warning("%s %s marked down: %s", worker.role, worker.url, reason)
        self._set_down(worker, reason)

    def not_ready(self, need_encoder: bool) -> str | None:
        """Why no request could be served now (no healthy decoder or prefill worker: either runs a request whole; no
        healthy encoder unless aggregated)."""
        for role, roles in (("decoder", GENERATORS), ("encoder", ("encoder",)))[:2 if need_encoder else 1]:
            if not any(self.healthy(r) for r in roles):
                reasons = "; ".join(f"{w.url}: {w.reason}" for r in roles for w in self.of(r)) or "none registered"
                return f"no healthy {role} ({reasons})"
        return None

    def acquire_decoder(self, exclude: set[str], prefix_keys: Sequence[str] = (), role: str = "decoder",
                        lora: str = "") -> Worker:
        """A healthy decoder (or prefill worker) not in `exclude` (holding the LoRA adapter `lora`, if one), by prefix
        affinity for a request with `prefix_keys` (by load alone when affinity is off, or with no keys); its load goes
        up by one."""
        candidates = [w for w in self.healthy(role) if w.url not in exclude and (not lora or lora in loras_of(w))]
        if not candidates:
            held = f" holding LoRA adapter {lora!r}" if lora else ""
            raise APIError(503, f"no healthy {role}{held} is available", code=f"{role}_unavailable")
        if self.load_gap is None:
            worker = least_loaded(candidates)
        else:
            worker, route = choose(candidates, prefix_keys, self.load_gap)
            if self.on_route is not None:
                self.on_route(route)
        worker.load += 1
        return worker

    def _set_down(self, worker: Worker, reason: str) -> None:
        was_healthy = worker.healthy
        worker.healthy, worker.reason = False, reason
        worker.set_down()
        if was_healthy:
            self.on_down(worker)

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            workers = list(self.by_url.values())
            results = await asyncio.gather(*(self.probe(w) for w in workers), return_exceptions=True)
            for w, res in zip(workers, results, strict=True):
                if isinstance(res, Exception):  # never let one odd worker stop every probe
                    logger.error("probe of %s %s failed: %r", w.role, w.url, res)
                    self.mark_down(w, f"probe failed: {type(res).__name__}")
