"""deploy/monitoring/: the metric names the Grafana dashboard queries, and the names a /metrics text exports."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
DASHBOARD, PROMETHEUS = MONITORING / "grafana-dashboard.json", MONITORING / "prometheus.yml"
_NAME = re.compile(r"\b(epd_[a-z0-9_]+)")


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def dashboard_metrics() -> set[str]:
    """Every epd_* series name in the dashboard's PromQL expressions."""
    return {name for panel in dashboard()["panels"] for target in panel["targets"]
            for name in _NAME.findall(target["expr"])}


def exported_names(text: str) -> set[str]:
    """The series names a Prometheus text page has: its samples' names and its families' (a labelled counter with no
    sample yet is still a family), a histogram's `_bucket`, `_sum` and `_count` included."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            names.add(family)
            if kind == "histogram":
                names |= {f"{family}_bucket", f"{family}_sum", f"{family}_count"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names
