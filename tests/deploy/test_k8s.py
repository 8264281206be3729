"""deploy/k8s/: a Deployment and Service per role, probes, registration, GPUs, commands accepted by the real
parsers, keys only from Secrets, the HPA's metric, and the kustomization's images."""
from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.deploy.manifests import (
    K8S,
    WORKERS,
    accepted,
    by_kind,
    config_map,
    containers,
    deployment_of,
    help_text,
    host_port,
    image_uid,
    k8s_env,
    k8s_objects,
    k8s_secret_env,
    main_container,
    one,
    port_number,
    resolve_k8s_vars,
    role,
)


def test_k8s_has_a_deployment_and_a_service_for_every_role() -> None:
    services = by_kind("Service").values()
    for component in (*WORKERS, "prefill", "proxy"):
        d = deployment_of(component)
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
        program = {"proxy": "disagg-epd-proxy", "prefill": "epd-decoder"}.get(component, f"epd-{component}")
        assert main_container(d)["command"][0] == program
        selecting = [s for s in services if s["spec"]["selector"].items() <= labels.items()]
        assert selecting, f"no Service selects the {component} pods"
        ports = {p["name"]: p["containerPort"] for p in main_container(d)["ports"]}
        for s in selecting:
            for p in s["spec"]["ports"]:
                assert p["targetPort"] in ports, f"Service {s['metadata']['name']} targets a port the pod lacks"
        pod = d["spec"]["template"]["spec"]["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == image_uid()


def test_k8s_probes_hit_health_on_the_port_each_role_serves() -> None:
    for component in (*WORKERS, "proxy"):
        c = main_container(deployment_of(component))
        port = int(one(resolve_k8s_vars(c), "--port"))
        assert one(resolve_k8s_vars(c), "--host") == "0.0.0.0"
        for probe in ("readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            # the proxy's readiness is /ready (503 while no decoder can take work); liveness stays /health
            path = "/ready" if (component, probe) == ("proxy", "readinessProbe") else "/health"
            assert get["path"] == path and port_number(c, get["port"]) == port, f"{component} {probe}"
        if "startupProbe" in c:
            assert c["startupProbe"]["httpGet"]["path"] == "/health"


def test_k8s_workers_register_their_pod_ip_with_every_proxy() -> None:
    proxy = main_container(deployment_of("proxy"))
    assert "--dynamic-registration" in proxy["command"]
    key_ref = k8s_env(proxy)["EPD_INTERNAL_KEY"]["valueFrom"]["secretKeyRef"]
    # the registration address is a headless Service of the proxies that lists them before they are ready
    proxy_url = config_map("epd-config", "proxy-url")
    host, port = host_port(proxy_url)
    headless = by_kind("Service")[host]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert headless["selector"].items() <= deployment_of("proxy")["spec"]["template"]["metadata"]["labels"].items()
    assert [port_number(proxy, p["targetPort"]) for p in headless["ports"]] == [port]
    assert port == int(one(proxy["command"], "--port"))
    for component in (*WORKERS, "prefill"):
        d = deployment_of(component)
        worker, sidecar = main_container(d), containers(d)["register"]
        self_url = f"http://10.1.2.3:{one(resolve_k8s_vars(worker), '--port')}"
        argv = resolve_k8s_vars(sidecar)
        assert argv[0] == "epd-register" and one(argv, "--role") == component and one(argv, "--url") == self_url
        for c in (worker, sidecar):  # the preStop hook runs in the worker's container
            env = k8s_env(c)
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert env["EPD_PROXY_URL"]["valueFrom"]["configMapKeyRef"] == {"name": "epd-config", "key": "proxy-url"}
            assert env["EPD_INTERNAL_KEY"]["valueFrom"]["secretKeyRef"] == key_ref
        hook = worker["lifecycle"]["preStop"]["exec"]["command"][-1]
        assert hook == f'epd-register deregister --role {component} --url "http://$POD_IP:{self_url.rsplit(":", 1)[1]}"'


def test_k8s_encoders_advertise_their_pod_ip_on_the_ports_they_expose() -> None:
    c = main_container(deployment_of("encoder"))
    argv = resolve_k8s_vars(c, pod_ip="10.1.2.3")
    bind = urlsplit(one(argv, "--ec-bind"))
    assert bind.hostname == "0.0.0.0" and one(argv, "--ec-advertise-host") == "10.1.2.3"
    assert port_number(c, "ec") == bind.port and port_number(c, "ec-events") == bind.port + 1  # events: port + 1


def test_k8s_prefill_workers_serve_their_kv_on_their_pod_ip_to_the_decoders() -> None:
    """E -> P -> D: a prefill worker binds its K/V endpoint on every interface, advertises its pod IP on the port its
    pod and Service expose, and holds the decoders' CURVE keys (its K/V server admits only that key pair)."""
    c = main_container(deployment_of("prefill"))
    argv = resolve_k8s_vars(c, pod_ip="10.1.2.3")
    assert one(argv, "--role") == "prefill"
    bind = urlsplit(one(argv, "--kv-bind"))
    assert bind.hostname == "0.0.0.0" and one(argv, "--kv-advertise-host") == "10.1.2.3"
    assert port_number(c, "kv") == bind.port
    decoder = k8s_env(main_container(deployment_of("decoder")))
    for var in ("EPD_EC_CURVE_SECRET_KEY", "EPD_EC_CURVE_SERVER_KEY"):
        assert k8s_env(c)[var] == decoder[var]


def test_k8s_workers_each_get_one_gpu_and_the_shared_model_volume() -> None:
    claims = by_kind("PersistentVolumeClaim")
    for component in (*WORKERS, "prefill"):
        d = deployment_of(component)
        c = main_container(d)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert [m["mountPath"] for m in c["volumeMounts"]] == ["/models"]
        (volume,) = d["spec"]["template"]["spec"]["volumes"]
        assert volume["persistentVolumeClaim"]["claimName"] in claims
    assert "nvidia.com/gpu" not in main_container(deployment_of("proxy"))["resources"].get("limits", {})


def test_k8s_commands_are_accepted_by_the_real_parsers(capsys: pytest.CaptureFixture[str],
                                                       keys: dict[str, dict[str, str]]) -> None:
    for d in by_kind("Deployment").values():
        for name, c in containers(d).items():
            argv = resolve_k8s_vars(c)
            cfg: Any = accepted(argv[0], argv[1:], f"{d['metadata']['name']}/{name}", capsys, k8s_secret_env(c, keys))
            if role({"command": argv}) in WORKERS:  # secure: the Secrets give each worker what it needs
                assert not cfg.insecure and cfg.internal_key and cfg.curve is not None, name
                assert "EPD_INSECURE" not in k8s_env(c)


def test_k8s_sets_only_epd_variables_its_programs_read(capsys: pytest.CaptureFixture[str]) -> None:
    for d in by_kind("Deployment").values():
        for name, c in containers(d).items():
            programs = [c["command"][0]]
            if "epd-register" in str(c.get("lifecycle", "")):
                programs.append("epd-register")
            docs = " ".join(help_text(p, capsys) for p in programs)
            in_command = " ".join(map(str, c["command"]))
            for var in k8s_env(c):
                if var.startswith("EPD_") and f"$({var})" not in in_command:
                    assert var in docs, f"{d['metadata']['name']}/{name} sets {var}; {programs} never read it"


def test_k8s_keys_come_from_secrets_and_no_secret_is_committed() -> None:
    assert "Secret" not in {o["kind"] for o in k8s_objects()}
    for d in by_kind("Deployment").values():
        for c in containers(d).values():
            for var, entry in k8s_env(c).items():
                if re.search(r"KEY|TOKEN|SECRET|PASSWORD", var):
                    assert "value" not in entry and "secretKeyRef" in entry["valueFrom"], var


def test_k8s_hpa_scales_encoders_on_the_queue_depth_they_export() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from encoder_service.metrics import EncoderMetrics

    (hpa,) = k8s_objects("encoder-hpa.yaml")
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["kind"] == "HorizontalPodAutoscaler"
    target = hpa["spec"]["scaleTargetRef"]
    assert target["kind"] == "Deployment" and target["name"] == deployment_of("encoder")["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "epd_encoder_queue_depth"
    registry = CollectorRegistry()
    EncoderMetrics(registry, dict)
    assert "\nepd_encoder_queue_depth 0.0\n" in generate_latest(registry).decode()


def test_kustomization_lists_every_manifest_but_the_optional_hpas_and_prefill_workers() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    optional = {"kustomization.yaml", "encoder-hpa.yaml", "planner-hpa.yaml", "prefill.yaml"}
    manifests = {p.name for p in K8S.glob("*.yaml")} - optional
    assert set(kustomization["resources"]) == manifests
    assert [i["name"] for i in kustomization["images"]] == ["epd-worker", "epd-proxy"]
    for component in (*WORKERS, "prefill", "proxy", "planner"):  # the torch-free image: proxy and planner
        images = {c["image"] for c in containers(deployment_of(component)).values()}
        assert images == {"epd-proxy" if component in ("proxy", "planner") else "epd-worker"}, component


def test_k8s_planner_reads_every_proxy_pod_and_the_hpas_scale_on_its_gauge(capsys: pytest.CaptureFixture[str],
                                                                         keys: dict[str, dict[str, str]]) -> None:
    """planner.yaml runs epd-planner against the proxies' headless Service with the internal key; planner-hpa.yaml
    scales the encoder and decoder Deployments on its gauge, one replica per unit, within the planner's bounds."""
    from epd_planner.planner import Planner, PlannerConfig
    from epd_planner.sample import read_trace
    from epd_planner.server import PlannerGauges

    planner = deployment_of("planner")
    (c,) = containers(planner).values()
    argv = resolve_k8s_vars(c)
    cfg: Any = accepted(argv[0], argv[1:], "epd-planner", capsys, k8s_secret_env(c, keys))
    assert cfg.proxy_url == config_map("epd-config", "proxy-url") and cfg.all_addresses and cfg.internal_key
    assert planner["spec"]["replicas"] == 1  # its hysteresis is state
    port = int(one(argv, "--port"))
    assert one(argv, "--host") == "0.0.0.0" and port_number(c, "http") == port
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    service = by_kind("Service")["epd-planner"]["spec"]
    assert service["selector"].items() <= planner["spec"]["template"]["metadata"]["labels"].items()
    hpas = {h["spec"]["scaleTargetRef"]["name"]: h for h in k8s_objects("planner-hpa.yaml")}
    assert set(hpas) == {deployment_of(r)["metadata"]["name"] for r in WORKERS}
    for worker in WORKERS:
        hpa = hpas[deployment_of(worker)["metadata"]["name"]]
        assert hpa["apiVersion"] == "autoscaling/v2" and hpa["metadata"]["name"] == f"epd-{worker}"
        (metric,) = hpa["spec"]["metrics"]
        external = metric["external"]
        assert metric["type"] == "External" and external["metric"]["name"] == "epd_planner_desired_replicas"
        assert external["metric"]["selector"] == {"matchLabels": {"role": worker}}
        assert external["target"] == {"type": "AverageValue", "averageValue": "1"}  # replicas = the gauge
        bounds = cfg.bounds
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (bounds.low(worker), bounds.high(worker))
    # the gauge as the planner exports it: a window of a recorded trace decided, a sample per role
    samples = iter(read_trace((K8S.parents[1] / "tests/data/planner/light.jsonl").read_text()))
    planner = Planner(PlannerConfig(), read=lambda: next(samples))
    planner.step(), planner.step()
    (desired,) = [m for m in PlannerGauges(planner).collect() if m.name == "epd_planner_desired_replicas"]
    assert {s.labels["role"] for s in desired.samples} >= set(WORKERS)
