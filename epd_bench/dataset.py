"""epd-bench's random multimodal dataset: prompts of random words plus random-noise images, short video clips and
audio clips, some repeated.

Every image is random noise (so no two distinct images share bytes, and therefore an `mm_hash`); every video is
a PyAV-made clip that writes its seed and id into its pixels (epd_bench/video_clip.py), so distinct videos never
share bytes either; every audio clip is a WAV tone that writes its seed and id into its first samples
(epd_bench/audio_clip.py). A "repeated" image, video or audio clip is the very same bytes as one an earlier request sent, which is
what lets an embedding cache skip it. A request with videos asks the server for `video_frames` frames of each
(`mm_processor_kwargs.num_frames`, what vLLM and EPD read); a clip has exactly that many frames, so the server
samples every one. Audio clips go after the videos, `audio_seconds` long each. With `system_prompt_len` every request also carries the same system message (the
`shared-prefix` workload, which a prefix cache serves from its cache). The whole dataset is a pure function of
its spec and seed.
"""
from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from epd_bench.audio_clip import wav_base64
from epd_bench.video_clip import check_clip_size, clip_data_url

# NOTE: plain, common words: most tokenizers give about one token per word for these (the bench models' small
# BPE about 3.5)
WORDS = (
    "the a of and to in is it that was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she which do "
    "their time if will way about many then them write would like so these her long make thing see him "
    "two has look more day could go come did number sound no most people my over know water than call "
    "first who may down side been now find any new work part take get place made live where after back "
    "little only round man year came show every good me give our under name very through just form "
    "sentence great think say help low line differ turn cause much mean before move right boy old too "
    "same tell does set three want air well also play small end put home read hand port large spell add "
    "even land here must big high such follow act why ask men change went light kind off need house "
    "picture try us again animal point mother world near build self earth father head stand own page"
).split()


@dataclass(frozen=True)
class DatasetSpec:
    num_prompts: int = 100
    input_len: int = 32  # words of text per prompt (about one token each)
    output_len: int = 64  # max_tokens per request
    range_ratio: float = 0.0  # lengths drawn uniformly from [len * (1 - r), len * (1 + r)]
    images_per_request: int = 1
    image_width: int = 224
    image_height: int = 224
    repeat_ratio: float = 0.0  # share of image slots that reuse an image an earlier request sent
    image_format: str = "jpeg"
    seed: int = 0
    system_prompt_len: int = 0  # words of the system message every request carries (0: none)
    videos_per_request: int = 0  # after the images; repeat_ratio applies to them as to images
    video_frames: int = 32  # frames of each clip, all of which the request asks the server to sample
    video_width: int = 224
    video_height: int = 224
    video_fps: float = 2.0  # the clip's frame rate (32 frames: a 16 s clip)
    audios_per_request: int = 0  # after the videos; repeat_ratio applies to them as to images
    audio_seconds: float = 10.0  # length of each audio clip (16 kHz mono WAV)

    def __post_init__(self) -> None:
        assert 0.0 <= self.repeat_ratio <= 1.0, "repeat_ratio must be in [0, 1]"
        assert 0.0 <= self.range_ratio < 1.0, "range_ratio must be in [0, 1)"
        assert self.image_format in ("jpeg", "png"), "image_format is jpeg or png"
        assert self.num_prompts >= 0 and self.images_per_request >= 0, "counts must be >= 0"
        assert self.system_prompt_len >= 0, "system_prompt_len must be >= 0"
        assert self.videos_per_request >= 0, "videos_per_request must be >= 0"
        assert self.audios_per_request >= 0, "audios_per_request must be >= 0"
        assert self.audio_seconds > 0, "audio_seconds must be > 0"
        if self.videos_per_request:
            assert self.video_frames >= 1 and self.video_fps > 0, "video_frames must be >= 1 and video_fps > 0"
            check_clip_size(self.video_width, self.video_height)


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    images: tuple[str, ...]  # data: URLs, in order
    image_ids: tuple[int, ...]  # which distinct image each one is (a repeat shares its id)
    output_len: int
    system: str = ""  # the system message's text; "" sends none
    videos: tuple[str, ...] = ()  # data: URLs, in order, after the images
    video_ids: tuple[int, ...] = ()  # which distinct video each one is (a repeat shares its id)
    video_frames: int = 0  # frames asked of each video (mm_processor_kwargs.num_frames); 0: no videos
    audios: tuple[str, ...] = ()  # base64 WAV files (input_audio.data), in order, after the videos
    audio_ids: tuple[int, ...] = ()  # which distinct audio clip each one is (a repeat shares its id)


def random_words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def system_prompt(spec: DatasetSpec, warm_up: bool = False) -> str:
    """The system message of every request ("" when system_prompt_len is 0); warm-ups get one of their own.

    NOTE: drawn from its own generator, so adding a system prompt leaves the rest of the dataset as it was."""
    if spec.system_prompt_len == 0:
        return ""
    return random_words(random.Random(f"system-{spec.seed}-{warm_up}"), spec.system_prompt_len)


def draw_length(rng: random.Random, base: int, ratio: float) -> int:
    lo, hi = int(base * (1 - ratio)), int(base * (1 + ratio))
    return max(1, rng.randint(lo, hi)) if hi > lo else max(1, base)


