"""The docs name only what exists: every repo path in backticks, every `Class.member`, every dotted module
reference, and every name written right after a `file.py` (`proxy/fleet.py` `Fleet.plan`) is checked against
the tree and the source (parsed, never imported)."""
from __future__ import annotations

import ast
import functools
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "docs/ARCHITECTURE.md", "docs/SECURITY.md", "docs/DEPLOY.md", "docs/BENCHMARKS.md",
        "docs/REFERENCE.md"]
PACKAGES = ("proxy", "scheduler", "encoder_service", "decoder_service", "connector", "epd_contracts", "epd_common",
            "epd_models", "epd_builders", "epd_bench", "epd_launcher", "epd_planner")
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


# --- the generated flag reference ---------------------------------------------------------------------------------

def test_the_flag_reference_matches_the_parsers() -> None:
    """docs/FLAGS.md is what `python -m epd_builders.flag_reference` makes from every program's parser now."""
    done = subprocess.run([sys.executable, "-m", "epd_builders.flag_reference", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    text = (ROOT / "docs/FLAGS.md").read_text()
    for program in ("disagg-epd-proxy", "epd-encoder", "epd-decoder", "epd-bench", "epd-ec-keygen"):
        assert f"\n## {program}\n" in text, program
    assert "| `--proxy-workers` |" in text and "| `--kv-cache-memory` |" in text and "`epd-ec-keygen env`" in text


def test_the_flag_reference_is_built_without_torch() -> None:
    """Every program's parser builds before any heavy import: the reference (and each --help) loads no torch."""
    code = ("import sys; from epd_builders.flag_reference import render; render(); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


# --- links between the docs ---------------------------------------------------------------------------------------

LINKED = [*DOCS, "docs/REFERENCE.md", "docs/FLAGS.md", "deploy/README.md"]
_LINK = re.compile(r"\]\(([^)\s]*)\)")


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors for a markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("doc", LINKED)
def test_every_link_between_the_docs_reaches_a_file_and_heading(doc: str) -> None:
    broken = []
    for target in _LINK.findall(_text(doc)):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (ROOT / doc).parent / path if path else ROOT / doc
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
            broken.append(target)
    assert not broken, f"{doc} links to what does not exist: {broken}"


# --- every README block runs --------------------------------------------------------------------------------------

README_URL = "http://127.0.0.1:8000"
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)
_HEADING = re.compile(r"^#{2,3} (.+)$", re.M)
# README sections whose blocks run against one stack, each started as the section says
STACKS = {"Ask it something": "demo", "Benchmarking": "demo", "Video inputs": "video", "Audio inputs": "audio",
          "Prefill and decode apart (E → P → D)": "prefill", "Sizing the fleet: epd-planner": "planner"}
# blocks not run here (keyed by their first line), and why
NOT_RUN = {
    "make run    #": "make run is the stack the demo blocks run against: the Makefile's own command line "
                    "(make_run_args); make test is the suite itself",
    "python3 -m venv runs/aiperf-venv": "installs aiperf and vLLM into venvs of their own (minutes, gigabytes); "
                                        "tests/test_bench_recipe.py checks the requests their flags make and runs "
                                        "the TOKENIZER line",
    ".venv/bin/disagg-epd-proxy --model demo --port 8000 --autoscale": "the stack alone does nothing to check: "
                                                                        "tests/e2e/test_autoscale_e2e.py starts it "
                                                                        "so, with a shorter window, and sends the "
                                                                        "burst that makes it add and drain an encoder",
    "make docker-host": "needs a Docker engine: tests/deploy/ checks these files against the parsers, and "
                        "make deploy-smoke runs them (tests/deploy/test_smoke.py with EPD_DEPLOY_SMOKE=1)",
}
# what a block prints (regular expressions over its output), keyed by its first line
EXPECT = {
    ".venv/bin/python -m proxy.example --base-url http://127.0.0.1:8000/v1\n": [
        r"What color is the shape\? -> 'red'", r"What shape is it\? -> 'circle'"],
    "import base64, io": [r"^red CompletionUsage\("],
    "from openai import OpenAI": [r'^\{"color": "red"\}$'],
    ".venv/bin/epd-bench": [r"Successful requests:\s+40\b", r"Failed requests:\s+0\b"],
    ".venv/bin/python -m proxy.example --base-url http://127.0.0.1:8000/v1 --video": [r"What happens in this video\? -> '.*'  \(usage: "],
    ".venv/bin/python -m proxy.example --base-url http://127.0.0.1:8000/v1 --audio": [r"What do you hear\? -> '.*'  \(usage: "],
    "import base64\n": [r"completion_tokens=16\b"],
    # an idle stack of make run's 2 encoders and 1 decoder: one of each would do; the hysteresis keeps 2 for now
    ".venv/bin/epd-planner --once": [r"^encoder  2 -> 1 \(recommended now: 2\)", r"^decoder  1 -> 1 ", r"^  why: "],
}


@dataclass(frozen=True)
class Block:
    section: str
    lang: str
    code: str

    @property
    def first(self) -> str:
        return self.code.split("\n", 1)[0]


def readme_blocks() -> list[Block]:
    """Every fenced block of the README with a language (the picture has none), with the heading it is under."""
    text = (ROOT / "README.md").read_text()
    blocks = []
    for m in _FENCE.finditer(text):
        heads = _HEADING.findall(text[:m.start()])
        blocks.append(Block(heads[-1] if heads else "", m.group(1), m.group(2)))
    return blocks


def make_run_args(args: str = "") -> list[str]:
    """`make run ARGS=...`'s launcher command line, read from the Makefile with its defaults."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    defaults = dict(re.findall(r"^(\w+) \?= ?(.*)$", text, flags=re.M))
    line = re.search(r"^run: .*\n\t(.+)$", text, flags=re.M)
    assert line is not None
    command = re.sub(r"\$\((\w+)\)", lambda m: args if m.group(1) == "ARGS" else defaults.get(m.group(1), m.group(0)),
                     line.group(1))
    argv = shlex.split(command)
    assert argv[0] == "$(BIN)/disagg-epd-proxy", argv
    return _without_port(argv[1:])


def _without_port(argv: list[str]) -> list[str]:
    """The stack gets a port of its own (tests/e2e/stack.py launched)."""
    i = argv.index("--port")
    return argv[:i] + argv[i + 2:]


def _ours(code: str, url: str, tmp: Path) -> str:
    """The block pointed at this test's stack and folders: its URL, /tmp/ and runs/."""
    code = code.replace(README_URL, url).replace("/tmp/", f"{tmp}/")
    return re.sub(r"(?<![\w/])runs/", f"{tmp}/runs/", code)


def _run(block: Block, url: str, tmp: Path) -> str:
    code = _ours(block.code, url, tmp)
    argv = [sys.executable, "-c", code] if block.lang == "python" else ["bash", "-eo", "pipefail", "-c", code]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"README block under {block.section!r} failed:\n{block.code}\n{done.stderr[-3000:]}"
    for expected in next((v for k, v in EXPECT.items() if block.code.startswith(k)), []):
        assert re.search(expected, done.stdout, flags=re.M), f"{block.first!r} printed {done.stdout[-2000:]!r}"
    return done.stdout


def _server_line(line: str) -> list[str] | None:
    """The launcher arguments of a line that starts a stack (`make run ...` or `disagg-epd-proxy ...`), else None."""
    line = line.split("  #", 1)[0].strip()
    if line.startswith("make run"):
        found = re.search(r'ARGS="([^"]*)"', line)
        return make_run_args(found.group(1) if found else "")
    if line.startswith(".venv/bin/disagg-epd-proxy "):
        return _without_port(shlex.split(line)[1:])
    return None


def _section_blocks(kind: str) -> list[Block]:
    return [b for b in readme_blocks() if STACKS.get(b.section) == kind and not b.first.startswith(tuple(NOT_RUN))]


@contextmanager
def _readme_stack(kind: str, tmp: Path) -> Iterator[tuple[str, list[Block]]]:
    """The stack a section's blocks run against: the section's own server line (its other lines run first, as
    written), or make run's for the demo sections. Yields its URL and the blocks left to run."""
    from tests.e2e.stack import launched

    blocks, args = _section_blocks(kind), make_run_args()
    for block in list(blocks):
        lines = block.code.splitlines()
        starts = [i for i, ln in enumerate(lines) if _server_line(ln) is not None]
        if starts:
            before = Block(block.section, block.lang, "\n".join(lines[:starts[0]]))
            if before.code.strip():
                _run(before, README_URL, tmp)
            args = _server_line(_ours(lines[starts[0]], README_URL, tmp)) or args
            assert starts[0] == len(lines) - 1, "a server line ends its block: the next block asks it something"
            blocks.remove(block)
    with launched(tmp, *args) as stack:
        yield stack.base_url, blocks


def test_every_readme_block_runs_here_or_says_why_not() -> None:
    blocks = readme_blocks()
    unplaced = [b.first for b in blocks if b.section not in STACKS and not b.first.startswith(tuple(NOT_RUN))]
    assert not unplaced, f"README blocks no test runs: {unplaced}"
    assert len(blocks) >= 10 and {"python", "bash"} <= {b.lang for b in blocks}
    assert all(any(b.code.startswith(k) for b in blocks) for k in (*NOT_RUN, *EXPECT)), "a key names no block"


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["demo", "video", "audio", "planner"])
def test_the_readme_blocks_run_as_written(kind: str, tmp_path: Path) -> None:
    """Each block of a section, in order, against the stack it names (URL, /tmp/ and runs/ pointed at this test's)."""
    with _readme_stack(kind, tmp_path) as (url, blocks):
        assert blocks
        for block in blocks:
            out = _run(block, url, tmp_path)
            if block.first.startswith("IMG="):  # the streamed chunks add up to the answer, then [DONE]
                chunks = [json.loads(ln[6:]) for ln in out.splitlines() if ln.startswith("data: {")]
                assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
                    "circle" and out.rstrip().endswith("data: [DONE]"), out
    if kind == "demo":
        assert list((tmp_path / "runs" / "bench-demo").glob("*.json")), "epd-bench saved its result under runs/"


@pytest.mark.e2e
def test_the_readme_prefill_block_hands_prompts_off(tmp_path: Path) -> None:
    """`make run ARGS="--num-prefills 1 ..."` starts a prefill worker, and the demo's prompts are handed off."""
    from tests.e2e.stack import metric

    with _readme_stack("prefill", tmp_path) as (url, blocks):
        assert not blocks
        ask = Block("", "bash", ".venv/bin/python -m proxy.example --base-url http://127.0.0.1:8000/v1")
        _run(ask, url, tmp_path)
        assert metric(httpx.get(f"{url}/metrics", timeout=10).text, "epd_proxy_handoffs_total") >= 2
