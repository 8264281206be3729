"""The disk tier on its own: round trips, the byte bound, the folder lock, and every file it must refuse."""
from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from connector.tensors.disk_format import MAGIC, DiskHeader, encode_file, encode_head, file_key, file_name
from connector.tensors.disk_tier import DiskTier, DiskTierError
from epd_contracts.embeddings import ImageFeatures

FP = "model-a"
KEY = file_key("the fleet's internal key")
WAIT_S = 10.0  # the writer thread's guard; never reached when things work


def features(seed: int, rows: int = 6, deepstack: bool = False) -> ImageFeatures:
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(rows, 16, generator=g).to(torch.bfloat16)
    deep = torch.randn(2, rows, 16, generator=g).to(torch.bfloat16) if deepstack else None
    return ImageFeatures(embeds, (1, 2, rows * 2), span=tuple(range(rows + 2)), deepstack=deep)


def same(a: ImageFeatures, b: ImageFeatures) -> bool:
    deep = (a.deepstack is None and b.deepstack is None) or (
        a.deepstack is not None and b.deepstack is not None and torch.equal(a.deepstack, b.deepstack))
    return torch.equal(a.embeds, b.embeds) and a.grid_thw == b.grid_thw and a.span == b.span and deep


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[list[DiskTier]]:
    """Tiers a test opens, closed after it (a tier holds its folder's lock until closed)."""
    opened: list[DiskTier] = []
    yield opened
    for tier in opened:
        tier.close()


def open_tier(tiers: list[DiskTier], folder: Path, max_bytes: int = 1 << 20, fp: str = FP) -> DiskTier:
    tier = DiskTier(folder, max_bytes, fp, key=KEY)
    tiers.append(tier)
    return tier


def written(tier: DiskTier, items: dict[str, ImageFeatures]) -> DiskTier:
    for h, f in items.items():
        assert tier.put(h, f)
    assert tier.flush(WAIT_S)
    return tier


def reopen(tiers: list[DiskTier], tier: DiskTier, max_bytes: int = 1 << 20) -> DiskTier:
    tiers.remove(tier)
    tier.close()
    return open_tier(tiers, tier.directory, max_bytes)


def test_round_trip_through_a_restart_keeps_every_bit(tiers: list[DiskTier], tmp_path: Path) -> None:
    items = {"a": features(1), "b": features(2, deepstack=True), "c": ImageFeatures(torch.randn(3, 4), None)}
    tier = reopen(tiers, written(open_tier(tiers, tmp_path), items))
    assert sorted(tier.hashes()) == ["a", "b", "c"] and tier.stats()["disk_skipped_files"] == 0
    for h, want in items.items():
        got = tier.load(h)
        assert got is not None and same(got, want)
    assert tier.stats()["disk_hits"] == 3 and tier.load("missing") is None


def test_a_queued_item_is_held_and_loadable_before_it_is_written(tiers: list[DiskTier], tmp_path: Path) -> None:
    tier = open_tier(tiers, tmp_path)
    f = features(3)
    assert tier.put("q", f)
    assert tier.holds("q")  # queued or written: held either way
    assert tier.load("q") is not None
    assert not tier.put("q", f)  # already held


def test_least_recently_used_files_go_first_and_the_bound_holds(tiers: list[DiskTier], tmp_path: Path) -> None:
    probe = open_tier(tiers, tmp_path / "probe")
    size = sum(memoryview(p).nbytes for p in encode_file(FP, "x0", features(0), KEY))
    tier = open_tier(tiers, tmp_path / "lru", max_bytes=3 * size + size // 2)  # three files fit
    forgotten: list[str] = []
    tier.on_forget = forgotten.extend
    written(tier, {"x0": features(0), "x1": features(1), "x2": features(2)})
    assert tier.load("x0") is not None  # x0 is now the most recent; x1 the least
    written(tier, {"x3": features(3)})
    assert sorted(tier.hashes()) == ["x0", "x2", "x3"] and forgotten == ["x1"]
    assert tier.stats()["disk_bytes"] <= tier.max_bytes
    assert sorted(os.listdir(tier.directory / FP)) == sorted(file_name(h) for h in ("x0", "x2", "x3"))
    assert probe.stats()["disk_items"] == 0


def test_a_lowered_bound_is_applied_at_start(tiers: list[DiskTier], tmp_path: Path) -> None:
    tier = written(open_tier(tiers, tmp_path), {f"h{i}": features(i) for i in range(4)})
    one = int(tier.stats()["disk_bytes"]) // 4
    tier = reopen(tiers, tier, max_bytes=2 * one)
    assert tier.stats()["disk_items"] == 2 and len(os.listdir(tmp_path / FP)) == 2


def test_one_encoder_per_folder(tiers: list[DiskTier], tmp_path: Path) -> None:
    open_tier(tiers, tmp_path)
    with pytest.raises(DiskTierError, match="in use by another encoder"):
        DiskTier(tmp_path, 1 << 20, FP, key=KEY)


def test_a_symlinked_fingerprint_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / FP).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DiskTierError, match="symlink"):
        DiskTier(tmp_path / "dir", 1 << 20, FP, key=KEY)


