"""A request's images, videos and audio clips from the connector: one gather of every image, video chunk and audio
chunk, each video then assembled from its chunks in order (epd_contracts/video.py), each clip from its chunks'
rows in order (epd_contracts/audio.py), marked as audio.

A video's ImageRef names its chunks (`chunks`, in frame order; none: the video is one item, the ref's own hash
and source). Every chunk is gathered with the images in one connector gather (a chunk that is not there is in
the 409's `missing` list by its own hash, so the proxy re-encodes exactly those), then the chunks' features
become the video's one ImageFeatures: rows, DeepStack rows (on their token dim) and spans (Qwen3-VL's
timestamps) concatenated, grid (sum of the chunks' t, h, w), seconds per temporal patch as the chunks have it.

What a request cannot have is a 400 before anything is fetched (a video for a model without video, more
chunks than the video has temporal patches, a chunk named twice); features that do not fit together are
the encoders' fault, a 502 `invalid_embeddings` naming the video (a chunk that is not a video, or an image
that is; chunks of another frame size or time step; grids that do not add up to the video's frames).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from epd_common.errors import APIError, bad_request
from epd_common.video_sampling import VideoConfig
from epd_contracts.embeddings import ImageFeatures
from epd_contracts.generate import ChunkRef, ImageRef


@dataclass(frozen=True)
class Gathered:
    """One image's (or video's) features, and which of its rows this request did not have to encode."""

    features: ImageFeatures
    held: tuple[tuple[int, int], ...] = ()  # [start, end) ranges of its rows whose embeddings were already held

    @classmethod
    def of(cls, features: ImageFeatures, held: bool) -> Gathered:
        return cls(features, ((0, features.num_tokens),) if held and features.num_tokens else ())


@dataclass(frozen=True)
class GatherPlan:
    """What one connector gather fetches for a request's images, and how to make them back into its items."""

    refs: tuple[ImageRef, ...]
    parts: tuple[tuple[ChunkRef, ...], ...]  # per item: its parts (an image: itself; a video: its chunks)

    @property
    def hashes(self) -> list[str]:
        return [p.mm_hash for parts in self.parts for p in parts]

    @property
    def sources(self) -> dict[str, str]:
        return {p.mm_hash: p.source for parts in self.parts for p in parts}

    @property
    def pending(self) -> list[str]:
        return [p.mm_hash for parts in self.parts for p in parts if p.pending]

    def assemble(self, got: Mapping[str, ImageFeatures], temporal_patch: int = 1,
                 needs_grid: bool = False) -> list[Gathered]:
        """Each item's features from the gathered parts (every hash of the plan is in `got`), in prompt order.
        `needs_grid`: the model's images have a grid (M-RoPE): an image's rows without one are refused (a model that
        takes audio lets rows alone through its connector check, as a clip's may be)."""
        out = []
        for i, (ref, parts) in enumerate(zip(self.refs, self.parts, strict=True)):
            feats = [got[p.mm_hash] for p in parts]
            if ref.audio is not None:
                if any(f.is_video or f.grid_thw is not None or f.span is not None for f in feats):
                    raise _invalid(i, "is an audio clip, but its embeddings are an image's or a video's")
                rows = torch.cat([f.embeds for f in feats]) if len(feats) > 1 else feats[0].embeds
                clip = ImageFeatures(embeds=rows, audio=True, in_video=ref.in_video)
                held = ((0, clip.num_tokens),) if ref.cached else tuple(
                    (s, e) for (s, e), p in zip(_ranges(feats), parts, strict=True) if p.cached and s < e)
                out.append(Gathered(clip, held))
                continue
            if ref.video is None:
                if feats[0].is_video:
                    raise _invalid(i, "is an image, but its embeddings are a video's")
                if needs_grid and feats[0].grid_thw is None:
                    raise _invalid(i, "is an image, but its embeddings have no grid (an audio clip's?)")
                out.append(Gathered.of(feats[0], ref.cached or parts[0].cached))
                continue
            video = assemble_video(i, feats, math.ceil(ref.video.total / temporal_patch))
            held = ((0, video.num_tokens),) if ref.cached else tuple(
                (s, e) for (s, e), p in zip(_ranges(feats), parts, strict=True) if p.cached and s < e)
            out.append(Gathered(video, held))
        return out


def _ranges(feats: Sequence[ImageFeatures]) -> list[tuple[int, int]]:
    """[start, end) of each chunk's rows in the item's."""
    rows = [0, *accumulate(f.num_tokens for f in feats)]
    return list(zip(rows, rows[1:], strict=False))


