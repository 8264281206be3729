"""docs/FLAGS.md, generated from the argument parsers of every program: `python -m epd_builders.flag_reference
--write` after a flag changes, `--check` to see the file still matches (tests/test_docs.py runs it)."""
from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "docs" / "FLAGS.md"
# (program, module, builder): each program's parser, built by the function its own command line uses
PROGRAMS = (
    ("disagg-epd-proxy", "epd_launcher.flags", "build_parser"),
    ("epd-encoder", "encoder_service.cli", "build_parser"),
    ("epd-decoder", "decoder_service.cli", "build_parser"),
    ("epd-bench", "epd_bench.bench_flags", "build_parser"),
    ("epd-ec-keygen", "connector.control.security", "build_parser"),
    ("epd-planner", "epd_planner.cli", "build_parser"),
)
COMMAND = "python -m epd_builders.flag_reference --write"
_DEFAULT_IN_HELP = re.compile(r"\s*\(default:?\s+((?:[^()]|\([^()]*\))*)\)\s*$", re.S)


@contextmanager
def _no_epd_environment() -> Iterator[None]:
    """Defaults read from EPD_* variables (keys, --insecure) as on a machine that sets none: the file is the same
    everywhere, and never shows a secret."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("EPD_")}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "on" if action.default else "off"
    if action.default is None or action.default is argparse.SUPPRESS:
        return "—"
    return f"`{action.default}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _row(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    names = " / ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
    text = (action.help or "") % {"prog": parser.prog, "default": action.default}
    default = _default(action)
    stated = _DEFAULT_IN_HELP.search(text)
    if stated:  # the help says the default in words ("default: the encoder's own"): that, not the raw value
        text, default = text[:stated.start()], stated.group(1)
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        text += f" (one of: {', '.join(str(c) for c in action.choices)})"
    return f"| {names} | {_cell(default)} | {_cell(text)} |"


def _groups(parser: argparse.ArgumentParser) -> Iterator[tuple[str, list[argparse.Action]]]:
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help is not argparse.SUPPRESS
                   and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
        if actions:
            yield group.title or "options", actions


def _section(parser: argparse.ArgumentParser, heading: str) -> list[str]:
    lines = [heading, ""]
    if parser.description:
        lines += [_cell(parser.description.split("\n\n")[0]), ""]
    for title, actions in _groups(parser):
        lines += [f"**{title}**", "", "| flag | default | meaning |", "|---|---|---|"]
        lines += [_row(a, parser) for a in actions] + [""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                lines += _section(sub, f"### `{parser.prog} {name}`")
    return lines


def _builder(module: str, name: str) -> Callable[[], argparse.ArgumentParser]:
    built: Callable[[], argparse.ArgumentParser] = getattr(importlib.import_module(module), name)
    return built


def render() -> str:
    """The whole of docs/FLAGS.md."""
    lines = ["# Flags", "", f"Every flag of every program, generated from their argument parsers by `{COMMAND}`",
             "(edit the parser's help, not this file; `tests/test_docs.py` checks the two agree). What the flags do",
             "together, and the limits behind them: [REFERENCE.md](REFERENCE.md) and [SECURITY.md](SECURITY.md).", ""]
    lines += [f"- [`{prog}`](#{prog})" for prog, _, _ in PROGRAMS] + [""]
    with _no_epd_environment():
        for prog, module, name in PROGRAMS:
            lines += _section(_builder(module, name)(), f"## {prog}")
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser("python -m epd_builders.flag_reference", description=__doc__, allow_abbrev=False)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {TARGET.relative_to(ROOT)}")
    mode.add_argument("--check", action="store_true", help=f"exit 1 if {TARGET.relative_to(ROOT)} differs")
    args = p.parse_args(argv)
    text = render()
    if args.write:
        TARGET.write_text(text)
    elif args.check:
        old = TARGET.read_text() if TARGET.exists() else ""
        if old != text:
            diff = difflib.unified_diff(old.splitlines(), text.splitlines(), "docs/FLAGS.md", "the parsers",
                                        lineterm="", n=0)
            print("\n".join(list(diff)[:60]), f"\ndocs/FLAGS.md is out of date: run {COMMAND}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
