"""Every program's command line: --help answers without loading torch or transformers (it parses first), a
configuration error is one line `PROG: error: …` with exit 2 and no traceback (unless --log-level debug), and no
parser takes an abbreviation of a flag (`--num-encoder 2` is not --num-encoders)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]  # name -> "module:function"
HEAVY = ("torch", "transformers")
# the console script as installed runs it; at exit it reports which heavy modules were ever imported
PROBE = """import atexit, importlib, sys
atexit.register(lambda: print("HEAVY=" + ",".join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr))
module, function = sys.argv.pop(1).split(":")
sys.argv[0] = {name!r}
getattr(importlib.import_module(module), function)()
"""
PRODUCT = ("proxy", "scheduler", "connector", "encoder_service", "decoder_service", "epd_models", "epd_contracts",
           "epd_common", "epd_launcher", "epd_planner", "deploy")


def run(name: str, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    code = PROBE.format(heavy=HEAVY, name=name)
    return subprocess.run([sys.executable, "-c", code, PROGRAMS[name], *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def test_every_console_script_is_checked() -> None:
    assert {"disagg-epd-proxy", "epd-encoder", "epd-decoder", "epd-ec-keygen", "epd-bench", "epd-planner"} <= set(PROGRAMS)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_help_answers_without_loading_torch_or_transformers(name: str) -> None:
    done = run(name, "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage:" in done.stdout and name in done.stdout
    assert done.stderr.strip().splitlines()[-1] == "HEAVY=", done.stderr[-3000:]


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_an_unknown_flag_is_one_error_line_and_exit_2(name: str) -> None:
    done = run(name, "--no-such-flag")
    lines = [line for line in done.stderr.splitlines() if not line.startswith("HEAVY=")]
    assert done.returncode == 2 and lines[-1].startswith(f"{name}: error: "), done.stderr[-3000:]
    assert "Traceback" not in done.stderr


SERVICES = ("disagg-epd-proxy", "epd-encoder", "epd-decoder")


@pytest.mark.parametrize("name", SERVICES)
@pytest.mark.parametrize("debug", [False, True])
def test_a_configuration_error_is_one_line_and_exit_2_with_the_traceback_only_under_debug(
        name: str, debug: bool, tmp_path: Path) -> None:
    """A key file that cannot be read (read while the flags are set up, before anything starts)."""
    missing = tmp_path / "missing"
    done = run(name, *(["--log-level", "debug"] if debug else []), env={"EPD_INTERNAL_KEY_FILE": str(missing)})
    lines = [line for line in done.stderr.splitlines() if not line.startswith("HEAVY=")]
    assert done.returncode == 2, done.stderr[-3000:]
    assert lines[-1] == f"{name}: error: EPD_INTERNAL_KEY_FILE: cannot read {missing}: No such file or directory"
    assert ("Traceback" in done.stderr) == debug and (len(lines) == 1) != debug


def _parsers_without_allow_abbrev_false(roots: list[Path]) -> list[str]:
    """FILE:LINE of each ArgumentParser(...) or subparsers' add_parser(...) call under `roots` that does not pass
    allow_abbrev=False."""
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
                value = next((k.value for k in node.keywords if k.arg == "allow_abbrev"), None)
                if name in ("ArgumentParser", "add_parser") and not (isinstance(value, ast.Constant)
                                                                     and value.value is False):
                    found.append(f"{path}:{node.lineno}")
    return found


def test_no_product_parser_takes_an_abbreviation() -> None:
    assert _parsers_without_allow_abbrev_false([ROOT / p for p in PRODUCT]) == []


def test_no_benchmark_or_builder_parser_takes_an_abbreviation() -> None:
    assert _parsers_without_allow_abbrev_false([ROOT / "epd_bench", ROOT / "epd_builders"]) == []


def test_the_check_sees_a_parser_that_takes_abbreviations(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("import argparse\np = argparse.ArgumentParser('x')\n"
                                   "q = argparse.ArgumentParser('y', allow_abbrev=False)\n"
                                   "r = q.add_subparsers().add_parser('z')\n")
    assert _parsers_without_allow_abbrev_false([tmp_path]) == [f"{tmp_path / 'm.py'}:2", f"{tmp_path / 'm.py'}:4"]


def test_an_abbreviated_flag_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from epd_launcher.flags import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--num-encoder", "2"])
    assert exc.value.code == 2 and "unrecognized arguments: --num-encoder" in capsys.readouterr().err
