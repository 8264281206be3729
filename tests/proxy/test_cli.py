"""disagg-epd-proxy argument handling."""
from __future__ import annotations

import pytest

from proxy.cli import _config, _urls, build_parser, main


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
