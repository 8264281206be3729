"""The distribution is `disagg-epd` (on the package index `epd` is another project): the installed metadata answers
to it, and every install line and error text that names an extra names it."""
from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from epd_common.cli import package_version

ROOT = Path(__file__).resolve().parent.parent
NAME = "disagg-epd"
# where an install line or an error text may name the distribution
TEXTS = ["README.md", "Makefile", "deploy/Dockerfile", "deploy/tools/wheelhouse.sh", "epd_common/tracing.py",
         *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def test_the_project_is_named_disagg_epd_and_its_version_is_read_by_that_name() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == NAME
    assert {"disagg-epd-proxy", "epd-encoder", "epd-decoder", "epd-ec-keygen", "epd-bench"} <= set(project["scripts"])
    assert package_version() == metadata.version(NAME) != "unknown (not installed)"


def test_no_install_line_or_error_text_names_the_other_projects_epd() -> None:
    found = [f"{path}: {m.group(0)}" for path in TEXTS
             for m in re.finditer(r"(?<![\w-])epd(\[\w+\]|==|>=)", (ROOT / path).read_text())]
    assert not found, found
    assert f"pip install '{NAME}[tracing]'" in (ROOT / "epd_common/tracing.py").read_text()


def test_the_image_installs_the_wheel_pip_names_for_the_distribution() -> None:
    wheel = NAME.replace("-", "_")  # a wheel's file name spells the distribution with underscores
    assert f"/epd/{wheel}-*.whl" in (ROOT / "deploy/Dockerfile").read_text()
    assert f'"$OUT"/epd/{wheel}-*.whl' in (ROOT / "deploy/tools/wheelhouse.sh").read_text()
