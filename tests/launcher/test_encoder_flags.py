"""The launcher's encoder flags: each spawned encoder gets the scheduler, admission and disk-tier flags given on
the command line (and no decoder does); each encoder gets a disk folder of its own, the same at every restart."""
from __future__ import annotations

from pathlib import Path

import pytest

from encoder_service.cli import parse_args as encoder_args
from encoder_service.config import EncoderConfig
from tests.launcher.test_cli import spawned_workers


def encoder_configs(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> tuple[list[EncoderConfig], list[list[str]]]:
    workers = spawned_workers(monkeypatch, argv)
    encoders = [extra for role, extra in workers if role == "encoder"]
    configs = [encoder_args([a for a in extra if a != "--device" and not a.startswith("cuda:")]) for extra in encoders]
    return configs, [extra for role, extra in workers if role == "decoder"]


def test_the_encode_scheduler_flags_reach_every_spawned_encoder_and_no_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    configs, decoders = encoder_configs(monkeypatch, [
        "--num-encoders", "2", "--max-encode-batch-items", "8", "--max-encode-batch-tokens", "999",
        "--max-pending-encode-tokens", "5000", "--max-ungathered-bytes", "64MiB"])
    assert len(configs) == 2
    for cfg in configs:
        assert (cfg.max_encode_batch_items, cfg.max_encode_batch_tokens, cfg.max_pending_encode_tokens,
                cfg.max_ungathered_bytes) == (8, 999, 5000, 64 << 20)
    assert not [a for extra in decoders for a in extra if "encode-batch" in a or "ungathered" in a]


def test_each_encoder_gets_a_disk_folder_of_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    configs, decoders = encoder_configs(monkeypatch, ["--num-encoders", "2", "--ec-disk-dir", "tier",
                                                      "--ec-disk-bytes", "2GiB"])
    assert [cfg.ec_disk_dir for cfg in configs] == [str(tmp_path / "tier" / f"encoder-{i}") for i in range(2)]
    assert all(cfg.ec_disk_bytes == 2 << 30 for cfg in configs)
    assert not [a for extra in decoders for a in extra if a.startswith("--ec-disk")]
    configs, _ = encoder_configs(monkeypatch, ["--num-encoders", "1"])
    assert configs[0].ec_disk_dir is None  # memory only unless asked


@pytest.mark.parametrize("argv", [["--ec-disk-bytes", "0"], ["--max-ungathered-bytes", "0"],
                                  ["--ec-disk-bytes", "lots"]])
def test_byte_flags_must_be_sizes_of_at_least_one_byte(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        encoder_args(["--model", "demo", "--insecure", *argv])
    assert exit_info.value.code == 2 and argv[0] in capsys.readouterr().err
