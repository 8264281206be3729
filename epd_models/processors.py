"""Processors the tests and builders need that transformers cannot construct without torchvision."""
from __future__ import annotations

from typing import Any

from transformers import AutoProcessor, Qwen2_5_VLConfig, Qwen2VLConfig
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin


def _image_only_init(self: Any, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None) -> None:
    # NOTE: the stock __init__ demands a video processor, which needs torchvision; the
    # sub-processor list comes from this signature, so images + tokenizer only.
    self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
    self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
    self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
    self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
    ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


class Qwen2VLImageProcessorOnly(Qwen2VLProcessor):
    __init__ = _image_only_init


class Qwen2_5_VLImageProcessorOnly(Qwen2_5_VLProcessor):
    __init__ = _image_only_init


def register_processors() -> None:
    """Make AutoProcessor return the image-only Qwen processors (otherwise it returns a bare tokenizer)."""
    AutoProcessor.register(Qwen2VLConfig, Qwen2VLImageProcessorOnly, exist_ok=True)
    AutoProcessor.register(Qwen2_5_VLConfig, Qwen2_5_VLImageProcessorOnly, exist_ok=True)