def test_another_models_files_are_never_read_nor_removed(tiers: list[DiskTier], tmp_path: Path) -> None:
    theirs = written(open_tier(tiers, tmp_path, fp="model-b"), {"a": features(1)})
    tiers.remove(theirs)
    theirs.close()
    ours = open_tier(tiers, tmp_path)
    assert ours.hashes() == [] and ours.load("a") is None
    assert (tmp_path / "model-b" / file_name("a")).exists()


def _hostile_files(folder: Path, outside: Path) -> dict[str, str]:
    """name -> why it must be skipped; each next to one good file."""
    good = b"".join(bytes(memoryview(p).cast("B")) for p in encode_file(FP, "good", features(1), KEY))
    foreign = b"".join(bytes(memoryview(p).cast("B")) for p in encode_file("model-b", "foreign", features(2), KEY))
    head_len = struct.unpack("<8sI", good[:12])[1]
    header = msgspec.msgpack.decode(good[28:28 + head_len], type=DiskHeader)
    huge_item = msgspec.structs.replace(header.item, mm_hash="huge", shape=[1 << 40, 1 << 20], num_tokens=1 << 40)
    huge = encode_head(msgspec.structs.replace(header, item=huge_item, payload_bytes=1 << 62), KEY)
    files = {
        file_name("truncated"): good[:-7],
        file_name("bad-magic"): b"NOTEPD\x00\x01" + good[8:],
        file_name("foreign"): foreign,
        file_name("huge"): huge + b"\x00" * 64,
        file_name("huge-header"): struct.pack("<8sI16s", MAGIC, 1 << 31, bytes(16)) + b"\x00" * 64,
        file_name("garbage-header"): struct.pack("<8sI16s", MAGIC, 16, bytes(16)) + b"\xff" * 16,
        file_name("renamed"): good,  # a whole file, but under another item's name
        "notes.txt": b"hello",
        file_name("empty"): b"",
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    (outside / "target.emb").write_bytes(good)
    (folder / file_name("good")).symlink_to(outside / "target.emb")  # a symlink out of the folder, named right
    (folder / file_name("a-folder")).mkdir()
    return {**dict.fromkeys(files, "skipped"), file_name("good"): "symlink", file_name("a-folder"): "folder"}


def test_hostile_files_are_skipped_and_logged_never_a_crash(tiers: list[DiskTier], tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    folder, outside = tmp_path / "dir", tmp_path / "outside"
    (folder / FP).mkdir(parents=True)
    outside.mkdir()
    hostile = _hostile_files(folder / FP, outside)
    (folder / FP / ".tmp-0123").write_bytes(b"a write cut short")
    with caplog.at_level(logging.WARNING, logger="epd.connector"):
        tier = open_tier(tiers, folder)
    assert tier.hashes() == [] and tier.stats()["disk_skipped_files"] == len(hostile)
    assert all(name in caplog.text for name in hostile)
    assert not (folder / FP / ".tmp-0123").exists()  # leftovers of a killed write are removed
    # so is every file that failed (the folder is ours: nothing in it is another's to keep), never a folder
    assert sorted(os.listdir(folder / FP)) == [file_name("a-folder")]
    assert (outside / "target.emb").exists()  # nothing outside the folder is touched
    written(tier, {"fresh": features(5)})  # and the tier works
    assert tier.load("fresh") is not None


def test_a_file_altered_after_indexing_is_caught_by_its_digest(tiers: list[DiskTier], tmp_path: Path) -> None:
    tier = reopen(tiers, written(open_tier(tiers, tmp_path), {"a": features(1)}))
    forgotten: list[str] = []
    tier.on_forget = forgotten.extend
    path = tmp_path / FP / file_name("a")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one payload bit: same length, same header
    path.write_bytes(bytes(data))
    assert tier.load("a") is None and forgotten == ["a"] and not tier.holds("a")
    assert tier.stats()["disk_failures"] == 1 and not path.exists()


def test_a_file_swapped_for_a_symlink_after_indexing_is_not_followed(tiers: list[DiskTier], tmp_path: Path) -> None:
    tier = reopen(tiers, written(open_tier(tiers, tmp_path), {"a": features(1)}))
    path = tmp_path / FP / file_name("a")
    target = tmp_path / "target"
    target.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(target)
    assert tier.load("a") is None and not tier.holds("a")


def test_items_larger_than_the_tier_or_the_queue_are_not_written(tiers: list[DiskTier], tmp_path: Path) -> None:
    tier = open_tier(tiers, tmp_path, max_bytes=1000)
    assert not tier.put("big", ImageFeatures(torch.zeros(100, 16)))  # 6,400 bytes
    small = DiskTier(tmp_path / "q", 1 << 20, FP, key=KEY, max_queued_bytes=100)
    tiers.append(small)
    assert not small.put("big", ImageFeatures(torch.zeros(100, 16)))
    assert tier.stats()["disk_writes_dropped"] == 1 and small.stats()["disk_writes_dropped"] == 1
