"""Phi-4-multimodal's own adapters (decoder_service/lora_defaults.py): a checkpoint with speech-lora/ and
vision-lora/ beside its weights serves audio requests under the speech adapter by default, exactly as transformers
answers with that adapter loaded by PEFT; --default-mm-loras '{}' serves the base model; the adapters are the
checkpoint's (not listed, not unloadable, their names not for --lora-modules)."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from decoder_service.config import DecoderConfig
from decoder_service.lora import attach_loras, check_lora_flags
from decoder_service.lora_defaults import default_folders, default_for, mm_loras_argument
from epd_builders.audio_tiny import AudioTinySpec, build_audio_tiny
from epd_common.lora_flags import LoRAModule
from epd_common.startup import ConfigError
from epd_contracts.audio import AudioPart
from epd_contracts.generate import ImageRef
from epd_models.audio import AudioClip
from tests.decoder_service.test_video_assembly import PART
from tests.models.test_audio_phi4 import Halves, tone

SPEECH, VISION = "default-mm:audio", "default-mm:image"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("phi4-lora")
    return build_audio_tiny(AudioTinySpec(family="phi4_multimodal", lm_scale=3.0, shipped_loras=True), root / "phi4")


def with_speech_adapter(model: torch.nn.Module, model_dir: Path) -> torch.nn.Module:
    """transformers' model with the checkpoint's speech adapter loaded by PEFT (as Phi-4's model card does)."""
    from peft import PeftModel

    with warnings.catch_warnings():  # PEFT reads transformers' deprecated is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        return PeftModel.from_pretrained(model, model_dir / "speech-lora").eval()


def test_the_checkpoints_adapters_load_by_default_and_are_not_listed(model_dir: Path) -> None:
    phi4 = Halves(model_dir)
    lora = attach_loras(phi4.lm, DecoderConfig())
    assert lora is not None and lora.defaults == {"image": VISION, "audio": SPEECH}
    assert lora.describe() == []  # /health lists nothing: /v1/models shows the base model alone
    assert {a.name: a.rank for a in lora.loaded.values()} == {VISION: 4, SPEECH: 8}
    off = Halves(model_dir)
    assert attach_loras(off.lm, DecoderConfig(default_mm_loras=())) is None
    assert default_folders(model_dir, (("audio", "speech-lora"), ("image", "nowhere")), None) == {
        "audio": model_dir / "speech-lora"}


@pytest.mark.parametrize("seconds", [(1.3,), (2.5, 2.5)], ids=["one-clip", "two-clips"])
def test_audio_under_the_speech_adapter_answers_as_transformers_with_it(model_dir: Path,
                                                                       seconds: tuple[float, ...]) -> None:
    phi4 = Halves(model_dir)
    lora = attach_loras(phi4.lm, DecoderConfig())
    assert lora is not None
    clips = [tone(s, 300.0 + 200 * i) for i, s in enumerate(seconds)]
    items = phi4.vision.encode_audios([AudioClip(c) for c in clips])
    base = phi4.reference(clips)
    phi4.ours(items).check(base)  # slot 0: the base model, unchanged beside the adapters
    phi4.model = with_speech_adapter(phi4.model, model_dir)
    want = phi4.reference(clips)
    assert want.tokens != base.tokens, "the adapter changes the answer (else this proves little)"
    phi4.ours(items, lora=lora.slot(SPEECH)).check(want)


def test_a_request_takes_its_modalitys_adapter_unless_it_names_one() -> None:
    defaults = {"image": VISION, "audio": SPEECH}
    audio = ImageRef(mm_hash="a", audio=AudioPart(sample_rate=16_000))
    image = ImageRef(mm_hash="i")
    video = ImageRef(mm_hash="v", video=PART)
    assert default_for(defaults, [audio]) == SPEECH
    assert default_for(defaults, [audio, image]) == VISION  # Phi-4's rule: an image beside speech takes vision
    assert default_for(defaults, []) == "" and default_for(defaults, [video]) == ""
    assert default_for({}, [audio]) == ""
    assert default_for({"video": "v"}, [ImageRef(mm_hash="t", audio=AudioPart(sample_rate=16_000),
                                                 in_video=True)]) == "v"


@pytest.mark.parametrize("value", ['{"speech": "/x"}', '["audio"]', '{"audio": ""}', "{audio", '{"audio": 3}'])
def test_a_malformed_default_mm_loras_is_refused(value: str) -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="--default-mm-loras"):
        mm_loras_argument(value)


def test_the_defaults_names_are_reserved(model_dir: Path) -> None:
    assert mm_loras_argument('{"audio": "/a", "image": "/i"}') == (("image", "/i"), ("audio", "/a"))
    with pytest.raises(ConfigError, match="default-mm:"):
        check_lora_flags(DecoderConfig(enable_lora=True, lora_modules=(LoRAModule(SPEECH, str(model_dir)),)))
