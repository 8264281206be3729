"""A torchvision-free stand-in for transformers' PixtralProcessor (Mistral 3), whose module imports torchvision.

It writes the same prompt tokens as the stock one: per image, rows of `[IMG]` x columns, each row ended by
`[IMG_BREAK]`, the last by `[IMG_END]`, one `[IMG]` per (patch x merge)^2 pixels of the resized image.
"""
from __future__ import annotations

from typing import Any

from transformers.processing_utils import ProcessorMixin


class PixtralProcessorPil(ProcessorMixin):
    # the stock class's defaults: tensors unless the caller asks otherwise
    text_kwargs = {"return_tensors": "pt"}
    images_kwargs = {"return_tensors": "pt"}

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, patch_size: int = 16,
                 spatial_merge_size: int = 1, chat_template: Any = None, image_token: str = "[IMG]",
                 image_break_token: str = "[IMG_BREAK]", image_end_token: str = "[IMG_END]", **kwargs: Any) -> None:
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.patch_size, self.spatial_merge_size = patch_size, spatial_merge_size
        self.image_token, self.image_break_token, self.image_end_token = image_token, image_break_token, image_end_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        self.image_break_token_id = tokenizer.convert_tokens_to_ids(image_break_token)
        self.image_end_token_id = tokenizer.convert_tokens_to_ids(image_end_token)
        self.image_token_ids = [self.image_token_id, self.image_break_token_id, self.image_end_token_id]

    def _process_images(self, images: Any, **images_kwargs: Any) -> Any:
        images_kwargs["patch_size"] = self.patch_size * self.spatial_merge_size  # resize to whole merged patches
        return super()._process_images(images, **images_kwargs)

    def replace_image_token(self, image_inputs: Any, image_idx: int, **kwargs: Any) -> str:
        unit = self.patch_size * self.spatial_merge_size
        h, w = image_inputs["image_sizes"][image_idx]
        rows = [self.image_token * (int(w) // unit) + self.image_break_token] * (int(h) // unit)
        return "".join(rows)[: -len(self.image_break_token)] + self.image_end_token

    @property
    def model_input_names(self) -> list[str]:
        return list(self.tokenizer.model_input_names) + list(self.image_processor.model_input_names) + ["image_sizes"]