def plan_gather(images: Sequence[ImageRef], config: VideoConfig | None, takes_video: bool,
                takes_audio: bool = False) -> GatherPlan:
    """The parts to gather for `images` (400 for what this decoder cannot take; see the module docstring).
    `config`: this checkpoint's video sampling (its temporal patch bounds a video's chunks); `takes_video`: the
    model has a video token; `takes_audio`: an audio token."""
    parts: list[tuple[ChunkRef, ...]] = []
    for i, ref in enumerate(images):
        whole = (ChunkRef(mm_hash=ref.mm_hash, source=ref.source, pending=ref.pending, cached=ref.cached),)
        if ref.audio is not None:
            if not takes_audio:
                raise bad_request(f"images[{i}] is an audio clip, but this model takes no audio input",
                                  param=f"images.{i}", code="audio_not_supported")
            if len({c.mm_hash for c in ref.chunks}) != len(ref.chunks):
                raise bad_request(f"images[{i}] names one chunk twice", param=f"images.{i}.chunks")
            parts.append(tuple(ref.chunks) or whole)
            continue
        if ref.video is None:
            parts.append(whole)
            continue
        if config is None or not takes_video:
            raise bad_request(f"images[{i}] is a video, but this model takes no video input", param=f"images.{i}",
                              code="video_not_supported")
        most = math.ceil(ref.video.total / config.temporal_patch)
        if len(ref.chunks) > most:
            raise bad_request(f"images[{i}] has {len(ref.chunks)} chunks, but its {ref.video.total} frames make "
                              f"at most {most} (whole temporal patches of {config.temporal_patch})",
                              param=f"images.{i}.chunks", code="too_many_chunks")
        if len({c.mm_hash for c in ref.chunks}) != len(ref.chunks):
            raise bad_request(f"images[{i}] names one chunk twice", param=f"images.{i}.chunks")
        parts.append(tuple(ref.chunks) or whole)
    return GatherPlan(tuple(images), tuple(parts))


def assemble_video(index: int, chunks: Sequence[ImageFeatures], temporal_patches: int) -> ImageFeatures:
    """The video `images[index]` from its chunks' features in frame order (502 when they do not fit together).
    `temporal_patches`: how many the video's frames make (its grid's t, for the families that report a grid)."""
    for k, c in enumerate(chunks):
        if not c.is_video:
            raise _invalid(index, f"chunk {k} is not a video's embeddings")
    first = chunks[0]
    if any(c.second_per_grid_t != first.second_per_grid_t for c in chunks):
        raise _invalid(index, "its chunks disagree on the seconds per temporal patch: "
                              f"{sorted({c.second_per_grid_t for c in chunks})}")  # type: ignore[type-var]
    if any((c.grid_thw is None) != (first.grid_thw is None) for c in chunks):
        raise _invalid(index, "some of its chunks have a grid and some do not")
    grid = None
    if first.grid_thw is not None:
        sizes = {c.grid_thw[1:] for c in chunks if c.grid_thw is not None}
        if len(sizes) > 1:
            raise _invalid(index, f"its chunks have frames of different sizes (grids {sorted(sizes)})")
        t = sum(c.grid_thw[0] for c in chunks if c.grid_thw is not None)
        if t != temporal_patches:
            raise _invalid(index, f"its chunks hold {t} temporal patches; its frames make {temporal_patches}")
        grid = (t, *first.grid_thw[1:])
    if any((c.span is None) != (first.span is None) for c in chunks):
        raise _invalid(index, "some of its chunks have a span and some do not")
    if any((c.deepstack is None) != (first.deepstack is None) for c in chunks):
        raise _invalid(index, "some of its chunks have DeepStack features and some do not")
    if len(chunks) == 1:
        return first
    embeds = torch.cat([c.embeds for c in chunks])
    deep = torch.cat([c.deepstack for c in chunks if c.deepstack is not None], dim=1) if first.deepstack is not None \
        else None
    span = tuple(t for c in chunks for t in c.span or ()) if first.span is not None else None
    return ImageFeatures(embeds=embeds, grid_thw=grid, span=span, deepstack=deep,
                         second_per_grid_t=first.second_per_grid_t)


def _invalid(index: int, why: str) -> APIError:
    return APIError(502, f"images[{index}] {why}", param=f"images.{index}", code="invalid_embeddings")
