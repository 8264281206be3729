"""epd_bench.revisions: a revision exported without touching the repository, and the after ÷ before ratios."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from epd_bench.revisions import ROOT, export_revision, ratios, shipped_path


def test_export_revision_writes_the_commits_files_once(tmp_path: Path) -> None:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    status = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True).stdout
    sha, tree = export_revision("HEAD", into=tmp_path)
    assert sha == head and tree == tmp_path / head[:12]
    assert (tree / "pyproject.toml").read_bytes() == subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{head}:pyproject.toml"], check=True, capture_output=True).stdout
    (tree / "pyproject.toml").write_text("changed")  # a second export of the same sha reuses the directory
    assert export_revision(head[:10], into=tmp_path) == (sha, tree)
    assert (tree / "pyproject.toml").read_text() == "changed"
    assert subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True,
                          text=True).stdout == status  # the repository is untouched


def test_ratios_are_after_over_before_of_each_p50() -> None:
    def stack(new: float, cached: float) -> dict[str, object]:
        return {"new": {"ttft": {"p50_ms": new}, "total": {"p50_ms": 2 * new}},
                "cached": {"ttft": {"p50_ms": cached}, "total": {"p50_ms": 2 * cached}}}

    got = ratios({"before": stack(40, 20), "after": stack(30, 10)}, "after", "before")
    assert got == {"new_ttft_p50_after_vs_before": 0.75, "new_total_p50_after_vs_before": 0.75,
                   "cached_ttft_p50_after_vs_before": 0.5, "cached_total_p50_after_vs_before": 0.5}


def test_a_revision_whose_deps_lacked_uvloop_runs_without_it(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    (old / "pyproject.toml").write_text('dependencies = ["uvicorn>=0.29"]\n')
    (new / "pyproject.toml").write_text('dependencies = ["uvicorn>=0.29", "uvloop>=0.19"]\n')
    assert shipped_path(new) == str(new)
    path = shipped_path(old)
    probe = "import uvicorn.config as c; print(c.Config(app=None, loop='auto').get_loop_factory().__module__)"
    loop_module = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": path},
                                 check=True, capture_output=True, text=True).stdout.strip()
    assert loop_module.startswith("asyncio"), loop_module  # the installed uvloop is hidden from the old revision
