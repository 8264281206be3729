"""The connector must never deserialize with pickle or its relatives."""

from __future__ import annotations

import ast
from pathlib import Path

FORBIDDEN = {"pickle", "cloudpickle", "dill", "marshal", "_pickle", "joblib"}
CONNECTOR_DIR = Path(__file__).resolve().parents[2] / "connector"


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module a source file imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_connector_module_imports_pickle_like_serializers() -> None:
    sources = sorted(CONNECTOR_DIR.glob("**/*.py"))
    assert len(sources) >= 5, f"connector sources not found under {CONNECTOR_DIR}"
    offenders = {p.name: sorted(imported_modules(p) & FORBIDDEN) for p in sources}
    assert {name: mods for name, mods in offenders.items() if mods} == {}


def test_import_checker_catches_a_pickle_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom pickle import loads\nimport dill.source\n")
    assert imported_modules(bad) & FORBIDDEN == {"pickle", "dill"}
