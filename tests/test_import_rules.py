"""The import contracts in pyproject.toml bite: one forbidden import injected into a copy of the tree breaks its contract.

lint-imports runs in a subprocess inside the copy: grimp finds packages through the import system, so in this
process (where the real packages are already imported) it would lint the real tree instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from importlinter.api import read_configuration

ROOT = Path(__file__).resolve().parents[1]
CONFIG = read_configuration(str(ROOT / "pyproject.toml"))
PACKAGES: list[str] = CONFIG["session_options"]["root_packages"]
NAMES: dict[str, str] = {c["id"]: c["name"] for c in CONFIG["contracts_options"]}

# (package whose __init__ gets the line, the line, id of the contract it breaks); an __init__ survives any file move
VIOLATIONS = [
    ("proxy", "import torch", "torch-free-front"),
    ("scheduler", "import transformers", "torch-free-front"),
    ("encoder_service", "import decoder_service", "services"),
    ("scheduler", "import proxy", "layers"),
    ("epd_contracts", "import epd_common", "contracts"),
    ("connector", "import epd_models", "connector"),
    ("connector", "import connector.tensors.cache", "connector-init"),
    ("decoder_service", "import epd_bench", "fixtures"),
    ("decoder_service.engine", "import decoder_service.request", "engine"),
    ("epd_planner", "import torch", "planner"),
    ("epd_planner", "import proxy", "planner"),
]


def copy_tree(dest: Path) -> Path:
    """Copy the packages' Python files and pyproject.toml (nothing else is linted) into `dest`."""
    only_python = shutil.ignore_patterns("__pycache__", "*.safetensors", "*.json", "*.txt", "*.jinja", "*.png")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, dest / package, ignore=only_python)
    shutil.copy(ROOT / "pyproject.toml", dest)
    return dest


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"]
    env = {**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "1000"}  # wide enough that no contract name wraps
    return subprocess.run(
        [*command, "--no-cache", "--no-logo"], cwd=tree, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_tree_keeps_every_contract(tmp_path: Path) -> None:
    result = lint_imports(copy_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(NAMES)} kept, 0 broken." in result.stdout


@pytest.mark.parametrize(("package", "line", "contract"), VIOLATIONS)
def test_one_forbidden_import_breaks_its_contract(tmp_path: Path, package: str, line: str, contract: str) -> None:
    tree = copy_tree(tmp_path)
    with open(tree / package.replace(".", "/") / "__init__.py", "a") as init:
        init.write(f"\n{line}\n")
    result = lint_imports(tree)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{NAMES[contract]} BROKEN" in result.stdout
    assert f"{package} -> {line.split()[1]}" in result.stdout
