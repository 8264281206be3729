"""Image-only processors for the families whose stock processor cannot be built here, and `load_processor`.

Without torchvision (only CUDA builds of it exist for this platform, and they break AutoProcessor) every video
processor fails, and the stock processors of Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision and InternVL demand
one; Pixtral's (Mistral 3) imports torchvision outright (epd_models/pixtral_processor.py replaces it). The
subclasses below keep every image path of the stock class and only skip the video processor.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from transformers import (
    AutoConfig,
    AutoProcessor,
    InternVLConfig,
    LlavaOnevisionConfig,
    Mistral3Config,
    Qwen2_5_VLConfig,
    Qwen2VLConfig,
    Qwen3VLConfig,
    Qwen3VLMoeConfig,
)
from transformers.models.internvl.processing_internvl import InternVLProcessor
from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin

from epd_models.audio_processors import AUDIO_ONLY
from epd_models.pixtral_processor import PixtralProcessorPil


def _token(tokenizer: Any, attr: str, default: str) -> tuple[str, int]:
    text = getattr(tokenizer, attr, None) or default
    return text, tokenizer.convert_tokens_to_ids(text)


def _qwen_init(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
               **kwargs: Any) -> None:
    # NOTE: the stock __init__ demands a video processor, which needs torchvision; the
    # sub-processor list comes from this signature, so images + tokenizer only.
    self.image_token, self.image_token_id = _token(tokenizer, "image_token", "<|image_pad|>")
    self.video_token, self.video_token_id = _token(tokenizer, "video_token", "<|video_pad|>")
    self.vision_start_token, self.vision_start_token_id = _token(tokenizer, "vision_start_token", "<|vision_start|>")
    self.vision_end_token, self.vision_end_token_id = _token(tokenizer, "vision_end_token", "<|vision_end|>")
    ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


class Qwen2VLImageProcessorOnly(Qwen2VLProcessor):
    __init__ = _qwen_init


class Qwen2_5_VLImageProcessorOnly(Qwen2_5_VLProcessor):
    __init__ = _qwen_init


class Qwen3VLImageProcessorOnly(Qwen3VLProcessor):
    __init__ = _qwen_init


class LlavaOnevisionImageProcessorOnly(LlavaOnevisionProcessor):
    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                 num_image_tokens: int | None = None, vision_feature_select_strategy: str | None = None,
                 image_token: str = "<image>", video_token: str = "<video>",
                 vision_aspect_ratio: str = "anyres_max_9", **kwargs: Any) -> None:
        self.num_image_tokens, self.vision_feature_select_strategy = num_image_tokens, vision_feature_select_strategy
        self.vision_aspect_ratio = vision_aspect_ratio
        self.image_token, self.image_token_id = _token(tokenizer, "image_token", image_token)
        self.video_token, self.video_token_id = _token(tokenizer, "video_token", video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


class InternVLImageProcessorOnly(InternVLProcessor):
    def __init__(self, image_processor: Any = None, tokenizer: Any = None, image_seq_length: int = 256,
                 chat_template: Any = None, **kwargs: Any) -> None:
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
        self.image_seq_length = image_seq_length
        self.start_image_token, self.end_image_token = tokenizer.start_image_token, tokenizer.end_image_token
        self.start_image_token_id, self.end_image_token_id = tokenizer.start_image_token_id, tokenizer.end_image_token_id
        self.image_token, self.video_token = tokenizer.context_image_token, tokenizer.video_token
        self.image_token_id = tokenizer.context_image_token_id
        self.multimodal_pattern = re.compile(
            f"(?P<image>{re.escape(self.image_token)})|(?P<video>{re.escape(self.video_token)})")


# model config class -> the processor EPD builds for it (the others: AutoProcessor's own choice)
IMAGE_ONLY: dict[type, Any] = {
    Qwen2VLConfig: Qwen2VLImageProcessorOnly,
    Qwen2_5_VLConfig: Qwen2_5_VLImageProcessorOnly,
    Qwen3VLConfig: Qwen3VLImageProcessorOnly,
    Qwen3VLMoeConfig: Qwen3VLImageProcessorOnly,  # its hub checkpoints name Qwen3VLProcessor too
    LlavaOnevisionConfig: LlavaOnevisionImageProcessorOnly,
    InternVLConfig: InternVLImageProcessorOnly,
    Mistral3Config: PixtralProcessorPil,
}


def register_processors() -> None:
    """Make AutoProcessor return the image-only processors (otherwise it returns a bare tokenizer or raises)."""
    for config_cls, processor_cls in {**IMAGE_ONLY, **AUDIO_ONLY}.items():
        AutoProcessor.register(config_cls, processor_cls, exist_ok=True)


def load_processor(model_dir: str | Path) -> Any:
    """The checkpoint's processor. A real checkpoint names the stock class (`Qwen3VLProcessor`, `PixtralProcessor`)
    in processor_config.json, which AutoProcessor would build and fail on; the image-only class is built
    directly from the same files instead."""
    cfg = AutoConfig.from_pretrained(model_dir)
    cls = IMAGE_ONLY.get(type(cfg)) or AUDIO_ONLY.get(type(cfg))
    return cls.from_pretrained(model_dir) if cls is not None else AutoProcessor.from_pretrained(model_dir)
