"""The docs name only what exists: every repo path in backticks, every `Class.member`, every dotted module
reference, and every name written right after a `file.py` (`proxy/fleet.py` `Fleet.plan`) is checked against
the tree and the source (parsed, never imported)."""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "docs/ARCHITECTURE.md", "docs/SECURITY.md", "docs/DEPLOY.md", "docs/BENCHMARKS.md"]
PACKAGES = ("proxy", "scheduler", "encoder_service", "decoder_service", "connector", "epd_contracts", "epd_common",
            "epd_models", "epd_builders", "epd_bench", "epd_launcher")
TOP = (*PACKAGES, "docs", "deploy", "tests")
# named in the docs, but not ours: other projects' code the design is compared with
FOREIGN = {"LLMEngine.step"}

_SPAN = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"^[\w.-]+(/[\w.-]+)*/?$")
_FOLDER = re.compile(r"^[\w.-]+/$")  # `models/`: a top-level folder, wherever it is named
_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)?(\(\))?$")
_MEMBER = re.compile(r"^[A-Z]\w*\.[a-z_]\w*(\(\))?$")
_DOTTED = re.compile(rf"^({'|'.join(PACKAGES)})(\.\w+)+$")
_BETWEEN_NAMES = re.compile(r"^\s*[,/|]?\s*$")  # `a.py` `f`, `g` (or a table cell after it): spaces and one of , / |


@functools.cache
def _text(doc: str) -> str:
    """The doc without its code blocks (they hold commands, not references)."""
    return re.sub(r"```.*?```", "", (ROOT / doc).read_text(), flags=re.S)


def _spans(doc: str) -> list[tuple[str, int, int]]:
    return [(m.group(1), m.start(), m.end()) for m in _SPAN.finditer(_text(doc))]


def _ignored() -> list[str]:
    """Plain entries of .gitignore: files a user creates (deploy/.env, deploy/secrets/), which docs may name."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return [ln.strip("/") for ln in lines if ln and not ln.startswith("#") and not set(ln) & set("*?[")]


def repo_paths(doc: str) -> list[str]:
    """Backticked spans that name a file or folder of this repository (by their first folder)."""
    found = []
    for span, _, _ in _spans(doc):
        if "/" in span and _PATH.match(span) and (span.split("/")[0] in TOP or _FOLDER.match(span)):
            found.append(span)
    return found


def file_names(doc: str) -> list[tuple[str, str]]:
    """(file.py, name) for names written right after a backticked .py path: `file.py` `A.b`, `c`."""
    spans, text = _spans(doc), _text(doc)
    pairs = []
    for i, (span, _, end) in enumerate(spans):
        if not (span.endswith(".py") and span.split("/")[0] in TOP):
            continue
        for name, start, next_end in spans[i + 1:]:
            if not _BETWEEN_NAMES.match(text[end:start]) or not _NAME.match(name) or name.endswith(".py"):
                break
            pairs.append((span, name.removesuffix("()")))
            end = next_end
    return pairs


def members(doc: str) -> list[str]:
    return [s.removesuffix("()") for s, _, _ in _spans(doc) if _MEMBER.match(s) and s.removesuffix("()") not in FOREIGN]


def dotted(doc: str) -> list[str]:
    return [s for s, _, _ in _spans(doc) if _DOTTED.match(s)]


@functools.cache
def _defined(path: str) -> dict[str, set[str]]:
    """Top-level names of a module -> for classes, their members (methods, properties, fields)."""
    tree = ast.parse((ROOT / path).read_text())
    names: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = _class_members(node)
        for target in _assigned(node):
            names.setdefault(target, set())
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = set()
    return names


def _class_members(cls: ast.ClassDef) -> set[str]:
    """Methods, class attributes, and attributes its methods set on `self` (`self.in_flight = {}`)."""
    found = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.add(node.name)
            found.update(t.attr for n in ast.walk(node) for t in _targets(n)
                         if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self")
        found.update(_assigned(node))
    return found


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def _assigned(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, (ast.Import, ast.ImportFrom)):  # a name a module re-exports still resolves
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    return []


def defines(path: str, name: str) -> bool:
    """Whether `name` (`f`, `Class` or `Class.member`) is defined at the top of the module at `path`."""
    names = _defined(path)
    head, _, member = name.partition(".")
    return head in names and (not member or member in names[head] or _inherited(path, head, member))


def _inherited(path: str, cls: str, member: str) -> bool:
    """A member defined on a base class of ours (`EncoderWorker.encode` from `CachingEncoder`)."""
    tree = ast.parse((ROOT / path).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    bases = {b.id for b in node.bases if isinstance(b, ast.Name)} | {b.value.id for b in node.bases
                                                                    if isinstance(b, ast.Subscript)
                                                                    and isinstance(b.value, ast.Name)}
    return any(member in _all_classes().get(base, set()) for base in bases)


@functools.cache
def _product_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


@functools.cache
def _all_classes() -> dict[str, set[str]]:
    """Every class of the product by name -> the members of all classes of that name."""
    classes: dict[str, set[str]] = {}
    for path in _product_files():
        for name, found in _defined(path).items():
            if name[:1].isupper():
                classes.setdefault(name, set()).update(found)
    return classes


def _module_file(dotted_name: str) -> tuple[str, str] | None:
    """`a.b.c.d` -> (path of the longest module prefix, the rest), e.g. ("epd_models/encode.py", "CachingEncoder")."""
    parts = dotted_name.split(".")
    for n in range(len(parts), 0, -1):
        base = "/".join(parts[:n])
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if (ROOT / candidate).is_file():
                return candidate, ".".join(parts[n:])
    return None


@pytest.mark.parametrize("doc", DOCS)
def test_every_repo_path_named_in_the_docs_exists(doc: str) -> None:
    ignored = _ignored()
    missing = [p for p in repo_paths(doc) if not (ROOT / p).exists()
               and not any(p == ig or p.startswith(ig.rstrip("/") + "/") for ig in ignored)]
    assert not missing, f"{doc} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_name_written_after_a_file_is_defined_there(doc: str) -> None:
    missing = [f"{path} {name}" for path, name in file_names(doc) if not defines(path, name)]
    assert not missing, f"{doc} names what its file does not define: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_class_member_named_in_the_docs_exists(doc: str) -> None:
    classes = _all_classes()
    missing = [m for m in members(doc) if m.split(".")[1] not in classes.get(m.split(".")[0], set())]
    assert not missing, f"{doc} names members no class of ours has: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_dotted_module_reference_resolves(doc: str) -> None:
    missing = []
    for ref in dotted(doc):
        found = _module_file(ref)
        if found is None or (found[1] and not defines(*found)):
            missing.append(ref)
    assert not missing, f"{doc} names modules or names that do not exist: {missing}"


def test_the_architecture_folder_table_lists_every_product_module() -> None:
    text = (ROOT / "docs/ARCHITECTURE.md").read_text()
    unnamed = [p for p in _product_files() if not p.endswith("__init__.py") and f"`{p}`" not in text]
    assert not unnamed, f"docs/ARCHITECTURE.md does not name these modules: {unnamed}"


def test_the_checks_find_what_they_look_for() -> None:
    """The extraction is not vacuous: the architecture doc's lifecycle names files and their functions."""
    assert ("proxy/fleet.py", "Fleet.plan") in file_names("docs/ARCHITECTURE.md")
    assert "proxy/streaming.py" in repo_paths("docs/ARCHITECTURE.md")
    assert not defines("proxy/fleet.py", "Fleet.schedule")
