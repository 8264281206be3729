"""deploy/: the compose files, the Kubernetes manifests and the Dockerfile agree with each other and with the
real command-line parsers, and nothing secret is committed."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
import zmq

from tests.deploy.manifests import (
    COMPOSE_CPU,
    COMPOSE_GPU,
    DEPLOY,
    ENV_EXAMPLE,
    INSECURE,
    K8S,
    ROOT,
    by_kind,
    compose,
    compose_doc,
    compose_key_env,
    compose_secret_files,
    compose_vars,
    config_map,
    containers,
    deploy_files,
    deployment_of,
    env_file,
    flag,
    generated_keys,
    help_text,
    host_port,
    k8s_env,
    k8s_objects,
    k8s_secret_env,
    load_compose,
    main_container,
    one,
    parsers,
    port_number,
    resolve_k8s_vars,
    role,
)

COMPOSE_FILES = pytest.mark.parametrize("path", [COMPOSE_GPU, COMPOSE_CPU], ids=["gpu", "cpu"])
WORKERS = ("encoder", "decoder")


@pytest.fixture(autouse=True)
def no_epd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parsers read EPD_* defaults (keys, CURVE) from the environment; test them as a fresh shell would."""
    for name in ("EPD_API_KEY", "EPD_INTERNAL_KEY", "EPD_PROXY_URL", "EPD_EC_CURVE_SECRET_KEY",
                 "EPD_EC_CURVE_SERVER_KEY", "EPD_EC_CURVE_ALLOWED_CLIENTS", "EPD_INSECURE"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(f"{name}_FILE", raising=False)


@pytest.fixture(scope="module")
def key_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:  # a fresh `epd-ec-keygen env DIR`
    directory = tmp_path_factory.mktemp("keys") / "secrets"
    generated_keys(directory)
    return directory


@pytest.fixture(scope="module")
def keys(key_dir: Path) -> dict[str, dict[str, str]]:  # its files, parsed
    from tests.deploy.manifests import env_file

    return {p.name: env_file(p) if p.suffix == ".env" else {"": p.read_text().strip()} for p in key_dir.iterdir()}


def accepted(program: str, argv: list[str], where: str, capsys: pytest.CaptureFixture[str],
             env: dict[str, str] | None = None) -> object:
    with pytest.MonkeyPatch.context() as mp:
        for name, value in (env or {}).items():
            mp.setenv(name, value)
        try:
            return parsers()[program](argv)
        except SystemExit as exc:
            pytest.fail(f"{where}: `{program}` refuses {argv}: {capsys.readouterr().err.strip()} (exit {exc.code})")


# --- docker compose ---

@COMPOSE_FILES
def test_compose_runs_every_role_and_the_proxy_points_at_each_worker(path: Path) -> None:
    services = compose(path)
    by_role = {r: {n: s for n, s in services.items() if role(s) == r} for r in ("encoder", "decoder", "proxy")}
    assert len(by_role["proxy"]) == 1 and by_role["encoder"] and by_role["decoder"]
    (proxy,) = by_role["proxy"].values()
    for r, url_flag in (("encoder", "--encode-servers-urls"), ("decoder", "--decode-servers-urls")):
        expected = [f"http://{name}:{one(s['command'], '--port')}" for name, s in by_role[r].items()]
        assert flag(proxy["command"], url_flag) == expected
        for s in by_role[r].values():
            assert one(s["command"], "--host") == "0.0.0.0"  # reachable from the proxy's container
    assert set(proxy["depends_on"]) == set(by_role["encoder"]) | set(by_role["decoder"])
    assert all(d["condition"] == "service_healthy" for d in proxy["depends_on"].values())
    published = [p.rsplit(":", 1) for p in proxy["ports"]]
    assert [target for _, target in published] == [one(proxy["command"], "--port")]


@COMPOSE_FILES
def test_compose_encoders_advertise_a_name_other_containers_resolve(path: Path) -> None:
    for name, s in compose(path).items():
        if role(s) == "encoder":
            bind = one(s["command"], "--ec-bind")
            assert urlsplit(bind).hostname == "0.0.0.0", bind
            assert one(s["command"], "--ec-advertise-host") == name  # the service name is its DNS name


@COMPOSE_FILES
def test_compose_health_checks_hit_each_services_own_port_and_services_restart(path: Path) -> None:
    for name, s in compose(path).items():
        test = " ".join(s["healthcheck"]["test"])
        assert f"http://127.0.0.1:{one(s['command'], '--port')}/health" in test, name
        assert s["restart"] in ("always", "unless-stopped", "on-failure"), name
        # the images `make images` builds (deploy/Dockerfile's two targets); compose never builds
        image = "epd-proxy:" if role(s) == "proxy" else "epd-worker:"
        assert s["image"].startswith(image) and "build" not in s, name
        assert s["networks"] == ["epd"] and s["init"] is True, name


def test_gpu_compose_gives_each_worker_its_own_gpu() -> None:
    gpus = []
    for name, s in compose(COMPOSE_GPU).items():
        reservations = s.get("deploy", {}).get("resources", {}).get("reservations", {})
        if role(s) == "proxy":
            assert not reservations, "the proxy needs no GPU"
            continue
        (device,) = reservations["devices"]
        assert "gpu" in device["capabilities"] and len(device["device_ids"]) == 1, name
        gpus.append(device["device_ids"][0])
        # the container sees only its reserved GPU, as device 0
        assert s["environment"]["CUDA_VISIBLE_DEVICES"] == "0", name
        assert any(v.endswith(":/models") for v in s["volumes"]), f"{name} mounts no shared model volume"
    assert len(gpus) == len(set(gpus)), f"two workers share a GPU: {gpus}"


def test_cpu_compose_runs_the_demo_model_with_no_gpu_and_no_env_file() -> None:
    for name, s in compose(COMPOSE_CPU).items():
        assert "deploy" not in s, f"{name} reserves devices"
        if role(s) != "proxy":
            assert one(s["command"], "--model") == "demo" and s["image"] == "epd-worker:cpu"
    # every variable has a default, so `docker compose up` needs no .env
    assert all(op in (":-", "-") for _, op, _ in compose_vars(COMPOSE_CPU))


def test_env_example_defines_exactly_what_the_gpu_compose_reads() -> None:
    example = env_file(ENV_EXAMPLE)
    used = {name for name, _, _ in compose_vars(COMPOSE_GPU)}
    assert used - set(example) == set(), "compose reads variables .env.example does not define"
    assert set(example) - used == set(), ".env.example defines variables compose never reads"
    required = {name for name, op, _ in compose_vars(COMPOSE_GPU) if op in (":?", "?")}
    assert required == set()  # no key in .env: they are secrets (test_compose_workers_are_secure_by_default...)
    assert not {"EPD_API_KEY", "EPD_INTERNAL_KEY"} & set(example) and "EPD_INSECURE" not in COMPOSE_GPU.read_text()


@COMPOSE_FILES
def test_compose_commands_are_accepted_by_the_real_parsers(path: Path, capsys: pytest.CaptureFixture[str],
                                                           key_dir: Path) -> None:
    doc = compose_doc(path)
    for name, s in doc["services"].items():
        accepted(s["command"][0], s["command"][1:], f"{path.name}:{name}", capsys, compose_key_env(s, doc, key_dir))


# which secret each role mounts, and the variable that reads it
SECRETS_OF = {
    "encoder": {"EPD_INTERNAL_KEY_FILE": "internal_key", "EPD_EC_CURVE_SECRET_KEY_FILE": "encoders_secret_key",
                "EPD_EC_CURVE_ALLOWED_CLIENTS_FILE": "clients_public_key"},
    "decoder": {"EPD_INTERNAL_KEY_FILE": "internal_key", "EPD_EC_CURVE_SECRET_KEY_FILE": "clients_secret_key",
                "EPD_EC_CURVE_SERVER_KEY_FILE": "encoders_public_key"},
}
SECRETS_OF["proxy"] = SECRETS_OF["decoder"]


@COMPOSE_FILES
def test_compose_workers_are_secure_by_default_with_the_generated_keys(path: Path, key_dir: Path,
                                                                       keys: dict[str, dict[str, str]]) -> None:
    doc = compose_doc(path)
    for name, s in doc["services"].items():
        r = role(s)
        assert r is not None
        files = compose_secret_files(s, doc)
        api_key = {"EPD_API_KEY_FILE": "api_key"} if path == COMPOSE_GPU and r == "proxy" else {}
        assert files == {**SECRETS_OF[r], **api_key}, name  # each role mounts only the keys it needs
        assert set(s["secrets"]) == set(files.values()), f"{name} mounts a secret it never reads"
        # no other key variable, but the CPU proxy's EPD_API_KEY, which passes the shell's on (empty when unset)
        other_keys = {k: v for k, v in s.get("environment", {}).items() if "KEY" in k and k not in files}
        assert other_keys in ({}, {"EPD_API_KEY": ""}), name
        assert "EPD_INSECURE" not in s.get("environment", {}) and "--insecure" not in s["command"]
        if r == "proxy":
            continue
        with pytest.raises(SystemExit):  # without the key files: refuses to start
            parsers()[s["command"][0]](s["command"][1:])
        with pytest.MonkeyPatch.context() as mp:
            for var, value in compose_key_env(s, doc, key_dir).items():
                mp.setenv(var, value)
            cfg: Any = parsers()[s["command"][0]](s["command"][1:])
        assert not cfg.insecure and cfg.internal_key == keys["internal_key"][""] and cfg.curve is not None, name
        if r == "encoder":  # only the clients' key gets in
            assert cfg.curve.allowed_clients == {keys["clients_public_key"][""].encode()}
            assert cfg.curve.public_key == zmq.curve_public(keys["encoders_secret_key"][""].encode())
        else:
            assert cfg.curve.server_key == keys["encoders_public_key"][""].encode()
            assert cfg.curve.public_key == keys["clients_public_key"][""].encode()


def test_gpu_compose_proxy_requires_the_generated_api_key(capsys: pytest.CaptureFixture[str], key_dir: Path,
                                                          keys: dict[str, dict[str, str]]) -> None:
    doc = compose_doc(COMPOSE_GPU)
    proxy = doc["services"]["proxy"]
    env = compose_key_env(proxy, doc, key_dir)
    args: Any = accepted(proxy["command"][0], proxy["command"][1:], "proxy", capsys, env)
    assert args.api_key == keys["api_key"][""] and len(args.api_key) >= 40


def test_insecure_override_runs_every_service_open_and_mounts_no_secret(capsys: pytest.CaptureFixture[str]) -> None:
    """deploy/docker-compose.insecure.yml on top of the CPU file: what compose merges (services' environment maps
    merge, the override's empty `secrets` list replaces through !reset) starts every worker without keys."""
    override = load_compose(INSECURE)["services"]
    services = compose(COMPOSE_CPU)
    assert set(override) == set(services)
    for name, s in services.items():
        env = {**s.get("environment", {}), **override[name]["environment"]}
        assert env["EPD_INSECURE"] == "1" and override[name]["secrets"] == []
        assert all(v == "" for k, v in env.items() if k.endswith("_FILE")), name
        if role(s) == "proxy":
            continue
        cfg: Any = accepted(s["command"][0], s["command"][1:], name, capsys,
                            {k: v for k, v in env.items() if k.startswith("EPD_")})
        assert cfg.insecure and cfg.internal_key is None and cfg.curve is None, name
    assert "!reset" in INSECURE.read_text()  # a plain `secrets: []` would merge with, not replace, the base list


@COMPOSE_FILES
def test_compose_sets_only_epd_variables_its_programs_read(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, s in compose(path).items():
        doc = help_text(s["command"][0], capsys)
        for var in s.get("environment", {}):
            if var.startswith("EPD_"):
                assert var in doc, f"{path.name}:{name} sets {var}, which `{s['command'][0]} --help` never names"


# --- kubernetes ---

def test_k8s_has_a_deployment_and_a_service_for_every_role() -> None:
    services = by_kind("Service").values()
    for component in (*WORKERS, "proxy"):
        d = deployment_of(component)
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert main_container(d)["command"][0] == {"proxy": "disagg-epd-proxy"}.get(component, f"epd-{component}")
        selecting = [s for s in services if s["spec"]["selector"].items() <= labels.items()]
        assert selecting, f"no Service selects the {component} pods"
        ports = {p["name"]: p["containerPort"] for p in main_container(d)["ports"]}
        for s in selecting:
            for p in s["spec"]["ports"]:
                assert p["targetPort"] in ports, f"Service {s['metadata']['name']} targets a port the pod lacks"
        pod = d["spec"]["template"]["spec"]["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == IMAGE_UID


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
    for component in WORKERS:
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


def test_k8s_workers_each_get_one_gpu_and_the_shared_model_volume() -> None:
    claims = by_kind("PersistentVolumeClaim")
    for component in WORKERS:
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


def test_kustomization_lists_every_manifest_but_the_optional_hpa() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "encoder-hpa.yaml"}
    assert set(kustomization["resources"]) == manifests
    assert [i["name"] for i in kustomization["images"]] == ["epd-worker", "epd-proxy"]
    for component in (*WORKERS, "proxy"):  # the torch-free image for the proxy, the worker image (and its sidecar)
        images = {c["image"] for c in containers(deployment_of(component)).values()}
        assert images == {"epd-proxy" if component == "proxy" else "epd-worker"}, component


# --- the image ---

def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions (FROM ... AS name)."""
    found: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for op, args in dockerfile():
        if op == "FROM":
            current = found.setdefault(args.split()[-1], [])
        current.append((op, args))
    return found


IMAGE_UID = 10001


def test_dockerfile_images_run_as_a_numeric_non_root_user() -> None:
    for target in ("proxy", "worker"):
        (user,) = [args for op, args in stages()[target] if op == "USER"]
        assert int(user.split(":")[0]) == IMAGE_UID  # numeric, so Kubernetes' runAsNonRoot can verify it


def test_dockerfile_installs_only_from_the_wheelhouse_and_checks_every_hash() -> None:
    args = dict(a.split("=", 1) for op, a in dockerfile() if op == "ARG" and "=" in a)
    assert args["BASE_IMAGE"].startswith("python:3.11-")  # the locks are for CPython 3.11
    assert dockerfile()[1] == ("FROM", "${BASE_IMAGE} AS base")
    assert [a for op, a in dockerfile() if op == "FROM"][1:] == ["base AS install", "base AS proxy", "base AS worker"]
    runs = [a for op, a in dockerfile() if op == "RUN"]
    installs = [r for r in runs if " install " in r]
    assert installs and all("--no-index" in r for r in installs)
    assert any("--require-hashes -r /wheels/requirements.txt" in r for r in installs)
    assert not re.search(r"https?://|apt-get|--index-url|--extra-index-url", " ".join(runs))  # offline
    assert not any("torchvision" in a for op, a in dockerfile())  # comments dropped: only instructions
    # the images copy the installed environment only: no wheels, no pip
    for target in ("proxy", "worker"):
        assert ("COPY", "--from=install /opt/epd /opt/epd") in stages()[target]
    assert any("pip uninstall --yes --quiet pip" in r for r in runs)
    env = " ".join(a for op, a in dockerfile() if op == "ENV")
    assert "HF_HOME=/models/hf" in env and ("VOLUME", '["/models"]') in stages()["worker"]


def test_the_proxy_image_refuses_to_build_with_torch_transformers_or_numpy_in_it() -> None:
    checks = " ".join(a for op, a in stages()["proxy"] if op == "RUN")
    assert "import epd_launcher.cli, proxy.app" in checks
    assert re.search(r"for m in torch transformers numpy; do ! python -c \"import \$m\"", checks)


def test_dockerfile_copies_what_the_wheelhouse_script_writes() -> None:
    script = (DEPLOY / "tools" / "wheelhouse.sh").read_text()
    copies = [a.split()[0] for op, a in stages()["install"] if op == "COPY"]
    assert copies == ["requirements.txt", "wheels/", "epd/"]
    for written in ('"$OUT/requirements.txt"', '--dest "$OUT/wheels"', '--wheel-dir "$OUT/epd"', '"$OUT/epd/epd-register"'):
        assert written in script, written


# --- secrets ---

_PEM = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")
_ZMQ_CERT = re.compile(r"(public|secret)-key\s*=\s*\"")
_Z85 = r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]"
_Z85_KEY = re.compile(rf"(?<!{_Z85}){_Z85}{{40}}(?!{_Z85})")
_ASSIGNED = re.compile(r"""(?<![{\w])(\w*(?:KEY|TOKEN|SECRET|PASSWORD)\w*)["']?[ \t]*[=:][ \t]*(\S*)""")


def secrets_in(text: str) -> list[str]:
    found = [m[0] for m in _PEM.finditer(text)] + [m[0] for m in _ZMQ_CERT.finditer(text)]
    found += [k for k in _Z85_KEY.findall(text) if re.search(r"[a-z]", k) and re.search(r"[A-Z]", k)]
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))  # not prose
    for name, value in _ASSIGNED.findall(code):
        value = value.strip("'\"")
        if re.fullmatch(f"{_Z85}{{40}}", value):  # a CURVE key, whatever its first character
            found.append(f"{name}={value}")
        # not a variable, a path (EPD_*_FILE names a key, holds none) or an expression (`str(path)`, `""}`)
        elif re.search(r"\w", value) and "(" not in value and not value.startswith(("$", "{", "#", "/", "./")):
            found.append(f"{name}={value}")
    return found


def test_the_secret_scanner_finds_keys() -> None:
    public, secret = zmq.curve_keypair()
    for first in "{$#/(":  # a key may start with any Z85 character
        assert secrets_in(f"EPD_EC_CURVE_SECRET_KEY={first}{secret.decode()[1:]}")
    assert secrets_in(f"EPD_EC_CURVE_SECRET_KEY={secret.decode()}")
    assert secrets_in(f'    secret-key = "{secret.decode()}"') and secrets_in(f"server: {public.decode()}")
    assert secrets_in("-----BEGIN OPENSSH PRIVATE KEY-----") and secrets_in("EPD_API_KEY=sk-abc123")
    assert secrets_in("      EPD_INTERNAL_KEY: hunter2") and secrets_in('{"HF_TOKEN": "hf_abc"}')
    assert not secrets_in("EPD_API_KEY=\n  EPD_INTERNAL_KEY: ${EPD_INTERNAL_KEY:?set it}\n")
    assert not secrets_in("  EPD_INTERNAL_KEY_FILE: /run/secrets/internal_key\n  env = {'EPD_API_KEY': str(path)}")


def test_nothing_under_deploy_looks_like_a_committed_secret() -> None:
    found = {str(p.relative_to(ROOT)): secrets_in(p.read_text()) for p in deploy_files()}
    assert {p: s for p, s in found.items() if s} == {}
    named_like_keys = {k: v for k, v in env_file(ENV_EXAMPLE).items() if re.search(r"KEY|TOKEN|SECRET", k)}
    assert named_like_keys == {"HF_TOKEN": "", "EPD_SECRETS_DIR": "./secrets"}  # a folder, not a key