def noise_image(spec: DatasetSpec, image_id: int) -> str:
    """Distinct image `image_id` as a data URL (random noise seeded by the spec's seed and the id)."""
    pixels = np.random.default_rng([spec.seed, image_id]).integers(
        0, 256, (spec.image_height, spec.image_width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=spec.image_format.upper(), **({"quality": 90} if spec.image_format == "jpeg" else {}))
    return f"data:image/{spec.image_format};base64,{base64.b64encode(buf.getvalue()).decode()}"


class ImagePicker:
    """Per image slot: a repeat of an earlier image with probability repeat_ratio, else a new one."""

    def __init__(self, spec: DatasetSpec, rng: random.Random, first_id: int):
        self.spec, self.rng, self.next_id = spec, rng, first_id
        self.seen: list[int] = []
        self.urls: dict[int, str] = {}

    def make_url(self, item_id: int) -> str:
        return noise_image(self.spec, item_id)

    def pick(self, count: int, allow_repeats: bool) -> tuple[int, ...]:
        ids: list[int] = []
        for _ in range(count):
            candidates = [i for i in self.seen if i not in ids]  # never the same image twice in one request
            if allow_repeats and candidates and self.rng.random() < self.spec.repeat_ratio:
                ids.append(self.rng.choice(candidates))
            else:
                ids.append(self.next_id)
                self.next_id += 1
        self.seen.extend(i for i in ids if i not in self.urls)
        for i in ids:
            if i not in self.urls:
                self.urls[i] = self.make_url(i)
        return tuple(ids)


class VideoPicker(ImagePicker):
    """ImagePicker's rule for video slots: clip `id` of the spec's seed (epd_bench/video_clip.py)."""

    audio: AudioPicker | None = None  # the audio slots' picker (video_picker sets it)

    def make_url(self, item_id: int) -> str:
        s = self.spec
        return clip_data_url(s.seed, item_id, s.video_frames, s.video_width, s.video_height, s.video_fps)


class AudioPicker(ImagePicker):
    """ImagePicker's rule for audio slots: WAV clip `id` of the spec's seed (epd_bench/audio_clip.py), as base64."""

    def make_url(self, item_id: int) -> str:
        return wav_base64(self.spec.seed, item_id, self.spec.audio_seconds)


def video_picker(spec: DatasetSpec, warm_up: bool) -> VideoPicker:
    """The video slots' picker, carrying the audio slots' (`.audio`): each with its own generator, so adding videos
    or audio leaves the prompts and images as they were, and (for warm-ups) their own ids, never sent by a measured
    request."""
    p = VideoPicker(spec, random.Random(f"video-{spec.seed}-{warm_up}"), 1_000_000_000 if warm_up else 0)
    p.audio = AudioPicker(spec, random.Random(f"audio-{spec.seed}-{warm_up}"), 1_000_000_000 if warm_up else 0)
    return p


def build_dataset(spec: DatasetSpec, num_warmups: int = 0) -> tuple[list[SampleRequest], list[SampleRequest]]:
    """(warm-up requests, measured requests). Warm-ups use their own images and system prompt, never seen again."""
    rng = random.Random(spec.seed)
    warm_picker = ImagePicker(spec, random.Random(spec.seed + 1), first_id=1_000_000_000)
    picker = ImagePicker(spec, rng, first_id=0)
    videos = {True: video_picker(spec, warm_up=True), False: video_picker(spec, warm_up=False)}

    def sample(p: ImagePicker, warm_up: bool) -> SampleRequest:
        words = random_words(rng, draw_length(rng, spec.input_len, spec.range_ratio))
        ids = p.pick(spec.images_per_request, allow_repeats=not warm_up)
        return SampleRequest(prompt=words, images=tuple(p.urls[i] for i in ids), image_ids=ids,
                             output_len=draw_length(rng, spec.output_len, spec.range_ratio),
                             system=system_prompt(spec, warm_up), **pick_videos(videos[warm_up], warm_up))

    warmups = [sample(warm_picker, warm_up=True) for _ in range(num_warmups)]
    return warmups, [sample(picker, warm_up=False) for _ in range(spec.num_prompts)]


def pick_videos(p: VideoPicker, warm_up: bool) -> dict[str, Any]:
    """A request's video and audio fields (SampleRequest keywords): none of either the spec has none of."""
    fields: dict[str, Any] = {}
    if p.spec.videos_per_request:
        ids = p.pick(p.spec.videos_per_request, allow_repeats=not warm_up)
        fields |= {"videos": tuple(p.urls[i] for i in ids), "video_ids": ids, "video_frames": p.spec.video_frames}
    if p.spec.audios_per_request and p.audio is not None:
        ids = p.audio.pick(p.spec.audios_per_request, allow_repeats=not warm_up)
        fields |= {"audios": tuple(p.audio.urls[i] for i in ids), "audio_ids": ids}
    return fields


def repeat_share(requests: list[SampleRequest]) -> float:
    """Share of image, video and audio slots whose image (video, clip) an earlier request (or slot) already sent."""
    seen: set[tuple[str, int]] = set()
    slots = repeats = 0
    for r in requests:
        for key in [("image", i) for i in r.image_ids] + [("video", i) for i in r.video_ids] + \
                [("audio", i) for i in r.audio_ids]:
            slots += 1
            repeats += key in seen
            seen.add(key)
    return repeats / slots if slots else 0.0
