"""Processors for the audio families whose stock processor cannot be built here (no torchvision).

Qwen2.5-Omni's processor demands a video processor and Phi-4-multimodal's an image processor that imports
torchvision outright; the subclasses below keep every audio (and, for Omni, image) path of the stock class and
only skip what needs torchvision, as epd_models/processors.py does for the image families. Qwen2-Audio's stock
processor needs nothing more (WhisperFeatureExtractor runs on numpy or torch).

`epd_models.processors` registers them with the image-only ones (`register_processors`, `load_processor`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoProcessor
from transformers.models.phi4_multimodal.configuration_phi4_multimodal import Phi4MultimodalConfig
from transformers.models.phi4_multimodal.processing_phi4_multimodal import Phi4MultimodalProcessor
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniConfig, Qwen2_5OmniThinkerConfig
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor
from transformers.processing_utils import ProcessorMixin


class Qwen2_5OmniImageAudioProcessor(Qwen2_5OmniProcessor):
    """Qwen2.5-Omni's processor for images and audio: no video processor (its video path needs torchvision)."""

    def __init__(self, image_processor: Any = None, feature_extractor: Any = None, tokenizer: Any = None,
                 chat_template: Any = None, **kwargs: Any) -> None:
        # NOTE: the sub-processor list comes from this signature (as epd_models/processors.py's _qwen_init)
        ProcessorMixin.__init__(self, image_processor, feature_extractor, tokenizer, chat_template=chat_template)
        for name in ("image_token", "audio_token", "video_token", "image_token_id", "audio_token_id",
                     "video_token_id", "vision_bos_token", "vision_eos_token", "audio_bos_token", "audio_eos_token"):
            setattr(self, name, getattr(tokenizer, name))

    @property
    def model_input_names(self) -> list[str]:
        names = [*self.tokenizer.model_input_names, *self.feature_extractor.model_input_names,
                 *self.image_processor.model_input_names, "feature_attention_mask"]
        return list(dict.fromkeys(names))


class Phi4MultimodalAudioProcessor(Phi4MultimodalProcessor):
    """Phi-4-multimodal's processor for audio: no image processor (the only one transformers has imports
    torchvision)."""

    def __init__(self, audio_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                 **kwargs: Any) -> None:
        self.image_token, self.image_token_id = tokenizer.image_token, tokenizer.image_token_id
        self.audio_token, self.audio_token_id = tokenizer.audio_token, tokenizer.audio_token_id
        ProcessorMixin.__init__(self, audio_processor, tokenizer, chat_template=chat_template)


AUDIO_ONLY: dict[type, Any] = {
    Qwen2_5OmniConfig: Qwen2_5OmniImageAudioProcessor,  # the hub's composite checkpoints (thinker, talker)
    Qwen2_5OmniThinkerConfig: Qwen2_5OmniImageAudioProcessor,
    Phi4MultimodalConfig: Phi4MultimodalAudioProcessor,
}


def register_audio_processors() -> None:
    """Make AutoProcessor return the processors above for these configs (otherwise it raises)."""
    for config_cls, processor_cls in AUDIO_ONLY.items():
        AutoProcessor.register(config_cls, processor_cls, exist_ok=True)


def load_audio_processor(model_dir: str | Path) -> Any:
    """The checkpoint's processor, built from the class above where a stock one would name torchvision."""
    cls = AUDIO_ONLY.get(type(AutoConfig.from_pretrained(model_dir)))
    return cls.from_pretrained(model_dir) if cls is not None else AutoProcessor.from_pretrained(model_dir)
