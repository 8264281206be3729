"""deploy/monitoring/: the Grafana dashboard's panels each query something, every metric they name is one the code
defines (tests/e2e/test_launcher.py checks them against a live stack's /metrics), and the Prometheus configuration
scrapes every service of the CPU compose file at its own port."""
from __future__ import annotations

import yaml

from tests.deploy.manifests import COMPOSE_CPU, compose, one, role
from tests.deploy.monitoring import PROMETHEUS, dashboard, dashboard_metrics, exported_names


def test_each_panel_queries_prometheus_through_the_dashboards_data_source() -> None:
    doc = dashboard()
    assert doc["uid"] and [v["name"] for v in doc["templating"]["list"]] == ["datasource"]
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for panel in doc["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        assert all(t["expr"].strip() and "epd_" in t["expr"] for t in panel["targets"]), panel["title"]


def test_the_dashboard_names_only_metrics_the_code_defines() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from decoder_service.metrics import DecoderMetrics
    from encoder_service.metrics import EncoderMetrics
    from proxy.metrics import ProxyMetrics

    texts = []
    for make in (ProxyMetrics, EncoderMetrics, DecoderMetrics):
        registry = CollectorRegistry()
        try:
            make(registry)  # type: ignore[call-arg]
        except TypeError:
            continue  # needs its service's stats: checked live in tests/e2e/test_launcher.py
        texts.append(generate_latest(registry).decode())
    defined = {name for text in texts for name in exported_names(text)}
    proxy_names = {n for n in dashboard_metrics() if n.startswith("epd_proxy_")}
    assert proxy_names and not proxy_names - defined, sorted(proxy_names - defined)


def test_prometheus_scrapes_every_service_of_the_cpu_compose_file_at_its_port() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = {t for job in config["scrape_configs"] for static in job["static_configs"] for t in static["targets"]}
    services = compose(COMPOSE_CPU)
    assert targets == {f"{name}:{one(s['command'], '--port')}" for name, s in services.items() if role(s)}
