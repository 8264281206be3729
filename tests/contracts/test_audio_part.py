"""AudioPart on the wire and the chunk plan of a clip (epd_contracts/audio.py)."""
from __future__ import annotations

import msgspec
import pytest

from epd_contracts.audio import CHUNK_MARGIN_S, AudioConfig, AudioPart, audio_hash, chunk_hash, part_hash, plan_chunks
from epd_contracts.encode import EncodeItem


@pytest.mark.parametrize("raw", [
    {"sample_rate": 0}, {"sample_rate": 10**9}, {"sample_rate": 16_000, "window": -1.0},
    {"sample_rate": 16_000, "first": 1},  # a chunk without the family's window
    {"sample_rate": 16_000, "window": 2.0, "count": -1}, {"sample_rate": 16_000, "window": 2.0, "first": 1 << 20},
    {"sample_rate": 16_000, "extra": 1},
])
def test_bad_parts_are_refused_on_decode(raw: dict[str, object]) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode({"data": "", "audio": raw}), type=EncodeItem)


def test_a_whole_clip_is_named_by_its_clip_hash_and_its_chunks_apart() -> None:
    data = b"RIFF...."
    whole = AudioPart(sample_rate=16_000, window=2.0)
    clip = audio_hash(data, AudioConfig(sample_rate=16_000))
    assert part_hash(data, whole) == clip == part_hash(data, AudioPart(sample_rate=16_000))  # the window: no rows
    first = AudioPart(sample_rate=16_000, window=2.0, count=3)
    rest = AudioPart(sample_rate=16_000, window=2.0, first=3)
    assert len({clip, part_hash(data, first), part_hash(data, rest)}) == 3
    assert part_hash(data, rest) == chunk_hash(clip, 3, 0) and rest.last and not first.last and whole.whole


def test_plans_cut_whole_windows_and_leave_no_chunk_empty() -> None:
    assert plan_chunks("c", 120.0, 0.0, 30.0) == [plan_chunks("c", 1.0, 2.0, 30.0)[0]]  # no window: one chunk
    plan = plan_chunks("c", 120.0, 2.0, 30.0)  # 15 windows a chunk; 4 chunks, the last to the end
    assert [(c.first, c.count) for c in plan] == [(0, 15), (15, 15), (30, 15), (45, 0)]
    assert plan[0].mm_hash == chunk_hash("c", 0, 15) and plan[-1].mm_hash == chunk_hash("c", 45, 0)
    # 60.1 s counted (a codec's padding past 60 s): no chunk starts within the margin of the end
    assert len(plan_chunks("c", 60.0 + CHUNK_MARGIN_S / 2, 2.0, 30.0)) == 2
    assert [(c.first, c.count) for c in plan_chunks("c", 45.0, 40.0, 30.0)] == [(0, 1), (1, 0)]  # Phi-4: 40 s
    assert [c.mm_hash for c in plan_chunks("c", 29.0, 2.0, 30.0)] == ["c"]  # within one chunk: the clip itself
