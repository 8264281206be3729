"""tests/deploy: every test sees a fresh shell's environment (no EPD_* keys), and one generated set of keys."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.manifests import env_file, generated_keys


@pytest.fixture(autouse=True)
def no_epd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parsers read EPD_* defaults (keys, CURVE) from the environment; test them as a fresh shell would."""
    for name in ("EPD_API_KEY", "EPD_INTERNAL_KEY", "EPD_PROXY_URL", "EPD_EC_CURVE_SECRET_KEY",
                 "EPD_EC_CURVE_SERVER_KEY", "EPD_EC_CURVE_ALLOWED_CLIENTS", "EPD_INSECURE"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(f"{name}_FILE", raising=False)


@pytest.fixture(scope="module")
def key_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:  # a fresh `epd-ec-keygen env DIR`
    directory = tmp_path_factory.mktemp("keys") / "secrets"
    generated_keys(directory)
    return directory


@pytest.fixture(scope="module")
def keys(key_dir: Path) -> dict[str, dict[str, str]]:  # its files, parsed
    return {p.name: env_file(p) if p.suffix == ".env" else {"": p.read_text().strip()} for p in key_dir.iterdir()}
