"""disagg-epd-proxy's LoRA flags: --enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras, --default-mm-loras
and --lora-modules (each item checked as epd-decoder checks it, then passed as given) reach every spawned decoder and
prefill worker, and --enable-lora, --lora-modules and --max-lora-rank every encoder (for the adapters' vision-tower
weights); a malformed item is a usage error before anything starts."""
from __future__ import annotations

import pytest

from epd_common.lora_flags import LoRAModule
from tests.launcher.test_speculative_config import spawned

JSON_ITEM = '{"name": "b", "path": "/adapters/b", "base_model_name": "demo"}'


def test_every_decoder_and_prefill_worker_gets_the_lora_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from decoder_service.cli import parse_args as decoder_args
    from encoder_service.cli import parse_args as encoder_args

    workers = spawned(monkeypatch, ["--num-decoders", "2", "--num-prefills", "1", "--enable-lora", "--max-loras", "2",
                                    "--max-lora-rank", "32", "--lora-modules", "a=/adapters/a", JSON_ITEM,
                                    "--enable-lora-runtime-updating", "--allowed-lora-dir", "/adapters",
                                    "--default-mm-loras", '{"audio": "/adapters/speech"}'])
    for kind, extra in workers:
        if kind == "encoder":  # the adapters' vision-tower weights are the encoders' (encoder_service/lora.py)
            enc = encoder_args(extra)
            assert enc.enable_lora and enc.max_lora_rank == 32
            assert enc.lora_modules == (LoRAModule("a", "/adapters/a"), LoRAModule("b", "/adapters/b", "demo"))
            continue
        cfg = decoder_args(extra)
        assert cfg.enable_lora and cfg.max_loras == 2 and cfg.max_lora_rank == 32
        assert cfg.enable_lora_runtime_updating and cfg.allowed_lora_dir == "/adapters"
        assert cfg.lora_modules == (LoRAModule("a", "/adapters/a"), LoRAModule("b", "/adapters/b", "demo"))
        assert cfg.default_mm_loras == (("audio", "/adapters/speech"),)


def test_not_given_nothing_is_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not [a for _, extra in spawned(monkeypatch, []) for a in extra if "lora" in a]


@pytest.mark.parametrize("item", ["a", "=/p", '{"name": "a"}'])
def test_a_malformed_item_is_a_usage_error(item: str, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from epd_launcher.flags import parse_args

    monkeypatch.setenv("EPD_INSECURE", "1")
    with pytest.raises(SystemExit) as refused:
        parse_args(["--enable-lora", "--lora-modules", item])
    assert refused.value.code == 2 and "argument --lora-modules: " in capsys.readouterr().err


def test_a_malformed_default_mm_loras_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from epd_launcher.flags import parse_args

    monkeypatch.setenv("EPD_INSECURE", "1")
    with pytest.raises(SystemExit) as refused:
        parse_args(["--default-mm-loras", '{"speech": "/a"}'])
    assert refused.value.code == 2 and "argument --default-mm-loras: " in capsys.readouterr().err
