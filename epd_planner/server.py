"""The planner's HTTP side (`epd-planner` without --once): GET /metrics with the recommended and current replicas
per role, for an autoscaler to read (deploy/k8s/planner-hpa.yaml), and GET /health; the planning loop runs on a
thread of its own for the app's lifetime.

No gauge is exported before the first whole window: an autoscaler that finds no value does nothing, where a made-up
value would move it."""
from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from epd_common.http import install_metrics
from epd_planner.planner import Planner
from epd_planner.sample import ROLES


class PlannerGauges:
    """The latest step, read at scrape time."""

    def __init__(self, planner: Planner) -> None:
        self.planner = planner

    def collect(self) -> Iterator[Metric]:
        done, windows = self.planner.latest()
        yield GaugeMetricFamily("epd_planner_windows", "Windows decided since the planner started", value=windows)
        if done is None:
            return
        desired = GaugeMetricFamily("epd_planner_desired_replicas", "Replicas the planner recommends, after its "
                                    "hysteresis (what an autoscaler should set); absent for a role whose last window "
                                    "could not be read", labels=["role"])
        current = GaugeMetricFamily("epd_planner_current_replicas", "Workers the proxy lists", labels=["role"])
        util = GaugeMetricFamily("epd_planner_utilization", "Mean busy share of a worker in the last window (absent "
                                 "when it could not be read)", labels=["role"])
        unreadable = GaugeMetricFamily("epd_planner_unreadable", "1 when the last window could not be read for the "
                                       "role (its count was kept)", labels=["role"])
        for role in ROLES:
            plan = done.decision.plans[role]
            if plan.readable:  # an autoscaler that finds no value holds; a kept count could be a guessed one
                desired.add_metric([role], done.recommended[role])
            current.add_metric([role], plan.current)
            unreadable.add_metric([role], 0 if plan.readable else 1)
            if plan.utilization is not None:
                util.add_metric([role], plan.utilization)
        yield from (desired, current, util, unreadable)


def create_app(planner: Planner) -> FastAPI:
    """The app; its lifespan runs `planner.run` on a thread and stops it on shutdown."""
    registry = CollectorRegistry()
    registry.register(PlannerGauges(planner))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = threading.Event()
        thread = threading.Thread(target=planner.run, args=(stop,), name="planner", daemon=True)
        thread.start()
        yield
        stop.set()
        thread.join(timeout=planner.cfg.timeout * 4 + 5)

    app = FastAPI(title="epd-planner", lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        done, windows = planner.latest()
        body: dict[str, Any] = {"status": "ok", "role": "planner", "windows": windows}
        if done is not None:  # counts only: the reasons name workers' URLs (what /instances guards); the log has them
            body["desired"], body["current"] = done.recommended, done.decision.current
        return body

    install_metrics(app, registry)
    return app
