"""Encode each image once per mm_hash: the one algorithm of the encoder worker and the aggregated decoder.

Held items come from the store; the rest are decoded first (so bad bytes fail the call before any vision
work), then encoded in batches of at most `max_batch_size` under one lock (the store is asked again after
taking it: a call that waited may find its images encoded by the one before), checked, and stored by hash.
If anything fails, the store is told which items will not come (`mark_failed`), so a decoder already waiting
for them (a pipelined gather) hears it now, not at its timeout.

Videos (items with a VideoPart: a whole video, or a chunk of its sampled frames; epd_contracts/video.py) take the
same path: outside the lock, where images are decoded, the part's frames are checked against this checkpoint's
sampling and decoded (epd_models/video_jobs.py); under the lock parts batched together are one
`VisionHalf.encode_videos` (one forward where the family joins clips). A video that cannot be used raises
UndecodableVideo naming its item and the 400 code it gets.

Audio clips (items with an AudioPart: a whole clip, or a chunk of its encoder windows; epd_contracts/audio.py) the
same way: decoded to the family's rate outside the lock (epd_models/audio_jobs.py), one `VisionHalf.encode_audios`
under it; a clip that cannot be used raises UndecodableAudio.

The store is the encoder's connector producer, or the aggregated decoder's own cache: this module imports
neither, only the four methods it needs (`EmbeddingStore`).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from PIL import Image

from epd_common.audio_limits import AudioLimits
from epd_common.images import ImageError, load_image
from epd_common.video import VideoLimits
from epd_common.video_sampling import VideoConfig
from epd_contracts.audio import AudioPart
from epd_contracts.embeddings import ImageFeatures
from epd_contracts.video import VideoPart
from epd_models.audio import AudioError as AudioInputsError
from epd_models.audio_jobs import AudioJob, UndecodableAudio, audio_job
from epd_models.halves import VisionHalf
from epd_models.video import VideoError as VideoInputsError
from epd_models.video_config import video_config
from epd_models.video_jobs import UndecodableVideo, VideoJob, video_job

logger = logging.getLogger("epd.encoder")
Check = Callable[[ImageFeatures], "str | None"]  # a reason to refuse an embedding, or None


class EmbeddingStore(Protocol):
    """Where encoded items are kept by mm_hash (the names of the connector's producer)."""

    def get_cache_item(self, mm_hash: str) -> ImageFeatures | None: ...

    def has_cache_item(self, mm_hash: str) -> bool: ...

    def save_caches(self, mm_hash: str, features: ImageFeatures) -> None: ...

    def mark_failed(self, mm_hashes: list[str]) -> None: ...


class UndecodableImage(ImageError):
    """An item's bytes are not an image we accept (the message says why); `mm_hash` names the item."""

    def __init__(self, mm_hash: str, cause: ImageError):
        super().__init__(str(cause))
        self.mm_hash = mm_hash


class EmbeddingsRefused(Exception):
    """The check refused encoded items (mm_hash -> why); none of their batch was stored."""

    def __init__(self, reasons: dict[str, str]):
        super().__init__(reasons)
        self.reasons = reasons


@dataclass(frozen=True)
class ImageJob:
    """An image item decoded and waiting for its vision forward; images of one `group` can share a forward."""

    mm_hash: str
    image: Image.Image
    detail: str = "auto"
    multi_image: bool = False
    lora: int = 0  # the LoRA slot of the vision half's adapters it is encoded under (0: the base model)

    @property
    def group(self) -> tuple[str, bool, int]:
        return self.detail, self.multi_image, self.lora


Job = ImageJob | VideoJob | AudioJob


@dataclass(frozen=True)
class Encoded:
    features: ImageFeatures
    cached: bool  # held before this call asked for it (not encoded by it)


class CachingEncoder:
    """Encodes what `store` does not hold yet, one vision forward at a time; counts what it did."""

    def __init__(self, vision: VisionHalf, store: EmbeddingStore, max_batch_size: int = 16,
                 max_image_pixels: int = 40_000_000, check: Check | None = None,
                 video_limits: VideoLimits | None = None, audio_limits: AudioLimits | None = None):
        self.vision, self.store, self.check = vision, store, check
        self.max_batch_size, self.max_image_pixels = max_batch_size, max_image_pixels
        self.video_limits = video_limits or VideoLimits()
        self.audio_limits = audio_limits or AudioLimits()
        self.num_encoded = 0  # items that went through the vision tower
        self.num_already_cached = 0  # items asked for that were already held
        self._lock = threading.Lock()
        self._video_config: tuple[VideoConfig | None] | None = None  # read on the first video

    @property
    def video_config(self) -> VideoConfig | None:
        """This checkpoint's video sampling settings (None: it takes no video), read once."""
        if self._video_config is None:
            self._video_config = (video_config(self.vision.model_dir, self.vision.adapter.name),)
        return self._video_config[0]

    def encode(self, items: Mapping[str, bytes], details: Mapping[str, str] | None = None,
               multi_image: Collection[str] = (), videos: Mapping[str, VideoPart] | None = None,
               audios: Mapping[str, AudioPart] | None = None, loras: Mapping[str, int] | None = None
               ) -> dict[str, Encoded]:
        """Each item's features by mm_hash. Raises UndecodableImage, UndecodableVideo, UndecodableAudio,
        EmbeddingsRefused, or what the vision raised.

        `details`: mm_hash -> image_url.detail for items not at "auto" (their hash already says so: epd_contracts.
        hashing); `multi_image`: the items encoded as one of several images of their prompt (the same); items of
        one detail and multi_image are batched together. `videos`: mm_hash -> VideoPart for the items that are
        videos (their hash is epd_contracts.video.part_hash of the bytes and the part), each encoded on its own;
        `audios` the same for audio clips and chunks (epd_contracts.audio.part_hash; epd_models/audio_jobs.py);
        `loras`: mm_hash -> the vision half's LoRA slot for images encoded under an adapter (their hash is
        epd_contracts.hashing.adapter_hash), batched apart.
        """
        done, jobs = self.prepare(items, details, multi_image, videos, audios, loras)
        groups: dict[tuple[str, bool, int], list[ImageJob]] = {}
        for job in jobs:
            if isinstance(job, ImageJob):
                groups.setdefault(job.group, []).append(job)
        batches = [g[i : i + self.max_batch_size] for g in groups.values() for i in range(0, len(g), self.max_batch_size)]
        todo: list[Sequence[Job]] = [*batches, *([j] for j in jobs if isinstance(j, (VideoJob, AudioJob)))]
        try:
            for batch in todo:
                done.update(self.run(batch))
        except BaseException:
            self.store.mark_failed([j.mm_hash for batch in todo for j in batch if j.mm_hash not in done])
            raise
        return done

    def prepare(self, items: Mapping[str, bytes], details: Mapping[str, str] | None = None,
                multi_image: Collection[str] = (), videos: Mapping[str, VideoPart] | None = None,
                audios: Mapping[str, AudioPart] | None = None, loras: Mapping[str, int] | None = None
                ) -> tuple[dict[str, Encoded], list[Job]]:
        """The items held already, and a job for each of the others: its image decoded (or its video's frames),
        outside any lock, so bad bytes fail before any vision work (the store is told those items will not come)."""
        videos, details, audios, loras = videos or {}, details or {}, audios or {}, loras or {}
        done = self._held(items)
        todo = {h: data for h, data in items.items() if h not in done}
        try:
            jobs: list[Job] = [ImageJob(h, self._load(h, data), details.get(h, "auto"), h in multi_image, loras.get(h, 0))
                               for h, data in todo.items() if h not in videos and h not in audios]
            jobs += [video_job(h, data, videos[h], self.video_config, self.vision.adapter.name, self.video_limits)
                     for h, data in todo.items() if h in videos]
            jobs += [audio_job(h, data, audios[h], self.vision.audio_config, self.vision.adapter.name,
                               self.audio_limits) for h, data in todo.items() if h in audios]
        except BaseException:
            self.store.mark_failed(list(todo))
            raise
        return done, jobs

    def run(self, jobs: Sequence[Job]) -> dict[str, Encoded]:
        """One vision forward for a batch of images of one group (`ImageJob.group`), or one video part; the items
        the store holds by now (another call encoded them) are not encoded again. Raises as `encode` does; the
        caller tells the store about the items that will not come."""
        images = [j for j in jobs if isinstance(j, ImageJob)]
        assert len({j.group for j in jobs}) <= 1, "one batch is images of one group, video parts or audio items"
        with self._lock:
            done = self._held([j.mm_hash for j in jobs if self.store.has_cache_item(j.mm_hash)])
            todo = [j for j in jobs if j.mm_hash not in done]
            batch = {j.mm_hash: j.image for j in todo if isinstance(j, ImageJob)}
            if batch:
                done.update(self._encode_batch(batch, *images[0].group))
            videos = [j for j in todo if isinstance(j, VideoJob)]
            if videos:
                done.update(self._encode_videos(videos))
            audios = [j for j in todo if isinstance(j, AudioJob)]
            if audios:
                done.update(self._encode_audios(audios))
        return done

    def _held(self, hashes: Iterable[str]) -> dict[str, Encoded]:
        held = {h: Encoded(f, cached=True) for h in hashes if (f := self.store.get_cache_item(h)) is not None}
        self.num_already_cached += len(held)
        return held

    def _load(self, mm_hash: str, data: bytes) -> Image.Image:
        try:
            return load_image(data, self.max_image_pixels)
        except ImageError as exc:
            raise UndecodableImage(mm_hash, exc) from exc

    def _encode_videos(self, jobs: list[VideoJob]) -> dict[str, Encoded]:
        """Encode, check and store video parts batched together (under the lock)."""
        clips = []
        for job in jobs:
            sampling = job.clip.part.sampling
            try:
                clips.append(self.vision.video_clip(job.clip.frames, sampling.fps, sampling.max_pixels,
                                                    frame_times=job.clip.times, last=job.clip.part.last,
                                                    total_frames=job.clip.part.total))
            except VideoInputsError as exc:
                raise UndecodableVideo(job.mm_hash, str(exc)) from exc
        try:
            outs = self.vision.encode_videos(clips)
        except VideoInputsError as exc:  # frames the family's video inputs cannot be made of (size, pixel budget)
            # NOTE: a batch of several that fails is rerun part by part (the encode scheduler), so the error names
            # the part it belongs to
            raise UndecodableVideo(jobs[0].mm_hash, str(exc)) from exc
        return self._store({job.mm_hash: out for job, out in zip(jobs, outs, strict=True)}, "video part")

    def _encode_audios(self, jobs: list[AudioJob]) -> dict[str, Encoded]:
        """Encode, check and store audio items batched together (under the lock)."""
        try:
            outs = self.vision.encode_audios([job.clip for job in jobs])
        except AudioInputsError as exc:  # a chunk past the clip's end, a family without audio
            raise UndecodableAudio(jobs[0].mm_hash, str(exc)) from exc
        return self._store({job.mm_hash: out for job, out in zip(jobs, outs, strict=True)}, "audio item")

    def _encode_batch(self, images: dict[str, Image.Image], detail: str = "auto",
                      multi_image: bool = False, lora: int = 0) -> dict[str, Encoded]:
        """Encode, check and store one batch (under the lock; `lora`: under that adapter of the vision half's)."""
        # the vision half runs on its device and hands back CPU tensors (one copy per batch): the connector
        # sends their memory as ZeroMQ frames without copying
        if self.vision.lora is not None:
            self.vision.lora.use(lora)
        try:
            outs = dict(zip(images, self.vision.encode(list(images.values()), detail, multi_image), strict=True))
        finally:
            if self.vision.lora is not None:
                self.vision.lora.use(0)
        return self._store(outs, "item")

    def _store(self, outs: dict[str, ImageFeatures], kind: str) -> dict[str, Encoded]:
        """Check and store what was encoded (under the lock): all of it, or none if the check refuses any."""
        refused = {h: why for h, out in outs.items() if self.check is not None and (why := self.check(out))}
        if refused:
            raise EmbeddingsRefused(refused)
        for h, out in outs.items():
            self.store.save_caches(h, out)
        self.num_encoded += len(outs)
        logger.info("encoded %d %s(s)", len(outs), kind)
        return {h: Encoded(out, cached=False) for h, out in outs.items()}
