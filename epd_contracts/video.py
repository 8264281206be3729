"""A video as EPD items: one hash for the video and its sampling, and the chunks of frames encoders take apart.

Torch-free (the proxy plans; encoders and decoders follow the plan). A video is one item keyed by the hash of
its file bytes AND the sampling settings (the same file sampled at 1 fps and at 2 fps are different embeddings).
A long video is split into chunks of whole temporal patches, each its own `mm_hash` (the video's, its first
frame and its frame count), so several encoders encode it in parallel, each chunk is cached, deduplicated,
gathered and failed over exactly like an image, and the decoder concatenates the chunks' rows in order.

Why chunks of whole temporal patches are exact for the Qwen families: their vision towers attend within one
temporal patch at a time (`cu_seqlens` repeats grid_h * grid_w per grid_t) and their vision rotary positions
depend on (h, w) only, so a chunk's rows equal the same rows of the whole video's; only the language model's
M-RoPE temporal positions need the whole grid, which the decoder assembles from the chunks.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

VIDEO_HASH_TAG = b"epd-video-hash/v1\0"


@dataclass(frozen=True)
class VideoSampling:
    """How frames are taken from the file (what the embeddings depend on besides the bytes)."""

    num_frames: int  # frames sampled (after rounding to whole temporal patches)
    fps: float  # frames per second of the sampled sequence (Qwen2.5-VL: second_per_grid_t = temporal_patch / fps)
    max_pixels: int  # the per-frame pixel budget frames were resized under

    def tag(self) -> bytes:
        return f"frames={self.num_frames};fps={self.fps:.6g};max_pixels={self.max_pixels}\0".encode()


@dataclass(frozen=True)
class VideoChunk:
    mm_hash: str  # names this chunk's embeddings
    first: int  # index of its first sampled frame
    count: int  # its sampled frames: whole temporal patches


def video_hash(data: bytes, sampling: VideoSampling) -> str:
    """sha256(tag || sampling || bytes) as lowercase hex: never equal to an image's `mm_hash` (another tag)."""
    h = hashlib.sha256(VIDEO_HASH_TAG)
    h.update(sampling.tag())
    h.update(data)
    return h.hexdigest()


def plan_chunks(video: str, num_frames: int, temporal_patch: int, frames_per_chunk: int) -> list[VideoChunk]:
    """The video's sampled frames in chunks of at most `frames_per_chunk` (rounded down to whole temporal patches,
    at least one patch); `num_frames` must already be whole patches. One chunk: its hash is the video's own."""
    if temporal_patch < 1 or num_frames < temporal_patch or num_frames % temporal_patch:
        raise ValueError(f"{num_frames} frames are not whole temporal patches of {temporal_patch}")
    step = max(temporal_patch, frames_per_chunk // temporal_patch * temporal_patch)
    if step >= num_frames:
        return [VideoChunk(video, 0, num_frames)]
    return [VideoChunk(_chunk_hash(video, first, min(step, num_frames - first)), first,
                       min(step, num_frames - first)) for first in range(0, num_frames, step)]


def _chunk_hash(video: str, first: int, count: int) -> str:
    return hashlib.sha256(VIDEO_HASH_TAG + f"{video}:{first}:{count}".encode()).hexdigest()
