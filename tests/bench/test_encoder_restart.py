"""The encoder restart benchmark end to end on the demo model: after a kill -9, an encoder on the same disk tier
encodes nothing (every repeat read from its files), one without it encodes every image again, and every repeat of
every pass reached the encoder (the decoder's caches answer none). No timing is asserted: the ratio's target is the
benchmark's to report, not a test's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from epd_bench.encoder_restart import PASSES, main, report

pytestmark = pytest.mark.e2e  # starts an encoder (three times), a decoder and the proxy

IMAGES = 2


def test_a_restart_on_the_disk_tier_encodes_nothing_and_one_without_it_encodes_every_image(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--model", "demo", "--images", str(IMAGES), "--rounds", "1", "--image-size", "64", "--out-dir",
          str(tmp_path), "--json"])
    s = json.loads(capsys.readouterr().out)
    assert s["command"].endswith(f"-m epd_bench.encoder_restart --model demo --images {IMAGES} --rounds 1 "
                                 f"--image-size 64 --out-dir {tmp_path} --json")
    assert json.loads((Path(s["run_dir"]) / "summary.json").read_text()) == s
    assert set(s["mean_ttft_ms"]) == set(PASSES) and min(s["mean_ttft_ms"].values()) > 0
    assert s["after_disk_vs_before"] > 0 and s["after_nodisk_vs_before"] > 0 and isinstance(s["met"], bool)
    # the disk tier: every image written before the kill, all of them in the restarted encoder's snapshot, read back
    assert s["disk_writes"] == IMAGES and s["disk_write_mb_s"] > 0 and s["disk_read_mb_s"] > 0
    assert [r["proxy_snapshot_items"] for r in s["restarts"]["disk"]] == [IMAGES]
    assert [r["proxy_snapshot_items"] for r in s["restarts"]["nodisk"]] == [0]
    assert s["items_encoded_after_restart"] == {"disk": [0], "nodisk": [IMAGES]}
    assert s["served_by"]["after_disk"]["disk_hits"][0] >= IMAGES
    # every repeat was a get the encoder served, none answered by the decoder's embedding or prefix cache
    for p in PASSES:
        by = s["served_by"][p]
        assert by["gets_served"] == by["decoder_remote_fetches"] == [IMAGES], p
        assert by["decoder_cache_hits"] == by["decoder_prefix_tokens_saved"] == [0], p
    assert s["every_repeat_from_encoder"] and s["served_by"]["before"]["items_encoded"] == [0]
    assert s["served_by"]["after_disk"]["proxy_items_skipped"] == [IMAGES]  # the proxy knew: no /encode call
    assert s["served_by"]["after_nodisk"]["proxy_items_scheduled"] == [IMAGES]
    assert "target <= 1.5" in report(s)


@pytest.mark.parametrize("bad", [["--images", "0"], ["--rounds", "0"]])
def test_bad_flags_are_usage_errors(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(bad)
    assert exc.value.code == 2
