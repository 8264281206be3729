"""Launcher mode's --autoscale: the planner (epd_planner) sizes the local fleet, and the launcher follows it.

Every --autoscale-window seconds the planner reads the proxy and its workers (their own metrics) and recommends a
count per role, through its hysteresis and within --min-* / --max-*. The launcher then moves each role one worker
toward it:
- up: spawn one (epd_launcher/spawn.py `Spawner`, as at start), wait for its /health, register it with the proxy
  (POST /instances with the internal key): the proxy sends it work after its first good probe;
- down: take the newest worker of the role out of the proxy first (DELETE /instances: no new work; an encode call
  in flight there moves to another encoder, a generation in flight finishes), then SIGTERM it: it drains what it
  still holds (epd_common.admission) and exits. A decoder that gathers an item from it after that re-encodes the
  item (the recovery every gather miss takes): no request fails.
The workers spawned at start are never retired below --min-*; the newest goes first.
"""
from __future__ import annotations

import logging
import threading
import time

import httpx

from epd_launcher.group import STOP_MARGIN_S, Worker, healthy
from epd_launcher.spawn import Spawner
from epd_planner.planner import Planner, PlannerConfig

logger = logging.getLogger("epd.launcher")
ROLES = ("encoder", "prefill", "decoder")


class Autoscaler:
    """Follows the planner's recommendation with local workers; `start` runs it on a thread of its own (which also
    spawns: see epd_launcher/group.py `_die_with_parent`), `stop` ends it."""

    def __init__(self, spawner: Spawner, proxy_url: str, internal_key: str, cfg: PlannerConfig,
                 workers: dict[str, list[Worker]], startup_timeout: float, shutdown_timeout: float,
                 planner: Planner | None = None):
        self.spawner, self.proxy_url, self.cfg = spawner, proxy_url, cfg
        self.headers = {"Authorization": f"Bearer {internal_key}"}
        self.workers = {role: list(workers.get(role, [])) for role in ROLES}  # spawned at start, then by this
        self.next_index = {role: len(ws) for role, ws in self.workers.items()}
        self.startup_timeout, self.grace = startup_timeout, shutdown_timeout + STOP_MARGIN_S
        self.planner = planner or Planner(cfg)
        self.events: list[tuple[str, str, str]] = []  # (what, role, url): "added", "retired", "failed"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="epd-autoscale", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.startup_timeout + self.grace)

    def _run(self) -> None:
        self.planner.run(self._stop, lambda step: self.follow(step.recommended))

    def follow(self, recommended: dict[str, int]) -> None:
        """Move each role one worker toward its recommended count (the planner's bounds are --min-* / --max-*)."""
        for role in ROLES:
            want, have = recommended.get(role), len(self.workers[role])
            if want is None or self._stop.is_set():
                continue
            if want > have:
                self.add(role)
            elif want < have and have > self.cfg.bounds.low(role):
                self.retire(role)

    def add(self, role: str) -> Worker | None:
        """Spawn one worker of `role`, wait until it answers /health, register it with the proxy."""
        i = self.next_index[role]
        self.next_index[role] += 1
        worker = self.spawner.spawn(role, i)
        logger.info("autoscale: adding %s %s (%d -> %d)", role, worker.url, len(self.workers[role]),
                    len(self.workers[role]) + 1)
        if not self._wait_ready(worker) or not self._call("POST", role, worker.url):
            logger.error("autoscale: %s %s did not come up; stopping it", role, worker.url)
            self.spawner.group.retire(worker, self.grace)
            self.events.append(("failed", role, worker.url))
            return None
        self.workers[role].append(worker)
        self.events.append(("added", role, worker.url))
        return worker

    def retire(self, role: str) -> None:
        """Take the newest worker of `role` out of the proxy, then stop it (it drains first)."""
        worker = self.workers[role].pop()
        logger.info("autoscale: retiring %s %s (%d -> %d)", role, worker.url, len(self.workers[role]) + 1,
                    len(self.workers[role]))
        self._call("DELETE", role, worker.url)  # a 404 (already gone) is fine: it gets no work either way
        self.spawner.group.retire(worker, self.grace)
        self.events.append(("retired", role, worker.url))

    def _call(self, method: str, role: str, url: str) -> bool:
        try:
            resp = httpx.request(method, f"{self.proxy_url}/instances", json={"role": role, "url": url},
                                 headers=self.headers, timeout=self.cfg.timeout + 30.0)
        except httpx.HTTPError as exc:
            logger.error("autoscale: %s /instances for %s failed: %s", method, url, exc)
            return False
        if resp.status_code >= 400 and not (method == "DELETE" and resp.status_code == 404):
            logger.error("autoscale: %s /instances for %s answered %d: %s", method, url, resp.status_code,
                         resp.text[:300])
            return False
        return True

    def _wait_ready(self, worker: Worker) -> bool:
        """Until its /health answers 200 (True), it exits, the timeout passes or autoscaling stops (False)."""
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline and worker.proc.poll() is None:
            if healthy(worker.url):
                return True
            if self._stop.wait(0.2):
                return False
        return False
