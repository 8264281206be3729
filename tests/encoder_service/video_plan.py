"""A video planned as the proxy plans it (design step 1), for the encoder and decoder video tests."""
from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from epd_common.video import probe_video
from epd_common.video_sampling import VideoConfig, frame_indices, sampled_fps, target_frames
from epd_contracts.video import VideoChunk, VideoPart, VideoSampling, plan_chunks, video_hash


@dataclass(frozen=True)
class PlannedVideo:
    data: bytes
    sampling: VideoSampling
    mm_hash: str  # the video's hash (its whole part's)
    total: int  # sampled frames
    chunks: list[VideoChunk]

    def part(self, chunk: VideoChunk | None = None) -> VideoPart:
        """A chunk's VideoPart (None: the whole video's)."""
        if chunk is None:
            return VideoPart(sampling=self.sampling, first=0, count=self.total, total=self.total)
        return VideoPart(sampling=self.sampling, first=chunk.first, count=chunk.count, total=self.total)

    def item(self, chunk: VideoChunk | None = None, mm_hash: str | None = None) -> dict[str, Any]:
        """The /encode item of a chunk (None: the whole video), as JSON."""
        part = self.part(chunk)
        return {"mm_hash": mm_hash or (chunk.mm_hash if chunk is not None else self.mm_hash),
                "data": base64.b64encode(self.data).decode(),
                "video": {"sampling": {"num_frames": part.sampling.num_frames, "fps": part.sampling.fps,
                                       "max_pixels": part.sampling.max_pixels},
                          "first": part.first, "count": part.count, "total": part.total}}


def plan_video(data: bytes, config: dict[str, Any] | VideoConfig, frames_per_chunk: int,
               num_frames: int | None = None) -> PlannedVideo:
    """The plan of `data` under the fleet's video config (a worker's /health model_identity["video"]), a request's
    `num_frames` if given, in chunks of `frames_per_chunk` sampled frames."""
    cfg = config if isinstance(config, VideoConfig) else VideoConfig.from_dict(config)
    info = probe_video(data)
    n = target_frames(cfg, info, num_frames=num_frames)
    m = len(frame_indices(cfg, info, n))
    sampling = VideoSampling(num_frames=n, fps=sampled_fps(info, m), max_pixels=cfg.max_pixels)
    vh = video_hash(data, sampling)
    return PlannedVideo(data, sampling, vh, m, plan_chunks(vh, m, cfg.temporal_patch, frames_per_chunk))
