"""Incremental detokenization: stop strings are never emitted, and no broken UTF-8 ever leaves."""
from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from decoder_service.engine.detokenizer import IncrementalDetokenizer


def stream(tok: object, text: str, stop: tuple[str, ...]) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, stop)
    out = []
    for t in tok.encode(text, add_special_tokens=False):  # type: ignore[attr-defined]
        out.append(d.add(t))
        if d.stopped:
            break
    out.append(d.flush())
    return out, d


def test_pieces_join_to_the_text(tiny_model_dirs: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dirs["llava"])
    pieces, d = stream(tok, "The shape is a red circle. é ü 猫", ())
    assert "".join(pieces) == "The shape is a red circle. é ü 猫" and not d.stopped
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_ends_text_and_is_not_returned(tiny_model_dirs: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dirs["llava"])
    pieces, d = stream(tok, "It is red. It is a circle.", ("a circle",))
    assert "".join(pieces) == "It is red. It is " and d.stopped


def test_long_random_token_streams_join_to_the_full_decode(tiny_model_dirs: dict[str, Path]) -> None:
    import random

    tok = AutoTokenizer.from_pretrained(tiny_model_dirs["qwen2_vl"])
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 60))]
        d = IncrementalDetokenizer(tok, ())
        out = "".join(d.add(t) for t in ids) + d.flush()
        full = tok.decode(ids, skip_special_tokens=True)
        assert out == full.rstrip("\ufffd") or out == full
