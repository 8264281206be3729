"""deploy/requirements/: the locks the images install from are current with pyproject.toml, pin every package with
hashes, satisfy pyproject's ranges, and keep the proxy's lock free of torch, transformers and numpy."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.deploy.manifests import deploy_script

ROOT = Path(__file__).resolve().parents[2]
REQS = ROOT / "deploy" / "requirements"
LOCKS = ("proxy", "worker-cpu", "worker-cuda")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+) \\$")


def lock_module() -> ModuleType:
    return deploy_script(ROOT / "deploy" / "lock.py")


def pins(name: str) -> dict[str, tuple[Version, list[str]]]:
    """package -> (pinned version, its hashes) of deploy/requirements/NAME.txt."""
    found: dict[str, tuple[Version, list[str]]] = {}
    current: list[str] = []
    for line in (REQS / f"{name}.txt").read_text().splitlines():
        if m := _PIN.match(line):
            current = []
            found[canonicalize_name(m[1])] = (Version(m[2]), current)
        elif line.strip().startswith("--hash=sha256:"):
            current.append(line.strip().removeprefix("--hash=sha256:").rstrip(" \\"))
        else:
            assert not line or line.lstrip().startswith("#"), f"{name}.txt: unexpected line {line!r}"
    return found


def project_requirements() -> list[Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [Requirement(d) for d in deps]


@pytest.mark.parametrize("name", LOCKS)
def test_each_lock_was_made_from_the_current_pyproject(name: str) -> None:
    """`make lock` writes NAME.in from pyproject.toml: a dependency changed there without re-locking fails here."""
    written = [ln for ln in (REQS / f"{name}.in").read_text().splitlines() if ln and not ln.startswith("#")]
    assert written == lock_module().inputs()[name], "pyproject.toml changed: run `make lock`"


@pytest.mark.parametrize("name", LOCKS)
def test_every_pin_is_exact_hashed_and_within_pyprojects_range(name: str) -> None:
    locked = pins(name)
    assert locked and all(len(hashes) >= 1 and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes)
                          for _, hashes in locked.values())
    excluded = lock_module().PROXY_EXCLUDES if name == "proxy" else set()
    for req in project_requirements():
        if canonicalize_name(req.name) in excluded or (req.marker and not req.marker.evaluate(
                {"sys_platform": "linux", "python_version": "3.11", "platform_machine": "x86_64"})):
            continue
        assert canonicalize_name(req.name) in locked, f"{name}.txt does not pin {req.name}"
        version = locked[canonicalize_name(req.name)][0]
        assert req.specifier.contains(version, prereleases=True), f"{name}.txt: {req.name}=={version} not in {req}"
    assert "pip" in locked  # the image build runs this pip from its wheel


@pytest.mark.parametrize("name", LOCKS)
def test_every_image_carries_the_tracing_extra(name: str) -> None:
    """--otlp-traces-endpoint works in the images: the SDK and the OTLP exporter are pinned, as pyproject's
    `tracing` extra asks."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["tracing"]
    locked = pins(name)
    for req in map(Requirement, extra):
        assert canonicalize_name(req.name) in locked, f"{name}.txt does not pin {req.name}"
        assert req.specifier.contains(locked[canonicalize_name(req.name)][0], prereleases=True)


def test_the_proxy_lock_has_no_torch_transformers_or_numpy_even_indirectly() -> None:
    proxy, worker = pins("proxy"), pins("worker-cpu")
    assert not {"torch", "transformers", "numpy", "tokenizers", "safetensors", "triton"} & set(proxy)
    assert not [p for p in proxy if p.startswith("nvidia-")]
    for package, (version, _) in proxy.items():  # one resolution: the images agree on every shared package
        assert package not in worker or worker[package][0] == version, package


def test_the_torch_of_each_worker_lock_is_the_build_it_names() -> None:
    cpu, cuda = pins("worker-cpu")["torch"][0], pins("worker-cuda")["torch"][0]
    assert cpu.local == "cpu" and cuda.local is None and cpu.public == cuda.public
    assert not [p for p in pins("worker-cpu") if p.startswith("nvidia-")]
    assert [p for p in pins("worker-cuda") if p.startswith("nvidia-")]  # PyPI's torch brings its CUDA libraries
