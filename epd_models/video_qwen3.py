"""Qwen3-VL's video prompt layout: a time stamp and its own <|vision_start|>...<|vision_end|> group per temporal patch.

`Qwen3VLProcessor.replace_video_token` (transformers/models/qwen3_vl/processing_qwen3_vl.py) writes, in place of
the prompt's <|video_pad|>, for each temporal patch k of the video: f"<{time_k:.1f} seconds>", <|vision_start|>,
grid_h * grid_w / merge**2 <|video_pad|> tokens and <|vision_end|>. time_k is `_calculate_timestamps`: the
sampled frames' indices padded (the last repeated) to whole temporal patches, each index / the video's fps, and
the mean of the first and last frame time of each patch. Here the times come in (`frame_times`, index / fps),
so a chunk of the video (whole temporal patches, only the last padded) gets exactly its patches' groups, and the
chunks' spans concatenated are the whole video's.

The span is the item's `span` (ImageFeatures): the decoder splices it in place of the video placeholder, its
<|video_pad|> positions take the rows, and its M-RoPE positions treat each group as an image of one temporal
patch (epd_models/qwen3_vl.py). A time stamp is text between two special tokens, so it tokenizes alone as it
does inside the prompt.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def patch_times(frame_times: Sequence[float], temporal_patch_size: int) -> list[float]:
    """Each temporal patch's time: `_calculate_timestamps` on times instead of indices (the last time repeated up
    to whole patches, then the mean of each patch's first and last)."""
    t = temporal_patch_size
    times = list(frame_times)
    times.extend(times[-1] for _ in range(-len(times) % t))
    return [(times[i] + times[i + t - 1]) / 2 for i in range(0, len(times), t)]


def video_span(processor: Any, frame_times: Sequence[float], temporal_patch_size: int,
               tokens_per_patch: int) -> tuple[int, ...]:
    """The token ids Qwen3-VL's processor writes for these frames (one group per temporal patch)."""
    tok = processor.tokenizer
    start, end, pad = processor.vision_start_token_id, processor.vision_end_token_id, processor.video_token_id
    span: list[int] = []
    for time in patch_times(frame_times, temporal_patch_size):
        span.extend(tok(f"<{time:.1f} seconds>", add_special_tokens=False)["input_ids"])
        span.extend([start, *[pad] * tokens_per_patch, end])
    return tuple(span)
