"""The video kind: a request's videos probed, sampled and cut into the chunks encoders take apart (the plan of
epd_contracts/video.py), and each one's sound track when the request asks for it (proxy/audio.py plans that).

For each video_url the proxy (torch-free, in prepare_chat's worker thread, never on the event loop):
1. loads the bytes under the image rules with the video's own byte cap (proxy.media, --max-video-bytes);
2. probes them (epd_common.video.probe_video: headers and packets, no frame decoded) under VideoLimits from its
   flags, so a file too large, too long, of absurd frame size or corrupt is a 400 before any big allocation;
3. takes the sampler's frame count from the fleet's VideoConfig (what the workers' /health reports as
   model_identity["video"]), a request's `mm_processor_kwargs` overriding fps / num_frames / max_pixels within the
   server's limits, the frame indices it gives and their fps, and so the video's VideoSampling and hash;
4. cuts the sampled frames into chunks of --video-chunk-frames (whole temporal patches), each an MMItem with
   `video` set: the scheduler dedupes, places and fails them over like images, several encoders in parallel;
5. counts, before anything is encoded, what the plan will cost: the frames the encoders decode (each chunk from
   the keyframe before its frames, by the probe's index: epd_common/video_index.py), all the request's videos
   within --max-video-decode-frames, and the embedding rows the video makes (epd_common/video_tokens.py, by the
   model's rule the workers report), which prepare_chat checks against the decoders' context length.
The decoder gets one ImageRef per video (its hash, the whole sampled part, the chunks in order: proxy/generation.py).

Error codes (400): video_not_supported (the model takes no video), video_too_large (a limit), invalid_video (not a
video we accept, or a sampling that selects nothing of it), too_many_videos (proxy/prepare.py); the URL's own codes
come from proxy.media (invalid_video_url, video_url_forbidden, video_fetch_failed, 408 video_fetch_timeout).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from epd_common.errors import bad_request
from epd_common.video import VideoError, VideoInfo, VideoLimits, VideoTooLargeError, probe_video
from epd_common.video_index import decode_cost
from epd_common.video_sampling import VideoConfig, frame_indices, sampled_fps, target_frames
from epd_common.video_tokens import video_rows
from epd_contracts.audio import AudioConfig
from epd_contracts.generate import ImageRef
from epd_contracts.video import VideoPart, VideoSampling, plan_chunks, video_hash
from proxy.audio import load_tracks, track_support
from proxy.config import ProxyConfig
from proxy.content_parts import MMProcessorKwargs, VideoURLPart
from proxy.media import fleet_config, load_media_bytes
from proxy.media_kind import MediaContext, MediaItem, MediaKind, Placement, chunked_ref
from proxy.media_rules import MediaBytes
from scheduler.scheduler import MMItem

KWARGS = "mm_processor_kwargs"


@dataclass(frozen=True)
class VideoItem:
    """One video of a prompt: what the decoder's ImageRef names (the video's hash and its whole sampled part) and
    the chunks the scheduler places (MMItems with `video` set, in frame order; one chunk: the video's own hash)."""

    mm_hash: str  # epd_contracts.video.video_hash(data, video.sampling)
    data: bytes
    video: VideoPart  # the whole video: first 0, count = total sampled frames
    chunks: tuple[MMItem, ...]
    param: str = ""  # the request field of its URL (errors name it)
    num_tokens: int | None = None  # embedding rows its chunks make in all (None: the model's rule is not known)
    num_decoded: int = 0  # frames the encoders decode for its chunks (from the keyframe before each chunk's frames)

    def decoder_ref(self, at: Placement) -> ImageRef:
        return chunked_ref(self, at, video=self.video)


class VideoPartRef(NamedTuple):
    """A video part of the request, before anything is loaded."""

    part: str  # the request field of the part: messages.<i>.content.<j>
    url: str

    @property
    def param(self) -> str:
        return f"{self.part}.video_url.url"


@dataclass(frozen=True)
class Sampling:
    """How a request's videos are sampled: the fleet's VideoConfig and the request's own settings, checked against
    the server's limits (None: the config's default)."""

    config: VideoConfig
    fps: float | None = None
    num_frames: int | None = None
    max_pixels: int | None = None
    track: AudioConfig | None = None  # mm_processor_kwargs.use_audio_in_video: each video's sound track goes in too


def fleet_video_config(identity: dict[str, Any] | None) -> VideoConfig | None:
    """The fleet's VideoConfig from its model identity's "video" (None: the model takes no video)."""
    return fleet_config(identity, "video", VideoConfig.from_dict)


def video_limits(cfg: ProxyConfig) -> VideoLimits:
    """The probe's bounds from the proxy's flags (the rest: VideoLimits' defaults)."""
    return VideoLimits(max_bytes=cfg.max_video_bytes, max_duration_s=cfg.max_video_duration,
                       max_frames=cfg.max_video_frames, max_pixels_per_frame=cfg.max_video_frame_pixels)


def check_sampling(kwargs: MMProcessorKwargs | None, config: VideoConfig | None, cfg: ProxyConfig,
                   param: str) -> Sampling:
    """A request's mm_processor_kwargs within the server's limits, checked before any video is loaded; `config`
    None: the model takes no video (400 video_not_supported, `param` naming the first video part)."""
    if config is None:
        raise bad_request("this model does not take video input", param, code="video_not_supported")
    if kwargs is None:
        return Sampling(config)
    if kwargs.fps is not None and kwargs.num_frames is not None:
        raise bad_request(f"{KWARGS}: fps and num_frames are mutually exclusive; give one", KWARGS)
    if kwargs.num_frames is not None and kwargs.num_frames > cfg.max_video_frames:
        raise bad_request(f"{KWARGS}.num_frames: {kwargs.num_frames} frames asked for; this server samples at most "
                          f"{cfg.max_video_frames} frames of a video", f"{KWARGS}.num_frames", code="video_too_large")
    if kwargs.max_pixels is not None and not config.min_pixels <= kwargs.max_pixels <= config.max_pixels:
        raise bad_request(f"{KWARGS}.max_pixels: must be within the model's [{config.min_pixels}, "
                          f"{config.max_pixels}] pixels per frame, got {kwargs.max_pixels}", f"{KWARGS}.max_pixels")
    return Sampling(config, kwargs.fps, kwargs.num_frames, kwargs.max_pixels)


def plan_video(data: bytes, info: VideoInfo, param: str, cfg: ProxyConfig, sampling: Sampling) -> VideoItem:
    """Plan the probed video (steps 3 to 5 of the module docstring); APIError 400 naming `param`."""
    config = sampling.config
    n = target_frames(config, info, sampling.fps, sampling.num_frames, max_frames=cfg.max_video_frames)
    try:
        indices = frame_indices(config, info, n)
    except VideoError as exc:  # more frames than the video has (the request's setting), or none at all
        asked = "num_frames" if sampling.num_frames is not None else "fps" if sampling.fps is not None else None
        raise bad_request(f"{exc} ({info.num_frames} frames at {info.fps:g} fps)",
                          f"{KWARGS}.{asked}" if asked else param, code="invalid_video") from exc
    total = len(indices)
    if total > cfg.max_video_frames:  # the rule's rounding may add one to the count asked for
        raise bad_request(f"the sampling selects {total} frames of this video; this server samples at most "
                          f"{cfg.max_video_frames}", param, code="video_too_large")
    settings = VideoSampling(num_frames=n, fps=sampled_fps(info, total),
                             max_pixels=sampling.max_pixels or config.max_pixels)
    vh = video_hash(data, settings)
    planned = plan_chunks(vh, total, config.temporal_patch, chunk_frames(cfg, len(data), total, config.temporal_patch))
    chunks = tuple(MMItem(mm_hash=c.mm_hash, data=data,
                          video=VideoPart(sampling=settings, first=c.first, count=c.count, total=total))
                   for c in planned)
    return VideoItem(mm_hash=vh, data=data, video=VideoPart(sampling=settings, first=0, count=total, total=total),
                     chunks=chunks, param=param, num_tokens=rows(config, info, total, settings.max_pixels, param),
                     num_decoded=sum(decode_cost(indices[c.first: c.first + c.count], info.keyframes)
                                     for c in planned))


def rows(config: VideoConfig, info: VideoInfo, total: int, max_pixels: int, param: str) -> int | None:
    """The video's embedding rows by the model's rule (None: not reported); 400 invalid_video where the model's
    processor refuses its frames (e.g. an aspect ratio over 200), before any encoder sees them."""
    try:
        return video_rows(config, info.width, info.height, total, max_pixels)
    except VideoError as exc:
        raise bad_request(str(exc), param, code="invalid_video") from exc


def check_context(videos: list[VideoItem], max_tokens: int | None, max_model_len: int | None) -> None:
    """400 context_length_exceeded (the decoder's code) when the videos' embedding rows alone, with max_tokens (or
    the one token any answer needs), pass `max_model_len` (the longest context among the fleet's decoders; None:
    unknown, nothing checked): such a request can only fail, so it fails before anything is encoded. The rows are
    a lower bound of the prompt (its text is not counted), so nothing that could fit is refused."""
    rows = sum(v.num_tokens or 0 for v in videos)
    if not max_model_len or not rows or rows + (max_tokens or 1) <= max_model_len:
        return
    if max_tokens and rows < max_model_len:
        raise bad_request(f"the request's videos make at least {rows} prompt tokens; with max_tokens ({max_tokens}) "
                          f"that exceeds the model's maximum length ({max_model_len})", "max_tokens",
                          code="context_length_exceeded")
    raise bad_request(f"the request's videos make at least {rows} prompt tokens, which leaves no room in the model's "
                      f"maximum length ({max_model_len}): send fewer frames (mm_processor_kwargs.num_frames or fps) "
                      "or a lower mm_processor_kwargs.max_pixels", videos[0].param or "messages",
                      code="context_length_exceeded")


def chunk_frames(cfg: ProxyConfig, size: int, total: int, temporal_patch: int) -> int:
    """--video-chunk-frames, raised (in whole temporal patches) so that the chunks of a `size`-byte file, each
    /encode call carrying the whole file, send at most --max-video-fanout-bytes (always at least one chunk)."""
    most = max(1, cfg.max_video_fanout_bytes // max(1, size))
    longest = -(-total // most)  # ceil: frames per chunk for at most `most` chunks
    return max(cfg.video_chunk_frames, -(-longest // temporal_patch) * temporal_patch)


def probe(data: bytes, param: str, cfg: ProxyConfig) -> VideoInfo:
    """probe_video under the flags' limits: 400 video_too_large (a limit passed) or invalid_video."""
    try:
        return probe_video(data, video_limits(cfg))
    except VideoTooLargeError as exc:
        raise bad_request(str(exc), param, code="video_too_large") from exc
    except VideoError as exc:
        raise bad_request(str(exc), param, code="invalid_video") from exc



def check_decoding(videos: Sequence[VideoItem], cfg: ProxyConfig) -> None:
    """400 video_too_large naming the last of `videos` (the distinct videos planned so far) when their decoding
    takes the request past --max-video-decode-frames: no further video is loaded."""
    decoded = sum(v.num_decoded for v in videos)
    if decoded > cfg.max_video_decode_frames:
        raise bad_request(f"the sampled frames of this request's videos take {decoded} decoded frames to reach (from "
                          f"the keyframe before each chunk); this server decodes at most {cfg.max_video_decode_frames}"
                          " frames a request: send a shorter video, fewer frames (mm_processor_kwargs.num_frames) or "
                          "one with more keyframes", videos[-1].param, code="video_too_large")


def video_bytes(cfg: ProxyConfig) -> MediaBytes:
    return MediaBytes("video", cfg.max_video_bytes)


class VideoKind(MediaKind[VideoPartRef, Sampling, VideoInfo, VideoItem]):
    name, plural, parts = "video", "videos", (VideoURLPart,)
    only_user = "videos are only allowed in user messages"

    def limit(self, cfg: ProxyConfig) -> int:
        return cfg.max_videos_per_request

    def url(self, part: VideoURLPart) -> str:
        return part.video_url.url

    def ref(self, part: VideoURLPart, where: str) -> VideoPartRef:
        return VideoPartRef(where, part.video_url.url)

    def accept(self, refs: Sequence[VideoPartRef], ctx: MediaContext) -> Sampling:
        """A sound track the model cannot take with its video (use_audio_in_video), then the sampling settings."""
        track = track_support(ctx.kwargs, ctx.model.audio)
        sampling = check_sampling(ctx.kwargs, ctx.model.video, ctx.cfg, refs[0].part)
        return Sampling(sampling.config, sampling.fps, sampling.num_frames, sampling.max_pixels, track)

    def key(self, ref: VideoPartRef) -> object:
        return ref.url

    def load(self, ref: VideoPartRef, settings: Sampling, ctx: MediaContext) -> bytes:
        return load_media_bytes(ref.url, video_bytes(ctx.cfg), ref.param, ctx.cfg, ctx.deadline)

    def probe(self, data: bytes, ref: VideoPartRef, settings: Sampling, ctx: MediaContext) -> VideoInfo:
        return probe(data, ref.param, ctx.cfg)

    def plan(self, data: bytes, info: VideoInfo, ref: VideoPartRef, settings: Sampling,
             ctx: MediaContext) -> VideoItem:
        return plan_video(data, info, ref.param, ctx.cfg, settings)

    def admit(self, loaded: Sequence[VideoItem], ctx: MediaContext) -> None:
        check_decoding(loaded, ctx.cfg)

    def settle(self, items: list[VideoItem], settings: Sampling, ctx: MediaContext) -> list[tuple[MediaItem, ...]]:
        """The videos' rows against the context length; then, asked for, each video's sound track after it."""
        check_context(items, ctx.max_tokens, ctx.model.max_model_len)
        if settings.track is None:
            return [(v,) for v in items]
        tracks = load_tracks([(v.param, v.data) for v in items], ctx.cfg, settings.track)
        return list(zip(items, tracks, strict=True))


VIDEO = VideoKind()
