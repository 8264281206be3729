"""One image's (or video's) embeddings: what a vision half returns, the connector carries and the LM merges.

Torch-free at import (the tensor type is named for the type checker only), so the contracts package stays
importable by the proxy. The key an item is stored under (its mm_hash) travels beside it, never inside it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SPAN_ID_BYTES = 8  # what one span id is counted as in cache and reply byte budgets (a Python int, near enough)


@dataclass(frozen=True, eq=False)
class ImageFeatures:
    """One image's embeddings as the LM consumes them, and the tokens it takes in the prompt.

    `span` is the image's token ids as its family's processor writes them in place of the prompt's one image
    placeholder (LLaVA-NeXT's any-resolution tokens, InternVL's `<img>`...`</img>`, Pixtral's `[IMG_BREAK]`
    rows, Idefics3's `<row_i_col_j>` tiles, Gemma 3's `<start_of_image>`...`<end_of_image>`); its image-token
    positions take the rows of `embeds` in order. None: `num_tokens` image tokens (LLaVA-1.5, Qwen2-VL).

    A video is the same item with `second_per_grid_t` set (epd_models/video.py): its rows go to the family's
    video token instead, in place of the prompt's one video placeholder. Qwen2-VL / Qwen2.5-VL: span None
    (`num_tokens` video tokens), `grid_thw` with t temporal patches, and Qwen2.5-VL spaces their M-RoPE temporal
    positions by `second_per_grid_t`. Qwen3-VL: a span with a `<t seconds>` time stamp and a vision group per
    temporal patch. LLaVA-OneVision: `grid_thw` None, `second_per_grid_t` = 1 / fps. A video encoded in chunks is
    its chunks' items concatenated (decoder_service/video_gather.py).

    An audio clip (or a chunk of its encoder windows) is the same item with `audio` set: span None, its rows go to
    the family's audio token, which is also the prompt's one placeholder per clip (epd_models/audio.py). The flag
    does not travel on the connector: the decoder sets it from its request's ImageRef.audio (the hash says the
    rest: an audio hash never equals an image's).
    """

    embeds: torch.Tensor  # (num_tokens, text_hidden), any device until a producer saves it (then CPU)
    grid_thw: tuple[int, int, int] | None = None  # Qwen only: patch grid before merging
    span: tuple[int, ...] | None = None
    # Qwen3-VL: (K, num_tokens, text_hidden), the features added after LM layers 0..K-1 at the image's positions
    deepstack: torch.Tensor | None = None
    # videos only: the seconds one temporal patch spans (temporal_patch_size / sampled fps); None: an image
    second_per_grid_t: float | None = None
    audio: bool = False  # an audio clip's rows (see above)
    in_video: bool = False  # audio only: the sound track of the video item just before it (ImageRef.in_video)

    def __post_init__(self) -> None:
        if getattr(self.embeds, "dim", None) is None or self.embeds.dim() < 1:
            raise ValueError(f"embeds must be a tensor with at least 1 dim, got {type(self.embeds).__name__}")
        if self.grid_thw is not None and len(self.grid_thw) != 3:
            raise ValueError(f"grid_thw must have 3 ints, got {self.grid_thw!r}")
        if self.deepstack is not None and getattr(self.deepstack, "dim", None) is None:
            raise ValueError(f"deepstack must be a tensor, got {type(self.deepstack).__name__}")
        spg = self.second_per_grid_t
        if spg is not None and not (isinstance(spg, (int, float)) and math.isfinite(spg) and spg > 0):
            raise ValueError(f"second_per_grid_t must be a finite number > 0, got {spg!r}")
        if self.audio and (spg is not None or self.grid_thw is not None or self.deepstack is not None):
            raise ValueError("an audio clip's features have no grid, DeepStack features or seconds per patch")
        if self.in_video and not self.audio:
            raise ValueError("only an audio clip's features can be a video's sound track")

    @property
    def is_video(self) -> bool:
        return self.second_per_grid_t is not None

    @property
    def audio_shaped(self) -> bool:
        """Rows alone, as an audio clip's are on the wire (no grid, span, DeepStack rows or seconds per patch)."""
        return self.grid_thw is None and self.span is None and self.deepstack is None and self.second_per_grid_t is None

    @property
    def num_tokens(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def nbytes(self) -> int:
        """Everything the item holds: embeddings, DeepStack features and span (what caches and replies count)."""
        extra = int(self.deepstack.nbytes) if self.deepstack is not None else 0
        return int(self.embeds.nbytes) + extra + SPAN_ID_BYTES * len(self.span or ())

    def with_tensors(self, embeds: torch.Tensor, deepstack: torch.Tensor | None) -> ImageFeatures:
        """The same item over other tensors (moved or made contiguous)."""
        return ImageFeatures(embeds=embeds, grid_thw=self.grid_thw, span=self.span, deepstack=deepstack,
                             second_per_grid_t=self.second_per_grid_t, audio=self.audio, in_video=self.in_video)

    def as_audio(self, in_video: bool = False) -> ImageFeatures:
        """The same rows marked as an audio clip's (what a decoder does with a gathered audio item), `in_video`: as
        the sound track of the video before it."""
        if self.audio and self.in_video == in_video:
            return self
        return ImageFeatures(embeds=self.embeds, span=self.span, audio=True, in_video=in_video)
