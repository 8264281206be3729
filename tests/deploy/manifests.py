"""Read deploy/: compose files as Compose interpolates them, Kubernetes manifests, the Dockerfile, and the CLIs."""
from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_GPU, COMPOSE_CPU = DEPLOY / "docker-compose.yml", DEPLOY / "docker-compose.cpu.yml"
INSECURE = DEPLOY / "docker-compose.insecure.yml"
PREFILL_GPU = DEPLOY / "docker-compose.prefill.yml"  # an override of COMPOSE_GPU: compose_doc merges the two
GPU_FILES = (COMPOSE_GPU, PREFILL_GPU)
ENV_EXAMPLE = DEPLOY / ".env.example"

PROGRAM_ROLES = {"epd-encoder": "encoder", "epd-decoder": "decoder", "disagg-epd-proxy": "proxy"}
_COMPOSE_VAR = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")
_K8S_VAR = re.compile(r"\$\((\w+)\)")


# --- compose ---

def env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a Compose .env file (comments and blank lines skipped)."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
            out[key.strip()] = value.strip()
    return out


def compose_vars(path: Path) -> list[tuple[str, str | None, str]]:
    """(name, operator, argument) of every ${...} in a compose file."""
    return [(m[1], m[2], m[3] or "") for m in _COMPOSE_VAR.finditer(path.read_text())]


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}; a required variable left empty
    becomes "required" so the commands that use it can still be parsed."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m[1], m[2], m[3] or ""
        current = env.get(name)
        if op in (":-", "-"):
            return arg if current is None or (op == ":-" and current == "") else current
        if op in (":?", "?"):
            return current or "required"
        return current or ""

    return _COMPOSE_VAR.sub(sub, value)


class ComposeLoader(yaml.SafeLoader):
    """YAML as compose reads it: `!reset VALUE` (an override that replaces instead of merging) is VALUE."""


for _tag in ("!reset", "!override"):  # `!override VALUE`: replaces the base file's value instead of merging with it
    ComposeLoader.add_constructor(_tag, lambda loader, node: (
        loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode)
        else loader.construct_mapping(node) if isinstance(node, yaml.MappingNode) else loader.construct_scalar(node)))


