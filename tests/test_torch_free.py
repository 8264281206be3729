"""The proxy, the scheduler, the connector's control plane and the shared packages load neither torch nor
transformers, nor numpy (the proxy image has none of them): they are imported in a fresh interpreter, checking
sys.modules after each."""
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

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "numpy")
# NOTE: the first module that loads torch is reported; the ones after it cannot be told apart, and need not be
CHECK = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
    heavy = [m for m in {heavy!r} if m in sys.modules]
    if heavy:
        print(json.dumps({{name: heavy}}))
        break
else:
    print(json.dumps({{}}))
"""


def modules_of(package: ModuleType) -> list[str]:
    return [m.name for m in pkgutil.iter_modules(package.__path__, f"{package.__name__}.")]


TORCH_FREE = ["epd_launcher.cli", "proxy.app", "scheduler.scheduler", *modules_of(connector.control), *modules_of(epd_contracts),
              *modules_of(epd_common)]


def first_heavy_import(modules: list[str]) -> dict[str, list[str]]:
    """{module: heavy modules it loaded} for the first of `modules` that loads torch, transformers or numpy, else
    {}."""
    code = CHECK.format(heavy=HEAVY)
    run = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


def test_proxy_scheduler_control_plane_and_shared_packages_load_no_torch_transformers_or_numpy() -> None:
    assert len(TORCH_FREE) > 10 and "connector.control.cache_index" in TORCH_FREE
    assert first_heavy_import(TORCH_FREE) == {}


def test_the_check_sees_torch_when_a_module_loads_it() -> None:
    assert first_heavy_import(["epd_contracts.ec", "connector.tensors.frames"]) == {"connector.tensors.frames": ["torch", "numpy"]}
