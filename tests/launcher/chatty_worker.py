"""A worker that prints one line to stdout (no flush) and then waits until the file named by --go exists: the
test reads that line while it still runs."""
from __future__ import annotations

import argparse
from pathlib import Path

from tests.waiting import wait_for


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    for flag in ("--model", "--host", "--port", "--go"):
        p.add_argument(flag, required=True)
    args = p.parse_args()
    print(f"worker {args.port} loading")  # NOTE: no flush: the launcher's environment must make it go out now
    wait_for(Path(args.go).exists, f"the test's --go file {args.go}", interval=0.02)


if __name__ == "__main__":
    main()
