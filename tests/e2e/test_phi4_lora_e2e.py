"""Phi-4-multimodal's speech adapter end to end (decoder_service/lora_defaults.py): a decoder on a checkpoint that
ships speech-lora/ answers an audio request under it without being asked, token for token as the same adapter named
by `model` (--lora-modules), and differently from the base model (--default-mm-loras '{}'); /v1/models lists the
base model and the named adapter only. (That the adapter's answer is transformers' with the adapter loaded by PEFT is
tests/models/test_phi4_shipped_lora.py.)"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from epd_builders.audio_tiny import AudioTinySpec, build_audio_tiny
from epd_common.lora_flags import LoRAModule
from tests.audio_clips import make_audio
from tests.e2e.answers import aggregated, tokens
from tests.e2e.audio_stack import answer, input_audio

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("phi4-lora-e2e")
    return build_audio_tiny(AudioTinySpec(family="phi4_multimodal", lm_scale=3.0, shipped_loras=True), root / "phi4")


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[tuple[str, str]]:
    """(by default: its adapters, plus the speech one named "speech"; with --default-mm-loras '{}')"""
    named = (LoRAModule("speech", str(model_dir / "speech-lora")),)
    with aggregated(model_dir, enable_lora=True, lora_modules=named) as on, \
            aggregated(model_dir, default_mm_loras=()) as off:
        yield on, off


def test_audio_runs_under_the_checkpoints_speech_adapter_by_default(served: tuple[str, str],
                                                                     model_dir: Path) -> None:
    on, off = served
    clip = input_audio(make_audio("wav", seconds=2.0, rate=16_000, channels=1, freq=350.0))
    by_default = answer(on, model_dir.name, clip)
    named = answer(on, "speech", clip)
    base = answer(off, model_dir.name, clip)
    assert tokens(by_default) == tokens(named) != tokens(base)
    again = answer(on, model_dir.name, clip)  # its prefix blocks are the adapter's: reused under it
    assert tokens(again) == tokens(by_default) and again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    text = {"type": "text", "text": "hello"}  # no audio: the base model's answer on both
    assert tokens(answer(on, model_dir.name, text)) == tokens(answer(off, model_dir.name, text))
    listed = httpx.get(f"{on}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in listed] == [model_dir.name, "speech"]
