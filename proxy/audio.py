"""The audio kind: a request's audio parts (OpenAI's input_audio, vLLM's audio_url) counted, refused for a model
without audio, loaded, probed, hashed and planned in chunks; each step before the next one costs anything. A video's
sound track (mm_processor_kwargs.use_audio_in_video) is probed and planned here too, for proxy/video.py.

1. counted with the images and videos (proxy/prepare.py): more than --max-audios-per-request is a 400
   too_many_audios before anything is loaded;
2. the model: a fleet whose workers report no `model_identity["audio"]` (an AudioConfig, epd_contracts/audio.py;
   no family served today reports one) takes no audio: 400 audio_not_supported naming the first audio part, before
   any image, video or audio is loaded or decoded;
3. the bytes: input_audio.data base64-decoded (its length checked against --max-audio-bytes first), an audio_url
   loaded like an image URL (proxy.media: data:, http(s) with the SSRF guard, fetch slots and the request's
   deadline, file:// under --allowed-local-media-path), capped at --max-audio-bytes while it is read;
4. probed (epd_common.audio.probe_audio: headers, no sample decoded) under --max-audio-bytes and
   --max-audio-seconds: 400 invalid_audio, or audio_too_large;
5. an AudioItem: its hash covers the bytes and the fleet's resampling settings, under the audio tag; where the
   family encodes windows apart (the fleet's AudioConfig.window_seconds), a clip longer than --audio-chunk-seconds
   is cut into chunks of whole windows (epd_contracts.audio.plan_chunks), each an MMItem with `audio` set that the
   scheduler dedupes, places and fails over like an image, so several encoders encode one clip in parallel; the
   decoder gets one ImageRef per clip naming its chunks in order (proxy/generation.py).

Error codes (400): too_many_audios, audio_not_supported, audio_too_large, invalid_audio; an audio_url's own come
from proxy.media (invalid_audio_url, audio_url_forbidden, audio_fetch_failed, 408 audio_fetch_timeout).
"""
from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from epd_common.errors import APIError, bad_request
from epd_contracts.audio import AudioConfig, AudioPart, audio_hash, plan_chunks
from epd_contracts.generate import ImageRef
from proxy.config import ProxyConfig
from proxy.content_parts import AudioURLPart, InputAudioPart, MMProcessorKwargs
from proxy.media import fleet_config, load_media_bytes
from proxy.media_kind import MediaContext, MediaKind, Placement, chunked_ref
from proxy.media_rules import MediaBytes
from scheduler.scheduler import MMItem

if TYPE_CHECKING:
    from epd_common.audio import AudioInfo


# wall clock of one clip's probe in the proxy (its demux pass: packets, no samples): far more than a 25 MB file
# takes, and short enough that a few hostile files cannot hold prepare_chat's threads long
PROBE_BUDGET_S = 5.0


@dataclass(frozen=True)
class AudioRef:
    """An audio part of the request, before anything is loaded: an audio_url's URL, or input_audio's base64."""

    part: str  # the request field of the part: messages.<i>.content.<j>
    url: str | None = None  # audio_url.url
    data: str | None = None  # input_audio.data (base64)
    fmt: str | None = None  # input_audio.format: "wav" or "mp3"

    @property
    def param(self) -> str:
        """The request field of its bytes (errors name it)."""
        return f"{self.part}.audio_url.url" if self.url is not None else f"{self.part}.input_audio.data"


@dataclass(frozen=True)
class AudioItem:
    """One probed clip of a prompt, as the audio encoders will take it: its chunks (MMItems with `audio` set, in
    order; one chunk: the clip's own hash)."""

    mm_hash: str  # epd_contracts.audio.audio_hash(data, the fleet's AudioConfig)
    data: bytes  # the file as received
    info: AudioInfo  # the probe's container, codec, rate, channels, duration
    audio: AudioPart  # the whole clip: the fleet's rate and window
    chunks: tuple[MMItem, ...]
    param: str = ""  # the request field of its bytes
    in_video: bool = False  # the sound track of the video before it (mm_processor_kwargs.use_audio_in_video)

    def decoder_ref(self, at: Placement) -> ImageRef:
        return chunked_ref(self, at, audio=self.audio, in_video=self.in_video)


def fleet_audio_config(identity: dict[str, Any] | None) -> AudioConfig | None:
    """The fleet's AudioConfig from its model identity's "audio" (None: the model takes no audio)."""
    return fleet_config(identity, "audio", AudioConfig.from_dict)


def track_support(kwargs: MMProcessorKwargs | None, config: AudioConfig | None) -> AudioConfig | None:
    """For a request with a video: the fleet's AudioConfig when the request asks for its videos' sound tracks
    (mm_processor_kwargs.use_audio_in_video); None when it does not; 400 audio_not_supported when the model does not
    interleave a track with its video (checked before anything is loaded)."""
    if kwargs is None or not kwargs.use_audio_in_video:
        return None
    if config is None or not config.in_video:
        raise bad_request("this model does not take a video's sound track with its frames",
                          "mm_processor_kwargs.use_audio_in_video", code="audio_not_supported")
    return config


