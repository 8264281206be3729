"""The launcher's check of `--ec-disk-dir`: the parent of every encoder's folder must be this user's alone."""
from __future__ import annotations

import argparse
import os
import sys

from epd_common.private_dir import ensure_private_dir
from epd_launcher.flags import EC_DISK_DIR, _dest


def refuse_unsafe_disk_dir(args: argparse.Namespace) -> None:
    """Before any worker starts: make --ec-disk-dir (0700) if missing, else exit 2 naming it, its owner and mode,
    when another user owns it or group or others can write it (they could make `encoder-<i>` first and plant
    embeddings in it). Each encoder checks its own folder again (connector/tensors/disk_folder.py)."""
    folder = getattr(args, _dest(EC_DISK_DIR))
    if folder is None:
        return
    try:
        ensure_private_dir(os.path.abspath(folder))
    except OSError as e:  # NotPrivateError included
        print(f"disagg-epd-proxy: error: {EC_DISK_DIR} {e}", file=sys.stderr)
        raise SystemExit(2) from None
