"""epd-bench's audio: the WAV clips (valid, the length asked, distinct by construction), the dataset's audio slots
(new per request unless the repeat rule repeats one) and what reaches the server (`input_audio` parts after the
images and videos), against the fake server."""
from __future__ import annotations

import base64
import io
import wave
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from epd_bench.audio_clip import SAMPLING_RATE, clip_samples, make_wav
from epd_bench.backends import RequestInput, _decoder_body, user_message
from epd_bench.conversations import MultiTurnSpec, build_conversations
from epd_bench.dataset import DatasetSpec, build_dataset, repeat_share
from epd_bench.serve import dataset_spec, parse_args, run
from epd_common.audio import probe_audio
from tests.bench.conftest import FakeServer

SPEC = DatasetSpec(num_prompts=12, input_len=6, output_len=4, images_per_request=0, repeat_ratio=0.5, seed=5,
                   audios_per_request=2, audio_seconds=0.25)


def _read_wav(data: bytes) -> tuple[int, int, int, np.ndarray]:
    with wave.open(io.BytesIO(data), "rb") as w:
        return w.getnchannels(), w.getsampwidth(), w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2")


@pytest.mark.parametrize("seconds", [0.01, 0.5, 2.0])
def test_a_clip_is_16khz_mono_pcm_wav_of_the_length_asked(seconds: float) -> None:
    data = make_wav(seed=3, audio_id=9, seconds=seconds)
    channels, width, rate, samples = _read_wav(data)
    assert (channels, width, rate, len(samples)) == (1, 2, SAMPLING_RATE, round(seconds * SAMPLING_RATE))
    assert np.array_equal(samples, clip_samples(3, 9, seconds))
    info = probe_audio(data)  # what the proxy and the encoders check a clip with
    assert (info.container, info.sample_rate, info.channels) == ("wav", SAMPLING_RATE, 1)
    assert info.duration_s == pytest.approx(seconds, abs=1e-3)


def test_clips_are_distinct_by_seed_and_id_and_the_same_when_asked_again() -> None:
    one = make_wav(1, 2, 0.1)
    assert make_wav(1, 2, 0.1) == one
    assert len({one, make_wav(1, 3, 0.1), make_wav(2, 2, 0.1), make_wav(3, 1, 0.1)}) == 4
    # the header spells seed and id: ids whose tones happened to match would still differ there
    assert not np.array_equal(clip_samples(0, 4, 0.1)[:1024], clip_samples(0, 5, 0.1)[:1024])
    with pytest.raises(ValueError, match="seconds"):
        make_wav(0, 0, 0.0)


def _ids_and_clips(requests: list[Any]) -> dict[int, str]:
    by_id: dict[int, str] = {}
    for r in requests:
        for i, b64 in zip(r.audio_ids, r.audios, strict=True):
            assert by_id.setdefault(i, b64) == b64  # a repeat is the very same bytes
    return by_id


def test_audio_slots_follow_the_repeat_rule_and_leave_the_rest_of_the_dataset_alone() -> None:
    warm, requests = build_dataset(SPEC, num_warmups=2)
    no_audio = build_dataset(replace(SPEC, audios_per_request=0), num_warmups=2)
    assert [(r.prompt, r.images, r.output_len) for r in warm + requests] == \
        [(r.prompt, r.images, r.output_len) for r in no_audio[0] + no_audio[1]]
    assert all(r.audios == () and r.audio_ids == () for r in no_audio[1])
    assert all(len(r.audios) == 2 and len(set(r.audio_ids)) == 2 for r in requests)
    by_id = _ids_and_clips(requests)
    assert len(set(by_id.values())) == len(by_id) < 2 * len(requests)  # some repeated, all distinct bytes
    assert not {b for r in warm for b in r.audios} & set(by_id.values())  # warm-ups never send a measured clip
    assert 0 < repeat_share(requests) < 1
    assert len(_read_wav(base64.b64decode(requests[0].audios[0]))[3]) == 4000  # 0.25 s


def test_without_repeats_every_clip_is_new() -> None:
    _, requests = build_dataset(replace(SPEC, repeat_ratio=0.0))
    by_id = _ids_and_clips(requests)
    assert len(by_id) == 2 * len(requests) == len(set(by_id.values()))
    assert repeat_share(requests) == 0.0
    # audio clip 0 and image 0 / video 0 are different things
    _, mixed = build_dataset(replace(SPEC, repeat_ratio=0.0, images_per_request=1, image_width=8, image_height=8,
                                     num_prompts=2))
    assert repeat_share(mixed) == 0.0


def test_a_conversation_sends_its_clips_in_the_first_turn_only() -> None:
    _, convs = build_conversations(MultiTurnSpec(replace(SPEC, repeat_ratio=1.0), conversations=2, turns=2))
    for c in convs:
        assert len(c.turns[0].audios) == 2 and c.turns[1].audios == ()
    assert not set(convs[0].turns[0].audio_ids) & set(convs[1].turns[0].audio_ids)  # no repeats, as its images


def test_the_user_turn_puts_images_then_videos_then_audio_then_text() -> None:
    (sample,) = build_dataset(replace(SPEC, num_prompts=1, images_per_request=1, image_width=8, image_height=8))[1]
    sample = replace(sample, videos=("data:video/mp4;base64,AAAA",))
    content = user_message(sample)["content"]
    assert [p["type"] for p in content] == ["image_url", "video_url", "input_audio", "input_audio", "text"]
    assert [p["input_audio"] for p in content[2:4]] == [{"data": b, "format": "wav"} for b in sample.audios]
    with pytest.raises(ValueError, match="no audio"):
        _decoder_body(RequestInput(url="http://x", model="m", sample=replace(sample, videos=())))


def bench(fake: FakeServer, *flags: str) -> dict[str, Any]:
    return run(["--base-url", fake.url, "--disable-tqdm", "--random-input-len", "4", "--random-output-len", "2",
                *flags])


def test_audio_reaches_the_server_as_input_audio_parts(fake_server: FakeServer) -> None:
    r = bench(fake_server, "--num-prompts", "2", "--images-per-request", "1", "--image-size", "16",
              "--audios-per-request", "1", "--audio-seconds", "0.5")
    assert r["completed"] == 2 and r["dataset"]["audios_per_request"] == 1 and r["dataset"]["audio_seconds"] == 0.5
    clips = []
    for body in fake_server.bodies:
        (message,) = body["messages"]
        assert [p["type"] for p in message["content"]] == ["image_url", "input_audio", "text"]
        part = message["content"][1]["input_audio"]
        assert part["format"] == "wav"
        clips.append(base64.b64decode(part["data"]))
        assert len(_read_wav(clips[-1])[3]) == 8000 and "mm_processor_kwargs" not in body
    assert len(set(clips)) == 2


def test_the_flags_parse_into_the_dataset() -> None:
    args = parse_args(["--audios-per-request", "2", "--audio-seconds", "120"])
    spec = dataset_spec(args)
    assert isinstance(spec, DatasetSpec) and (spec.audios_per_request, spec.audio_seconds) == (2, 120.0)
    default = dataset_spec(parse_args([]))
    assert isinstance(default, DatasetSpec) and (default.audios_per_request, default.audio_seconds) == (0, 10.0)


@pytest.mark.parametrize("bad", [
    ["--audios-per-request", "-1"],
    ["--audios-per-request", "1", "--audio-seconds", "0"],
    ["--audios-per-request", "1", "--backend", "epd-decoder"],
])
def test_bad_audio_flags_are_usage_errors(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run(["--base-url", "http://127.0.0.1:9", *bad])
    assert exc.value.code == 2 and "audio" in capsys.readouterr().err