def plan_audio(data: bytes, info: AudioInfo, param: str, cfg: ProxyConfig, config: AudioConfig) -> AudioItem:
    """The clip's hash and chunks: over the seconds the family's processor keeps (it cuts at max_seconds), chunks of
    --audio-chunk-seconds made longer where needed so that the file is sent at most --max-audio-fanout-bytes in all
    (each chunk's /encode carries the whole file, and each encoder decodes all of it)."""
    clip = audio_hash(data, config)
    seconds = min(info.duration_s, config.max_seconds) if config.max_seconds else info.duration_s
    whole = AudioPart(sample_rate=config.sample_rate, window=config.window_seconds)
    most = max(1, cfg.max_audio_fanout_bytes // max(1, len(data)))  # chunks the file may be sent in
    window = config.window_seconds
    chunk_seconds = max(cfg.audio_chunk_seconds, window * math.ceil(seconds / most / window) if window else 0.0)
    chunks = tuple(MMItem(mm_hash=c.mm_hash, data=data, audio=AudioPart(
        sample_rate=config.sample_rate, window=config.window_seconds, first=c.first, count=c.count))
        for c in plan_chunks(clip, seconds, config.window_seconds, chunk_seconds))
    return AudioItem(clip, data, info, whole, chunks, param)


def audio_bytes(ref: AudioRef, cfg: ProxyConfig, deadline: float | None) -> bytes:
    if ref.url is not None:
        return load_media_bytes(ref.url, MediaBytes("audio", cfg.max_audio_bytes), ref.param, cfg, deadline)
    assert ref.data is not None, "an input_audio part has data"
    return decode_base64(ref.data, ref.param, cfg.max_audio_bytes)


def decode_base64(text: str, param: str, max_bytes: int) -> bytes:
    """input_audio.data -> bytes; its size checked before decoding (400 audio_too_large), then strict base64 (400
    invalid_audio)."""
    if len(text) * 3 // 4 > max_bytes:
        raise bad_request(f"audio is larger than {max_bytes} bytes", param, code="audio_too_large")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"input_audio.data is not valid base64: {exc}", param, code="invalid_audio") from exc
    if len(data) > max_bytes:
        raise bad_request(f"audio is larger than {max_bytes} bytes", param, code="audio_too_large")
    return data


def probe(data: bytes, param: str, fmt: str | None, cfg: ProxyConfig) -> AudioInfo:
    """probe_audio under the flags' limits: 400 audio_too_large (a limit passed) or invalid_audio."""
    from epd_common.audio import probe_audio
    from epd_common.audio_limits import AudioError, AudioLimits, AudioTooLargeError

    try:
        return probe_audio(data, AudioLimits(max_bytes=cfg.max_audio_bytes, max_seconds=cfg.max_audio_seconds,
                                             max_decode_s=PROBE_BUDGET_S), fmt)
    except AudioTooLargeError as exc:
        raise bad_request(str(exc), param, code="audio_too_large") from exc
    except AudioError as exc:
        raise bad_request(str(exc), param, code="invalid_audio") from exc


def load_tracks(videos: list[tuple[str, bytes]], cfg: ProxyConfig, config: AudioConfig) -> list[AudioItem]:
    """mm_processor_kwargs.use_audio_in_video: each video's sound track ((param, file bytes) of each video in order),
    probed as an audio file under --max-audio-bytes and --max-audio-seconds (its first audio stream; the video
    streams are not read) and planned like a clip of its own; 400 video_has_no_audio for a video without one (the
    model would place a track that is not there: transformers mixes up such a prompt's positions)."""
    from epd_common.audio_limits import NoAudioStreamError

    planned: dict[bytes, AudioItem] = {}
    for param, data in videos:
        if data not in planned:
            try:
                info = probe(data, param, None, cfg)
            except APIError as exc:
                if isinstance(exc.__cause__, NoAudioStreamError):
                    raise bad_request("mm_processor_kwargs.use_audio_in_video is set, but this video has no audio "
                                      "stream", param, code="video_has_no_audio") from exc
                raise
            planned[data] = replace(plan_audio(data, info, param, cfg, config), in_video=True)
    return [planned[data] for _, data in videos]


class AudioKind(MediaKind[AudioRef, AudioConfig, "AudioInfo", AudioItem]):
    name, plural, parts = "audio", "audio parts", (InputAudioPart, AudioURLPart)
    only_user = "audio is only allowed in user messages"

    def limit(self, cfg: ProxyConfig) -> int:
        return cfg.max_audios_per_request

    def url(self, part: InputAudioPart | AudioURLPart) -> str | None:
        return part.audio_url.url if isinstance(part, AudioURLPart) else None

    def ref(self, part: InputAudioPart | AudioURLPart, where: str) -> AudioRef:
        if isinstance(part, AudioURLPart):
            return AudioRef(where, url=part.audio_url.url)
        return AudioRef(where, data=part.input_audio.data, fmt=part.input_audio.format)

    def accept(self, refs: Sequence[AudioRef], ctx: MediaContext) -> AudioConfig:
        """400 audio_not_supported naming the first audio part when the model takes no audio."""
        if ctx.model.audio is None:
            raise bad_request("this model does not take audio input", refs[0].part, code="audio_not_supported")
        return ctx.model.audio

    def key(self, ref: AudioRef) -> object:
        return ref.url, ref.data, ref.fmt

    def load(self, ref: AudioRef, settings: AudioConfig, ctx: MediaContext) -> bytes:
        return audio_bytes(ref, ctx.cfg, ctx.deadline)

    def probe(self, data: bytes, ref: AudioRef, settings: AudioConfig, ctx: MediaContext) -> AudioInfo:
        return probe(data, ref.param, ref.fmt, ctx.cfg)

    def plan(self, data: bytes, info: AudioInfo, ref: AudioRef, settings: AudioConfig,
             ctx: MediaContext) -> AudioItem:
        return plan_audio(data, info, ref.param, ctx.cfg, settings)


AUDIO = AudioKind()
