"""The prompt's media placeholders and what replaces them: each item's token span spliced in at its placeholder, in
prompt order (`splice_media`), and the items' embedding rows scattered into their tokens' rows (`merge_image_embeds`).
Both halves use it: the decoder renders the prompt, the aggregated path and the builders expand it the same way."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from epd_contracts.embeddings import ImageFeatures


def expand_placeholders(ids: list[int], image_token_id: int, counts: list[int]) -> list[int]:
    """Replace the i-th single image placeholder with counts[i] copies."""
    return splice_spans(ids, image_token_id, [[image_token_id] * n for n in counts])


def splice_spans(ids: list[int], placeholder_id: int, spans: Sequence[Sequence[int]]) -> list[int]:
    """Replace the i-th image placeholder with spans[i]."""
    return splice_media(ids, placeholder_id, None, spans, [False] * len(spans))


def splice_media(ids: list[int], placeholder_id: int, video_placeholder_id: int | None,
                 spans: Sequence[Sequence[int]], is_video: Sequence[bool | str],
                 audio_placeholder_id: int | None = None) -> list[int]:
    """Replace the prompt's image, video (and audio) placeholders, in prompt order, with the items' spans: the i-th
    placeholder takes spans[i], and it must be of item i's kind (is_video[i]: True or "video", False or "image",
    "audio"). The items' order is the prompt's, which is also the order their rows are merged and their M-RoPE grids
    are read in."""
    marks = {placeholder_id: "image"}
    if video_placeholder_id is not None:
        marks[video_placeholder_id] = "video"
    if audio_placeholder_id is not None:
        marks[audio_placeholder_id] = "audio"
    found = [marks[tok] for tok in ids if tok in marks]
    given = [_kind(k) for k in is_video]
    if found != given:
        order = " (in another order)" if sorted(found) == sorted(given) else ""
        raise ValueError(f"prompt has {_count(found, ' placeholders')} but {_count(given, 's')} were given{order}")
    out: list[int] = []
    it = iter(spans)
    for tok in ids:
        if tok in marks:
            out.extend(next(it))
        else:
            out.append(tok)
    return out


def _kind(k: bool | str) -> str:
    return k if isinstance(k, str) else "video" if k else "image"


def _count(kinds: Sequence[str], suffix: str) -> str:
    """"2 images and 1 video" / "2 image placeholders and 1 audio placeholder": always the images first."""
    parts = [f"{sum(1 for k in kinds if k == 'image')} image{suffix}"]
    parts += [f"{n} {kind}{suffix}" for kind in ("video", "audio") if (n := sum(1 for k in kinds if k == kind))]
    return " and ".join(parts)


def merge_image_embeds(
    inputs_embeds: torch.Tensor, input_ids: torch.Tensor, image_token_id: int, images: list[ImageFeatures],
    video_token_id: int | None = None, audio_token_id: int | None = None,
) -> torch.Tensor:
    """Scatter image (video, audio) embeddings into the image-token (video-, audio-token) rows of inputs_embeds
    (1, L, H).

    The items are in prompt order (splice_media), so the rows of each kind, in item order, are its tokens' in prompt
    order: one scatter per token id puts every row where it belongs, also where a video's sound track interleaves
    its rows with the video's (Qwen2.5-Omni's use_audio_in_video), as the model's own scatters per kind do.
    input_ids and the features may be host tensors (the features come from the connector in CPU memory): the checks
    run where the ids are, and each mask and its features move to inputs_embeds' device in one copy each.
    """
    if not images:
        return inputs_embeds
    groups: dict[int, list[torch.Tensor]] = {}
    for im in images:
        kind = "audio" if im.audio else "video" if im.is_video else "image"
        token_id = {"image": image_token_id, "video": video_token_id, "audio": audio_token_id}[kind]
        assert token_id is not None, f"{kind} features for a model without a {kind} token"
        groups.setdefault(token_id, []).append(im.embeds)
    for missing in (image_token_id, video_token_id, audio_token_id):
        if missing is not None and missing not in groups:
            assert int((input_ids == missing).sum()) == 0, "media tokens without their features"
    for token_id, rows in groups.items():
        feats = torch.cat(rows) if len(rows) > 1 else rows[0]
        is_kind = input_ids == token_id
        assert int(is_kind.sum()) == feats.shape[0], "placeholder count != media tokens"
        mask = is_kind.to(inputs_embeds.device, non_blocking=True).unsqueeze(-1).expand_as(inputs_embeds)
        inputs_embeds = inputs_embeds.masked_scatter(mask, feats.to(inputs_embeds.device, inputs_embeds.dtype,
                                                                    non_blocking=True))
    return inputs_embeds