def merged(base: Any, override: Any) -> Any:
    """Compose's merge of an override file as these files use it: mappings merge key by key, anything else (a
    command; a list marked !override) is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: merged(base[k], v) if k in base else v for k, v in override.items()}}
    return override


def with_override(base: Path, override: Path) -> dict[str, Any]:
    """`docker compose -f base -f override`: `extends` resolved (its file relative to the override's folder)."""
    doc, extra = load_compose(base), load_compose(override)
    for name, service in extra["services"].items():
        if (ext := service.pop("extends", None)) is not None:
            service = merged(load_compose(override.parent / ext["file"])["services"][ext["service"]], service)
        extra["services"][name] = service
    return dict(merged(doc, extra))


def load_compose(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.load(path.read_text(), Loader=ComposeLoader)  # noqa: S506 (a SafeLoader subclass)
    return doc


def compose_doc(path: Path) -> dict[str, Any]:
    """A compose file (the prefill override: on top of the GPU file), interpolated with deploy/.env.example (the
    GPU files) or nothing."""
    env = env_file(ENV_EXAMPLE) if path in GPU_FILES else {}
    raw = with_override(COMPOSE_GPU, path) if path == PREFILL_GPU else load_compose(path)
    doc: dict[str, Any] = interpolate(raw, env)
    return doc


def compose(path: Path) -> dict[str, Any]:
    """The services of a compose file, interpolated as compose_doc does."""
    services: dict[str, Any] = compose_doc(path)["services"]
    return services


def role(service: dict[str, Any]) -> str | None:
    """The service's EPD role: its program's, or "prefill" for a decoder started with --role prefill."""
    command = service["command"]
    if command[0] == "epd-decoder" and "--role" in command and command[command.index("--role") + 1] == "prefill":
        return "prefill"
    return PROGRAM_ROLES.get(command[0])


def flag(argv: list[str], name: str) -> list[str]:
    """The values after `name` up to the next flag ([] when absent)."""
    if name not in argv:
        return []
    values = []
    for v in argv[argv.index(name) + 1:]:
        if v.startswith("--"):
            break
        values.append(v)
    return values


def one(argv: list[str], name: str) -> str:
    values = flag(argv, name)
    assert len(values) == 1, f"{name} should have one value in {argv}"
    return values[0]


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname and parts.port, url
    return parts.hostname, parts.port


# --- kubernetes ---

def k8s_objects(*names: str) -> list[dict[str, Any]]:
    files = [K8S / n for n in names] if names else sorted(K8S.glob("*.yaml"))
    return [d for f in files for d in yaml.safe_load_all(f.read_text()) if d]


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in k8s_objects() if o["kind"] == kind}


def deployment_of(component: str) -> dict[str, Any]:
    found = [d for d in by_kind("Deployment").values()
             if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    assert len(found) == 1, f"one Deployment for {component}, found {len(found)}"
    return found[0]


def containers(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def main_container(deployment: dict[str, Any]) -> dict[str, Any]:
    """The container that runs an EPD role (not the registration sidecar)."""
    found = [c for c in containers(deployment).values() if c["command"][0] in PROGRAM_ROLES]
    assert len(found) == 1
    return found[0]


def config_map(name: str, key: str) -> str:
    return str(by_kind("ConfigMap")[name]["data"][key])


def k8s_env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def resolve_k8s_vars(container: dict[str, Any], pod_ip: str = "10.1.2.3") -> list[str]:
    """The container's command with each $(VAR) replaced as the kubelet would (a fake pod IP, ConfigMap values)."""
    env = k8s_env(container)

    def sub(m: re.Match[str]) -> str:
        entry = env.get(m[1])
        assert entry is not None, f"{container['name']}: $({m[1]}) has no env entry: Kubernetes would pass it literally"
        if "value" in entry:
            return str(entry["value"])
        source = entry["valueFrom"]
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "status.podIP"
            return pod_ip
        ref = source["configMapKeyRef"]
        return config_map(ref["name"], ref["key"])

    return [_K8S_VAR.sub(sub, str(a)) for a in [*container["command"], *container.get("args", [])]]


def port_number(container: dict[str, Any], port: str | int) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


# --- the real command-line parsers ---

def deploy_script(path: Path) -> ModuleType:
    """A script under deploy/ (not a package), loaded as a module."""
    spec = importlib.util.spec_from_file_location(f"deploy_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def register_module() -> ModuleType:
    return deploy_script(K8S / "epd_register.py")


def parsers() -> dict[str, Callable[[list[str]], object]]:
    """program -> a function that parses its argv exactly as the program does (SystemExit on a bad flag)."""
    from decoder_service.cli import parse_args as decoder_args
    from encoder_service.cli import parse_args as encoder_args
    from epd_launcher.flags import parse_args as proxy_args
    from epd_planner.cli import parse_args as planner_args

    return {"epd-encoder": encoder_args, "epd-decoder": decoder_args,
            "disagg-epd-proxy": lambda argv: proxy_args(argv)[1], "epd-planner": lambda argv: planner_args(argv)[1],
            "epd-register": lambda argv: register_module().build_parser().parse_args(argv)}


def help_text(program: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        parsers()[program](["--help"])
    return capsys.readouterr().out


def deploy_files() -> Iterator[Path]:
    """Everything under deploy/ a commit would carry (deploy/.env and deploy/secrets/ are the operator's own, never
    committed: .gitignore says so)."""
    for path in sorted(DEPLOY.rglob("*")):
        rel = path.relative_to(DEPLOY)
        if path.is_file() and path.name != ".env" and "__pycache__" not in rel.parts and rel.parts[0] != "secrets":
            yield path


# --- keys, as `epd-ec-keygen env` makes them and compose / Kubernetes hand them over ---

K8S_SECRET_FILES = {"epd-curve": "k8s-curve.env", "epd-keys": "k8s-keys.env"}
SECRETS_MOUNT = "/run/secrets/"


def generated_keys(directory: Path) -> dict[str, dict[str, str]]:
    """A fresh `epd-ec-keygen env DIR`: each k8s-*.env file -> its variables, each compose secret file -> {"": key}."""
    from connector.control.security import write_key_files

    paths = write_key_files(directory)
    return {p.name: env_file(p) if p.suffix == ".env" else {"": p.read_text().strip()} for p in paths}


def compose_secret_files(service: dict[str, Any], top: dict[str, Any]) -> dict[str, str]:
    """EPD_*_FILE variable -> the compose secret it names: each must be mounted into the service, from a file
    under the secrets folder."""
    found = {}
    for var, value in service.get("environment", {}).items():
        if var.endswith("_FILE") and value:
            assert value.startswith(SECRETS_MOUNT), f"{var}={value} is not a mounted secret"
            name = value.removeprefix(SECRETS_MOUNT)
            assert name in service["secrets"], f"{var} names the secret {name}, which is not mounted"
            assert top["secrets"][name]["file"].endswith(f"/{name}"), top["secrets"][name]
            found[var] = name
    return found


def compose_key_env(service: dict[str, Any], top: dict[str, Any], key_dir: Path) -> dict[str, str]:
    """The EPD_*_FILE variables a compose service gets, pointed at the generated key files instead of the mount."""
    return {var: str(key_dir / name) for var, name in compose_secret_files(service, top).items()}


def k8s_secret_env(container: dict[str, Any], keys: dict[str, dict[str, str]]) -> dict[str, str]:
    """The variables a container gets from the Secrets made with `kubectl create secret --from-env-file`."""
    env: dict[str, str] = {}
    for var, entry in k8s_env(container).items():
        ref = entry.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None and ref["name"] in K8S_SECRET_FILES:
            values = keys[K8S_SECRET_FILES[ref["name"]]]
            assert ref["key"] in values or ref.get("optional"), f"{var}: Secret {ref['name']} has no {ref['key']}"
            if ref["key"] in values:
                env[var] = values[ref["key"]]
    return env


# --- the Dockerfile ---

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


def image_uid() -> int:
    """The user both images run as: one USER uid:gid in each final stage, the same in both."""
    users = {target: [a for op, a in stages()[target] if op == "USER"] for target in ("proxy", "worker")}
    assert all(len(u) == 1 for u in users.values()), users
    (uid,) = {int(u[0].split(":")[0]) for u in users.values()}
    return uid


# --- the real command-line parsers ---

WORKERS = ("encoder", "decoder")


def accepted(program: str, argv: list[str], where: str, capsys: pytest.CaptureFixture[str],
             env: dict[str, str] | None = None) -> object:
    with pytest.MonkeyPatch.context() as mp:
        for name, value in (env or {}).items():
            mp.setenv(name, value)
        try:
            return parsers()[program](argv)
        except SystemExit as exc:
            pytest.fail(f"{where}: `{program}` refuses {argv}: {capsys.readouterr().err.strip()} (exit {exc.code})")
