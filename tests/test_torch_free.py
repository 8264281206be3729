"""The proxy, the scheduler, the connector's control plane and the shared packages load neither torch nor
transformers, nor numpy, nor any of our packages the proxy image deletes (deploy/Dockerfile's proxy-install stage:
the image has none of them): they are imported in a fresh interpreter, checking sys.modules after each."""
from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import connector.control
import epd_common
import epd_contracts
import epd_planner

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "numpy")
# what deploy/Dockerfile's proxy-install stage removes from the proxy image (tests/deploy/test_image.py reads it)
NOT_IN_PROXY_IMAGE = ("epd_models", "epd_builders", "epd_bench", "decoder_service", "encoder_service")
# NOTE: the first module that loads torch is reported; the ones after it cannot be told apart, and need not be
CHECK = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
    heavy = sorted(m for m in {heavy!r} if m in sys.modules or any(k.startswith(m + ".") for k in sys.modules))
    if heavy:
        print(json.dumps({{name: heavy}}))
        break
else:
    print(json.dumps({{}}))
"""


def modules_of(package: ModuleType) -> list[str]:
    return [m.name for m in pkgutil.iter_modules(package.__path__, f"{package.__name__}.")]


TORCH_FREE = ["epd_launcher.cli", "proxy.app", "scheduler.scheduler", *modules_of(connector.control), *modules_of(epd_contracts),
              *modules_of(epd_common), *modules_of(epd_planner)]  # the planner runs in the proxy image


def first_heavy_import(modules: list[str]) -> dict[str, list[str]]:
    """{module: heavy modules it loaded} for the first of `modules` that loads torch, transformers or numpy, else
    {}."""
    code = CHECK.format(heavy=HEAVY + NOT_IN_PROXY_IMAGE)
    run = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


def test_proxy_scheduler_control_plane_and_shared_packages_load_no_torch_transformers_or_numpy() -> None:
    assert len(TORCH_FREE) > 10 and "connector.control.cache_index" in TORCH_FREE
    assert first_heavy_import(TORCH_FREE) == {}


def test_the_check_sees_torch_when_a_module_loads_it() -> None:
    assert first_heavy_import(["epd_contracts.ec", "connector.tensors.frames"]) == {"connector.tensors.frames": ["numpy", "torch"]}


def test_the_check_sees_a_package_the_proxy_image_deletes() -> None:
    assert first_heavy_import(["epd_contracts.ec", "epd_models.device_flags"]) == {"epd_models.device_flags": ["epd_models"]}


def test_the_deleted_packages_are_the_ones_the_dockerfile_deletes() -> None:
    stage = (ROOT / "deploy" / "Dockerfile").read_text().split("FROM install AS proxy-install", 1)[1].split("FROM ", 1)[0]
    removed = next(line for line in stage.splitlines() if "rm -rf epd_models" in line)
    assert sorted(removed.split("rm -rf", 1)[1].split()[:-1]) == sorted(NOT_IN_PROXY_IMAGE)  # [-1]: the line's \\
