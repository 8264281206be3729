"""disagg-epd-proxy argument handling."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.cli import _config, _urls, build_parser, main


@pytest.fixture(autouse=True)
def keep_root_logging() -> Iterator[None]:
    """main() installs the service's log handler on the root logger; put pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_worker_urls_accept_spaces_and_commas() -> None:
    assert _urls(["http://a:1,http://b:2/", "http://c:3"]) == ("http://a:1", "http://b:2", "http://c:3")


def test_attach_mode_needs_both_kinds_of_worker() -> None:
    with pytest.raises(SystemExit, match="needs both"):
        main(["--encode-servers-urls", "http://e:1"])


def test_flags_map_to_the_proxy_config() -> None:
    args = build_parser().parse_args(["--model", "/models/Qwen2-VL-2B/", "--max-images-per-request", "3",
                                      "--max-image-pixels", "1000", "--port", "9000"])
    cfg = _config(args, ("http://e",), ("http://d",), None)
    assert (cfg.served_model_name, cfg.max_images_per_request, cfg.max_image_pixels, cfg.port) == (
        "Qwen2-VL-2B", 3, 1000, 9000)


def test_curve_keys_load_from_files_into_the_config_and_are_refused_in_launcher_mode(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from common.cli import pop_curve
    from connector.security import generate_keypair

    enc_public, _ = generate_keypair(tmp_path, "encoders")
    _, proxy_secret = generate_keypair(tmp_path, "proxy")
    flags = ["--ec-curve-key", str(proxy_secret), "--ec-curve-server-key", str(enc_public)]
    parser = build_parser()
    args = parser.parse_args(["--pipeline-encode", *flags])
    cfg = _config(args, ("http://e",), ("http://d",), pop_curve(parser, args))
    assert cfg.pipeline_encode and cfg.curve is not None and cfg.curve.server_key is not None
    with pytest.raises(SystemExit):
        main(flags)  # no worker URLs: launcher mode
    assert "attach mode" in capsys.readouterr().err


def test_a_missing_key_file_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--ec-curve-key", "/nonexistent/key_secret", "--encode-servers-urls", "http://e", "--decode-servers-urls",
              "http://d"])
    assert "/nonexistent/key_secret" in capsys.readouterr().err
