"""A video as EPD items: one hash for the video and its sampling, and the chunks of frames encoders take apart.

Torch-free (the proxy plans; encoders and decoders follow the plan). A video is one item keyed by the hash of
its file bytes AND the sampling settings (the same file sampled at 1 fps and at 2 fps are different embeddings).
A long video is split into chunks of whole temporal patches, each its own `mm_hash` (the video's, its first
frame and its frame count), so several encoders encode it in parallel, each chunk is cached, deduplicated,
gathered and failed over exactly like an image, and the decoder concatenates the chunks' rows in order.

Why chunks of whole temporal patches are exact for the Qwen families: their vision towers attend within one
temporal patch at a time (`cu_seqlens` repeats grid_h * grid_w per grid_t) and their vision rotary positions
depend on (h, w) only, so a chunk's rows equal the same rows of the whole video's; only the language model's
M-RoPE temporal positions need the whole grid, which the decoder assembles from the chunks. LLaVA-OneVision
encodes each frame on its own (its one trailing newline row belongs to the last chunk).

Who computes what (epd_common/video_sampling.py has the rules):
1. the proxy probes the bytes, picks the sampler's frame count `num_frames` (the family's VideoConfig, a
   request's fps / num_frames within the server's limits), the frame indices it gives and their sampled fps;
2. `VideoSampling` (that count, that fps, the per-frame pixel budget) and the bytes make the video's hash, and
   `plan_chunks` cuts the sampled frames into chunks;
3. each chunk goes to an encoder as an /encode item with a `VideoPart`; the encoder probes the bytes again,
   recomputes the indices from `num_frames` with its own checkpoint's rule, checks that the fps and the chunk's
   hash agree (else 400 hash_mismatch), decodes only its frames and stores their rows under the chunk's hash;
4. the decoder gathers the chunks of each video (ImageRef.chunks) and concatenates them into one item.
"""
from __future__ import annotations

import hashlib
import math
from typing import Annotated

import msgspec

VIDEO_HASH_TAG = b"epd-video-hash/v1\0"
MAX_VIDEO_FRAMES = 4096  # sampled frames of one video on the wire (servers set lower limits)
MAX_FRAME_PIXELS = 1 << 26  # a pixel budget (VideoSampling.max_pixels) on the wire


class VideoSampling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How frames are taken from the file (what the embeddings depend on besides the bytes)."""

    # the sampler's frame count: epd_common.video_sampling.frame_indices(config, info, num_frames) gives the
    # indices (their number may differ by the rule's rounding: Qwen2-VL's can give one more)
    num_frames: Annotated[int, msgspec.Meta(ge=1, le=MAX_VIDEO_FRAMES)]
    # frames per second of the sampled sequence: len(indices) / total frames * the video's fps (transformers'
    # VideoMetadata.sampled_fps); Qwen2.5-VL's second_per_grid_t = temporal_patch / fps
    fps: Annotated[float, msgspec.Meta(gt=0, le=1e6)]
    # the pixel budget of the resize: per frame (Qwen2-VL, Qwen2.5-VL), over the whole video's t * h * w (Qwen3-VL),
    # unused (LLaVA-OneVision: a fixed frame size)
    max_pixels: Annotated[int, msgspec.Meta(ge=1, le=MAX_FRAME_PIXELS)]

    def tag(self) -> bytes:
        return f"frames={self.num_frames};fps={self.fps:.6g};max_pixels={self.max_pixels}\0".encode()


class VideoPart(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """EncodeItem.video: the item's bytes are a video, and this item is frames [first, first + count) of the
    sampled frames (a chunk; first 0 and count = all sampled frames: the whole video)."""

    sampling: VideoSampling
    first: Annotated[int, msgspec.Meta(ge=0, le=MAX_VIDEO_FRAMES)] = 0
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_VIDEO_FRAMES)]
    total: Annotated[int, msgspec.Meta(ge=1, le=MAX_VIDEO_FRAMES)]  # sampled frames of the whole video

    def __post_init__(self) -> None:
        if self.first + self.count > self.total:
            raise msgspec.ValidationError(f"frames [{self.first}, {self.first + self.count}) pass the video's "
                                          f"{self.total} sampled frames")

    @property
    def last(self) -> bool:
        """Whether the chunk ends the video (LLaVA-OneVision's newline row; the temporal padding)."""
        return self.first + self.count == self.total


class VideoChunk(msgspec.Struct, frozen=True):
    mm_hash: str  # names this chunk's embeddings
    first: int  # index of its first sampled frame
    count: int  # its sampled frames: whole temporal patches, except the video's last chunk may end short


def video_hash(data: bytes, sampling: VideoSampling) -> str:
    """sha256(tag || sampling || bytes) as lowercase hex: never equal to an image's `mm_hash` (another tag)."""
    h = hashlib.sha256(VIDEO_HASH_TAG)
    h.update(sampling.tag())
    h.update(data)
    return h.hexdigest()


def chunk_hash(video: str, first: int, count: int, total: int) -> str:
    """The mm_hash of sampled frames [first, first + count) of the video hashed `video` (of `total` sampled
    frames); the whole video's is its own hash."""
    if first == 0 and count == total:
        return video
    return hashlib.sha256(VIDEO_HASH_TAG + f"{video}:{first}:{count}".encode()).hexdigest()


def part_hash(data: bytes, part: VideoPart) -> str:
    """The mm_hash an /encode item with these bytes and this VideoPart is stored under."""
    return chunk_hash(video_hash(data, part.sampling), part.first, part.count, part.total)


def plan_chunks(video: str, num_frames: int, temporal_patch: int, frames_per_chunk: int) -> list[VideoChunk]:
    """The video's `num_frames` sampled frames in chunks of `frames_per_chunk` rounded down to whole temporal
    patches (at least one patch); the last chunk takes what is left (the encoder pads it as the family pads the
    whole video: its last frame repeated). One chunk: its hash is the video's own."""
    if temporal_patch < 1 or num_frames < 1:
        raise ValueError(f"cannot plan {num_frames} frames in temporal patches of {temporal_patch}")
    step = max(temporal_patch, frames_per_chunk // temporal_patch * temporal_patch)
    count = math.ceil(num_frames / step)
    return [VideoChunk(chunk_hash(video, first, min(step, num_frames - first), num_frames), first,
                       min(step, num_frames - first)) for first in range(0, count * step, step)]
