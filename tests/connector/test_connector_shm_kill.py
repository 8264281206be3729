"""kill -9 of either side of a shared-memory gather leaves nothing behind (no /dev/shm name, no mapping, no fd).

Only each test's own processes are looked at: this one and the child it starts, never the rest of the machine.
"""
from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from connector.tensors import shm
from connector.tensors.consumer import ECConsumer
from connector.tensors.producer import ECProducer
from epd_contracts.embeddings import ImageFeatures

GUARD_S = 10.0
ROOT = Path(__file__).resolve().parents[2]


def mapped_inodes(pid: int | str = "self") -> set[int]:
    """Inodes of the epd-ec segments the process maps."""
    lines = (line.split() for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
    return {int(parts[4]) for parts in lines if len(parts) >= 6 and parts[5].startswith(f"/memfd:{shm.NAME}")}


_PRODUCER = textwrap.dedent("""
    import sys, torch
    from connector.tensors.producer import ECProducer
    from epd_contracts.embeddings import ImageFeatures
    p = ECProducer(shm_min_bytes=0).start()
    p.save_caches("a", ImageFeatures(torch.arange(4096, dtype=torch.float32).reshape(64, 64)))
    print(p.address, flush=True)
    sys.stdin.read()
""")
_CONSUMER = textwrap.dedent("""
    import sys
    from connector.tensors.consumer import ECConsumer
    c = ECConsumer()
    got = c.gather(["a"], {"a": sys.argv[1]}, 10.0)["a"]
    print(c.stats()["shm_items_received"], flush=True)
    sys.stdin.read()
""")


def _child(code: str, *args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()  # the child prints once it is ready; it exits with an error otherwise
    assert line, f"child exited with {proc.wait(timeout=GUARD_S)}"
    return proc, line


def _kill9(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(timeout=GUARD_S)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def _named_shm(pid: int | str = "self") -> set[str]:
    """The /dev/shm files the process maps or holds open (segments are anonymous memfds: none of them)."""
    fds = f"/proc/{pid}/fd"
    links = set()
    for fd in os.listdir(fds):
        with contextlib.suppress(OSError):  # the fd listdir itself used is gone
            links.add(os.readlink(f"{fds}/{fd}"))
    maps = {line.split()[5] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if len(line.split()) >= 6}
    return {path for path in links | maps if path.startswith("/dev/shm/")}


def _segment_fds(pid: int | str = "self") -> set[int]:
    """Inodes of the epd-ec segments the process holds an fd of."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:{shm.NAME}"):
                out.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
    return out


def test_kill_9_of_the_producer_leaves_nothing_behind() -> None:
    named, mapped = _named_shm(), mapped_inodes()
    producer, address = _child(_PRODUCER)
    consumer = ECConsumer()
    try:
        got = consumer.gather(["a"], {"a": address}, GUARD_S)["a"]
        assert consumer.stats()["shm_items_received"] == 1
        segments = mapped_inodes() - mapped  # the producer's segment(s) this process now maps
        assert segments and segments <= _segment_fds(producer.pid) and not _named_shm(producer.pid)
        _kill9(producer)
        assert torch.equal(got.embeds, torch.arange(4096, dtype=torch.float32).reshape(64, 64))  # pages live on
    finally:
        consumer.close()
        if producer.poll() is None:
            _kill9(producer)
    assert producer.returncode == -9  # killed and reaped: its fds and mappings went with it
    del got, consumer  # the consumer's cache held the item: release it
    gc.collect()
    assert not segments & (mapped_inodes() | _segment_fds()) and _named_shm() == named


def test_kill_9_of_the_consumer_leaves_nothing_behind() -> None:
    named, before = _named_shm(), _segment_fds()
    producer = ECProducer(shm_min_bytes=0).start()
    producer.save_caches("a", ImageFeatures(torch.ones(64, 64)))
    segments = _segment_fds() - before  # the producer's probe and item segments
    consumer, received = _child(_CONSUMER, producer.address)
    assert received == "1"  # it mapped the item
    assert mapped_inodes(consumer.pid) & segments and not _named_shm(consumer.pid)
    _kill9(consumer)
    assert consumer.returncode == -9  # killed and reaped: its mappings went with it
    producer.close()  # drops its items: their fds and its own mappings
    gc.collect()
    assert not segments & (mapped_inodes() | _segment_fds()) and _named_shm() == named
