"""deploy/docker-compose*.yml: every role wired to the others, each service's command accepted by the real parser,
keys mounted as secrets (each role only its own), and the insecure override open only by choice."""
from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import zmq

from tests.deploy.manifests import (
    COMPOSE_CPU,
    COMPOSE_GPU,
    ENV_EXAMPLE,
    INSECURE,
    PREFILL_GPU,
    accepted,
    compose,
    compose_doc,
    compose_key_env,
    compose_secret_files,
    compose_vars,
    env_file,
    flag,
    help_text,
    load_compose,
    one,
    parsers,
    role,
)

COMPOSE_FILES = pytest.mark.parametrize("path", [COMPOSE_GPU, PREFILL_GPU, COMPOSE_CPU],
                                        ids=["gpu", "gpu+prefill", "cpu"])


@COMPOSE_FILES
def test_compose_runs_every_role_and_the_proxy_points_at_each_worker(path: Path) -> None:
    services = compose(path)
    by_role = {r: {n: s for n, s in services.items() if role(s) == r}
               for r in ("encoder", "decoder", "prefill", "proxy")}
    assert len(by_role["proxy"]) == 1 and by_role["encoder"] and by_role["decoder"]
    (proxy,) = by_role["proxy"].values()
    for r, url_flag in (("encoder", "--encode-servers-urls"), ("decoder", "--decode-servers-urls"),
                        ("prefill", "--prefill-servers-urls")):  # prefill workers: the CPU file's E -> P -> D
        expected = [f"http://{name}:{one(s['command'], '--port')}" for name, s in by_role[r].items()]
        assert flag(proxy["command"], url_flag) == expected
        for s in by_role[r].values():
            assert one(s["command"], "--host") == "0.0.0.0"  # reachable from the proxy's container
    assert set(proxy["depends_on"]) == set(by_role["encoder"]) | set(by_role["decoder"]) | set(by_role["prefill"])
    assert all(d["condition"] == "service_healthy" for d in proxy["depends_on"].values())
    published = [p.rsplit(":", 1) for p in proxy["ports"]]
    assert [target for _, target in published] == [one(proxy["command"], "--port")]


@COMPOSE_FILES
def test_compose_encoders_advertise_a_name_other_containers_resolve(path: Path) -> None:
    for name, s in compose(path).items():
        binds = {"encoder": ("--ec-bind", "--ec-advertise-host"), "prefill": ("--kv-bind", "--kv-advertise-host")}
        if (r := role(s)) in binds:
            bind_flag, advertise_flag = binds[r]
            bind = one(s["command"], bind_flag)
            assert urlsplit(bind).hostname == "0.0.0.0", bind
            assert one(s["command"], advertise_flag) == name  # the service name is its DNS name


def test_the_cpu_compose_and_the_gpu_override_split_prefill_from_decode() -> None:
    """The laptop stack (and so the smoke test) runs E -> P -> D: a prefill worker the proxy sends requests to; on
    the GPU host the prefill override adds one on its own GPU, the base file's proxy command otherwise unchanged."""
    assert [name for name, s in compose(COMPOSE_CPU).items() if role(s) == "prefill"] == ["prefill-0"]
    split, base = compose(PREFILL_GPU), compose(COMPOSE_GPU)
    assert [name for name, s in split.items() if role(s) == "prefill"] == ["prefill-0"]
    assert split["proxy"]["command"] == [*base["proxy"]["command"], "--prefill-servers-urls", "http://prefill-0:8003"]
    gpus = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for s in split.values() if role(s) != "proxy"]
    assert len(gpus) == len({g[0] for g in gpus}) == 5  # one GPU each, none shared


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
    used = {name for path in (COMPOSE_GPU, PREFILL_GPU) for name, _, _ in compose_vars(path)}
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
SECRETS_OF["proxy"] = SECRETS_OF["prefill"] = SECRETS_OF["decoder"]  # prefill: its K/V server uses the decoders' pair


@COMPOSE_FILES
def test_compose_workers_are_secure_by_default_with_the_generated_keys(path: Path, key_dir: Path,
                                                                       keys: dict[str, dict[str, str]]) -> None:
    doc = compose_doc(path)
    for name, s in doc["services"].items():
        r = role(s)
        assert r is not None
        files = compose_secret_files(s, doc)
        api_key = {"EPD_API_KEY_FILE": "api_key"} if path != COMPOSE_CPU and r == "proxy" else {}
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
