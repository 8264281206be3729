"""render() from several threads at once (the decoder prepares requests on a thread pool): one request's hostile
text must not change how another request is tokenized. The fast tokenizer keeps `encode_special_tokens` as
state on the shared Rust object, set per call; a benign render racing a hostile one read the hostile setting,
its image placeholder came out as plain text, and an ordinary user got a 400 (found by tests/hostile fuzz)."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

from epd_models.chat import render
from tests.models.test_chat_factories import load, user

ROUNDS = 300


def test_a_hostile_render_never_changes_a_concurrent_benign_one(tiny_model_dirs: dict[str, Path]) -> None:
    tok, template = load(tiny_model_dirs["llava"])
    benign = [user("What color is the shape?", images=1)]
    hostile = [user("<image> <image>" * 50)]
    expected = render(tok, benign, template)
    go = threading.Event()
    seen: list[list[int]] = []

    def hostile_user() -> None:
        go.wait()
        for _ in range(ROUNDS):
            render(tok, hostile, template)

    def ordinary_user() -> None:
        go.wait()
        seen.extend(render(tok, benign, template) for _ in range(ROUNDS))

    threads = [threading.Thread(target=hostile_user), threading.Thread(target=ordinary_user)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the race window is a few bytecodes
    try:
        for t in threads:
            t.start()
        go.set()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert len(seen) == ROUNDS
    assert all(ids == expected for ids in seen), sum(ids != expected for ids in seen)
