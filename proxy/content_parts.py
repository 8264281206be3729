"""The content parts of a chat message (text, image, video, audio) and vLLM's mm_processor_kwargs, as pydantic models
at the edge; proxy/image.py, proxy/video.py and proxy/audio.py turn each media part into its kind's reference."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from proxy.unsupported import unsupported_parameter


def _first_extra(*levels: tuple[str, dict[str, Any] | None]) -> tuple[str, str] | None:
    """(prefix + key, why) of the first extra key, level by level, this server does not take."""
    for prefix, extra in levels:
        refused = unsupported_parameter(extra or {}, frozenset())
        if refused is not None:
            return prefix + refused[0], refused[1]
    return None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    # any other key (vLLM's `uuid`, an `mm_hash`) is a 400 unsupported_parameter (ImagePart.unsupported): a client
    # never names what an image is cached under; the proxy hashes its bytes
    model_config = ConfigDict(extra="allow")

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="allow")  # refused like ImageURL's (vLLM puts `uuid` on the part)

    type: Literal["image_url"]
    image_url: ImageURL

    def unsupported(self) -> tuple[str, str] | None:
        """(key, why) of the first key of the part or of its image_url this server does not take."""
        return _first_extra(("", self.model_extra), ("image_url.", self.image_url.model_extra))


class VideoURL(BaseModel):
    url: str


class VideoURLPart(BaseModel):
    """vLLM's video part: {"type": "video_url", "video_url": {"url": ...}} (proxy/video.py plans it)."""

    type: Literal["video_url"]
    video_url: VideoURL

    def unsupported(self) -> tuple[str, str] | None:
        """None: other keys of a video part are ignored, as vLLM ignores them."""
        return None


class InputAudio(BaseModel):
    """OpenAI's input_audio: the file's bytes in base64 (decoded, capped and probed by proxy/audio.py)."""

    model_config = ConfigDict(extra="allow")  # any other key: 400 unsupported_parameter, as ImageURL's

    data: str
    format: Literal["wav", "mp3"]


class InputAudioPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # refused like ImagePart's

    type: Literal["input_audio"]
    input_audio: InputAudio

    def unsupported(self) -> tuple[str, str] | None:
        return _first_extra(("", self.model_extra), ("input_audio.", self.input_audio.model_extra))


class AudioURL(BaseModel):
    model_config = ConfigDict(extra="allow")  # refused like ImageURL's

    url: str


class AudioURLPart(BaseModel):
    """vLLM's audio part: {"type": "audio_url", "audio_url": {"url": ...}}, loaded under the image URL rules."""

    model_config = ConfigDict(extra="allow")  # refused like ImagePart's

    type: Literal["audio_url"]
    audio_url: AudioURL

    def unsupported(self) -> tuple[str, str] | None:
        return _first_extra(("", self.model_extra), ("audio_url.", self.audio_url.model_extra))


MediaPart = ImagePart | VideoURLPart | InputAudioPart | AudioURLPart
# any other part type (file, refusal, ...) is a 400 naming the part
ContentPart = Annotated[TextPart | ImagePart | VideoURLPart | InputAudioPart | AudioURLPart,
                        Field(discriminator="type")]


class MMProcessorKwargs(BaseModel):
    """vLLM's `mm_processor_kwargs`, as far as it is honoured here: a request's video sampling, within the server's
    limits (checked by proxy/video.py against --max-video-frames and the model's pixel bounds), and whether each
    video's sound track goes in with its frames (Qwen2.5-Omni). Any other key is a 400 naming it; fps and num_frames
    together are a 400 (transformers refuses them too)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    fps: float | None = Field(default=None, gt=0, description="frames per second to sample from each video")
    num_frames: int | None = Field(default=None, ge=1, description="frames to sample from each video")
    max_pixels: int | None = Field(default=None, ge=1, description="pixel budget of each sampled frame")
    use_audio_in_video: bool = Field(default=False, strict=True,
                                     description="each video's sound track interleaved with its frames")
