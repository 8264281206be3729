"""Chat messages -> token ids with each image (video, audio) placeholder replaced by the item's span (its family's
tokens; an audio clip's: its audio token once per row)."""
from __future__ import annotations

import torch

from decoder_service.engine.work import Prompt
from epd_contracts.embeddings import ImageFeatures
from epd_models.halves import LanguageHalf
from epd_models.splice import splice_media


def build_prompt(lm: LanguageHalf, ids: list[int], images: list[ImageFeatures]) -> Prompt:
    """`images`: the prompt's images and videos in the order of their placeholders (a video's is the family's
    video token, e.g. Qwen's <|video_pad|>, which the chat template writes between <|vision_start|> and
    <|vision_end|>); ValueError when they do not match the placeholders or the model takes no video. A video's sound
    track (`in_video`, right after its video) has no placeholder of its own: the family's span for the two
    (Qwen2.5-Omni: their rows interleaved by 2 s) takes the video's placeholder."""
    if any(im.is_video for im in images) and lm.video_token_id is None:
        raise ValueError("this model takes no video input")
    if any(im.audio for im in images) and lm.audio_token_id is None:
        raise ValueError("this model takes no audio input")
    spans: list[list[int] | tuple[int, ...]] = []
    kinds: list[str] = []
    for k, im in enumerate(images):
        if im.in_video:  # a video's sound track: its tokens are in the video's span, the template wrote no placeholder
            if k == 0 or not images[k - 1].is_video or images[k - 1].in_video:
                raise ValueError(f"item {k} is a video's sound track but does not follow a video")
            continue
        if im.is_video and k + 1 < len(images) and images[k + 1].in_video:
            spans.append(lm.adapter.video_track_span(lm.config, im, images[k + 1]))
        else:
            spans.append(im.span if im.span is not None else [_token(lm, im)] * im.num_tokens)
        kinds.append("audio" if im.audio else "video" if im.is_video else "image")
    expanded = splice_media(ids, lm.placeholder_id, lm.video_token_id, spans, kinds, lm.audio_token_id)
    return Prompt(input_ids=torch.tensor([expanded], dtype=torch.long), images=images)


def _token(lm: LanguageHalf, item: ImageFeatures) -> int:
    if item.audio and lm.audio_token_id is not None:
        return lm.audio_token_id
    return lm.video_token_id if item.is_video and lm.video_token_id is not None else lm.image_token_id
