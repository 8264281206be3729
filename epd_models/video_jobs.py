"""A video item's way into the caching encoder (epd_models/encode.py), as audio_jobs.py is an audio item's: the part's
plan checked against this checkpoint, its frames decoded outside the lock, encoded under it.

The bytes are probed under the encoder's VideoLimits, the frame indices are recomputed from the part's frame count
with this checkpoint's own VideoConfig (epd_models/video_config.py) and checked against the part's plan (its total
and fps: else 400 video_plan_mismatch), and only the part's frames are decoded.
"""
from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from epd_common.video import VideoError, VideoInfo, VideoLimits, VideoTooLargeError, probe_video
from epd_common.video_decode import decode_frames
from epd_common.video_sampling import VideoConfig, frame_indices, sampled_fps
from epd_contracts.video import VideoPart


class UndecodableVideo(VideoError):
    """An item's bytes are not a video this encoder can use as asked; `code` is the 400's error code
    (invalid_video, video_too_large, video_plan_mismatch, video_not_supported), `mm_hash` names the item."""

    def __init__(self, mm_hash: str, message: str, code: str = "invalid_video"):
        super().__init__(message)
        self.mm_hash, self.code = mm_hash, code


@dataclass(frozen=True)
class VideoFrames:
    """A video item's decoded frames, ready for the vision half."""

    part: VideoPart
    frames: list[Image.Image]
    times: list[float]  # each frame's time in the source video, in seconds


@dataclass(frozen=True)
class VideoJob:
    """A video item (a whole video or a chunk) with its frames decoded; video items can share a forward."""

    mm_hash: str
    clip: VideoFrames

    @property
    def group(self) -> tuple[str, bool]:
        return "video", False


def video_job(mm_hash: str, data: bytes, part: VideoPart, config: VideoConfig | None, family: str,
              limits: VideoLimits) -> VideoJob:
    """Probe the video, check the part's plan against this checkpoint's sampling (`config`; None: the family takes
    no video), decode the part's frames (blocking: outside any lock)."""
    if config is None:
        raise UndecodableVideo(mm_hash, f"video input is not supported for {family} checkpoints",
                               "video_not_supported")
    try:
        if part.total > limits.max_frames:
            raise VideoTooLargeError(f"{part.total} sampled frames; the limit is {limits.max_frames}")
        info = probe_video(data, limits)
        wanted = part_indices(config, info, part, mm_hash)
        frames = decode_frames(data, wanted, limits, index=info.index)
    except UndecodableVideo:
        raise
    except VideoError as exc:
        code = "video_too_large" if isinstance(exc, VideoTooLargeError) else "invalid_video"
        raise UndecodableVideo(mm_hash, str(exc), code) from exc
    return VideoJob(mm_hash, VideoFrames(part, frames, [i / info.fps for i in wanted]))


def part_indices(config: VideoConfig, info: VideoInfo, part: VideoPart, mm_hash: str = "") -> list[int]:
    """The source frame indices of `part`, by this checkpoint's sampling rule for the video `info` describes;
    UndecodableVideo (video_plan_mismatch) when the part's plan is not what that rule gives: another
    number of sampled frames or another sampled fps (the proxy sampled with other settings, or another video),
    or a chunk that does not start and end on whole temporal patches (only the video's last chunk may end
    short)."""
    sampling = part.sampling
    try:
        indices = frame_indices(config, info, sampling.num_frames)
    except VideoError as exc:
        raise UndecodableVideo(mm_hash, f"the video's plan does not fit it: {exc}", "video_plan_mismatch") from exc
    if len(indices) != part.total:
        raise UndecodableVideo(mm_hash, f"sampling {sampling.num_frames} frames of this video gives {len(indices)} "
                                        f"frames here, not the plan's {part.total}", "video_plan_mismatch")
    here = sampled_fps(info, len(indices))
    if abs(here - sampling.fps) > 1e-6 * sampling.fps:
        raise UndecodableVideo(mm_hash, f"the sampled frames are at {here:.6g} fps here, not the plan's "
                                        f"{sampling.fps:.6g}", "video_plan_mismatch")
    t = config.temporal_patch
    if part.first % t or (part.count % t and not part.last):
        raise UndecodableVideo(mm_hash, f"frames [{part.first}, {part.first + part.count}) are not whole temporal "
                                        f"patches of {t} frames", "video_plan_mismatch")
    return indices[part.first : part.first + part.count]
