"""No import circles among our packages' modules, type-only imports included.

grimp (which import-linter brings) builds the graph. Unlike the lint contracts in pyproject.toml, this graph keeps
the imports under `if TYPE_CHECKING:`: such an import loads nothing at run time, but two modules that name each
other's types still cannot be read, tested or moved apart, which is what a circle costs.
"""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest
from importlinter.api import read_configuration

ROOT = Path(__file__).resolve().parents[1]
PACKAGES: list[str] = read_configuration(str(ROOT / "pyproject.toml"))["session_options"]["root_packages"]


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """One shortest circle per group of mutually importing modules, each as [a, b, ..., a], sorted."""
    cycles, seen = [], set()
    for module in sorted(graph.modules):
        if module in seen:
            continue
        group = graph.find_upstream_modules(module) & graph.find_downstream_modules(module)
        if not group:
            continue
        seen |= group | {module}
        step = min(group & graph.find_modules_directly_imported_by(module))
        cycles.append([module, *graph.find_shortest_chain(step, module)])
    return cycles


def describe(graph: grimp.ImportGraph, cycle: list[str]) -> str:
    """The circle, then each import in it with the line that makes it."""
    lines = [" -> ".join(cycle)]
    for importer, imported in zip(cycle, cycle[1:], strict=False):
        for detail in graph.get_import_details(importer=importer, imported=imported)[:1]:
            lines.append(f"    {importer}:{detail['line_number']}: {detail['line_contents']}")
    return "\n".join(lines)


def test_import_cycles_finds_a_circle_and_its_lines() -> None:
    graph = grimp.ImportGraph()
    for importer, imported, line in [("pkg.a", "pkg.b", 3), ("pkg.b", "pkg.c", 4), ("pkg.c", "pkg.a", 5),
                                     ("pkg.c", "pkg.d", 6)]:
        graph.add_import(importer=importer, imported=imported, line_number=line,
                         line_contents=f"import {imported}")
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    assert describe(graph, ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]).splitlines() == [
        "pkg.a -> pkg.b -> pkg.c -> pkg.a",
        "    pkg.a:3: import pkg.b",
        "    pkg.b:4: import pkg.c",
        "    pkg.c:5: import pkg.a",
    ]


def test_no_import_cycles_in_our_packages() -> None:
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False, cache_dir=None)
    cycles = import_cycles(graph)
    if cycles:
        found = "\n".join(describe(graph, cycle) for cycle in cycles)
        pytest.fail(f"{len(cycles)} import circle(s):\n{found}", pytrace=False)
