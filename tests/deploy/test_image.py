"""deploy/Dockerfile: two non-root images installed only from the wheelhouse with every hash checked, and a proxy
image that refuses to build with torch, transformers or numpy in it."""
from __future__ import annotations

import re

from tests.deploy.manifests import (
    DEPLOY,
    dockerfile,
    image_uid,
    stages,
)


def test_dockerfile_images_run_as_a_numeric_non_root_user() -> None:
    assert image_uid() == 10001  # numeric, so Kubernetes' runAsNonRoot can verify it


def test_dockerfile_installs_only_from_the_wheelhouse_and_checks_every_hash() -> None:
    args = dict(a.split("=", 1) for op, a in dockerfile() if op == "ARG" and "=" in a)
    assert args["BASE_IMAGE"].startswith("python:3.11-")  # the locks are for CPython 3.11
    assert dockerfile()[1] == ("FROM", "${BASE_IMAGE} AS base")
    assert [a for op, a in dockerfile() if op == "FROM"][1:] == ["base AS install", "install AS proxy-install",
                                                                  "base AS proxy", "base AS worker"]
    runs = [a for op, a in dockerfile() if op == "RUN"]
    installs = [r for r in runs if " install " in r]
    assert installs and all("--no-index" in r for r in installs)
    assert any("--require-hashes -r /wheels/requirements.txt" in r for r in installs)
    assert not re.search(r"https?://|apt-get|--index-url|--extra-index-url", " ".join(runs))  # offline
    assert not any("torchvision" in a for op, a in dockerfile())  # comments dropped: only instructions
    # the images copy the installed environment only: no wheels, no pip
    assert ("COPY", "--from=proxy-install /opt/epd /opt/epd") in stages()["proxy"]
    assert ("COPY", "--from=install /opt/epd /opt/epd") in stages()["worker"]
    assert any("pip uninstall --yes --quiet pip" in r for r in runs)
    env = " ".join(a for op, a in dockerfile() if op == "ENV")
    assert "HF_HOME=/models/hf" in env and ("VOLUME", '["/models"]') in stages()["worker"]


def test_the_proxy_image_refuses_to_build_with_torch_transformers_or_numpy_in_it() -> None:
    checks = " ".join(a for op, a in stages()["proxy"] if op == "RUN")
    assert "import epd_launcher.cli, proxy.app" in checks
    assert re.search(r"for m in torch transformers numpy; do ! python -c \"import \$m\"", checks)


def test_the_proxy_image_leaves_out_the_worker_packages_and_the_tracing_bytecode() -> None:
    """What keeps the proxy image under 300 MB with the tracing extra (the smoke test measures it)."""
    (trim,) = [a for op, a in stages()["proxy-install"] if op == "RUN"]
    assert "rm -rf epd_models epd_builders epd_bench decoder_service encoder_service" in trim
    assert "find opentelemetry/sdk" in trim and "-name __pycache__" in trim
    checks = " ".join(a for op, a in stages()["proxy"] if op == "RUN")
    assert "opentelemetry.sdk.trace, opentelemetry.exporter.otlp.proto.http" in checks  # tracing still imports


def test_dockerfile_copies_what_the_wheelhouse_script_writes() -> None:
    script = (DEPLOY / "tools" / "wheelhouse.sh").read_text()
    copies = [a.split()[0] for op, a in stages()["install"] if op == "COPY"]
    assert copies == ["requirements.txt", "wheels/", "epd/"]
    for written in ('"$OUT/requirements.txt"', '--dest "$OUT/wheels"', '--wheel-dir "$OUT/epd"', '"$OUT/epd/epd-register"'):
        assert written in script, written
