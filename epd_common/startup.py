"""How every EPD program stops on a configuration error: one line `PROG: error: …` on stderr and exit 2, with the
traceback only under `--log-level debug`."""
from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

USAGE_EXIT = 2  # argparse's status for a usage error; every configuration error exits with it


class ConfigError(Exception):
    """A configuration the program cannot start with; its message is the whole report (what, and what to do)."""


def asks_debug(argv: Sequence[str]) -> bool:
    """Whether the command line sets --log-level debug (the one case a configuration error shows its traceback)."""
    args = list(argv)
    for i, arg in enumerate(args):
        if arg.lower() == "--log-level=debug" or (arg == "--log-level" and args[i + 1:i + 2] in (["debug"], ["DEBUG"])):
            return True
    return False


def fail(prog: str, message: str, code: int = USAGE_EXIT) -> NoReturn:
    """The one line (a message of several lines is joined into one), and exit `code`."""
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def run_main(prog: str, main: Callable[[list[str]], None], argv: Sequence[str] | None = None) -> None:
    """Run a program's main(argv). A ConfigError, or a SystemExit that carries a message instead of a status (`raise
    SystemExit("...")`, which Python would print as it is and exit 1 with), becomes `PROG: error: message`, exit 2;
    under --log-level debug the traceback is printed first."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        main(args)
    except ConfigError as exc:
        _report(prog, str(exc), args)
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        _report(prog, exc.code, args)


def _report(prog: str, message: str, argv: list[str]) -> NoReturn:
    if asks_debug(argv):
        traceback.print_exc()
    for prefix in (f"{prog}: error: ", "error: "):  # messages written for Python's own printing of SystemExit
        message = message.removeprefix(prefix)
    fail(prog, message)
