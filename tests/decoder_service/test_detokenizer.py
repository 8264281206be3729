"""Incremental detokenization: stop strings are never emitted, and no broken UTF-8 ever leaves."""
from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from decoder_service.engine.detokenizer import IncrementalDetokenizer
from epd_builders.tiny import FAMILIES


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


def test_the_rust_stream_and_the_window_decode_give_the_same_pieces(tiny_model_dirs: dict[str, Path]) -> None:
    """The fast path (tokenizers' DecodeStream) hands out exactly what the window decode does, piece by piece, on
    every family's tokenizer: random ids (partial UTF-8, special tokens) and real text."""
    import random

    for family in FAMILIES:
        tok = AutoTokenizer.from_pretrained(tiny_model_dirs[family])
        rng = random.Random(family)
        texts = [tok.encode("It is red. é ü 猫 — ok", add_special_tokens=False)]
        texts += [[rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))] for _ in range(30)]
        for ids in texts:
            fast, slow = IncrementalDetokenizer(tok, ()), IncrementalDetokenizer(tok, ())
            assert fast._stream is not None, family  # the fast path is taken
            slow._stream = None
            assert [fast.add(t) for t in ids] + [fast.flush()] == [slow.add(t) for t in ids] + [slow.flush()], family
