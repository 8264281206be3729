"""Grammar libraries side by side: compile time and per-token mask cost, for choosing one (decoder_service/grammar.py).

    python -m epd_bench.grammar_cost [--json] [--large-vocab N] [--repeats N]

For xgrammar and llguidance, on two tokenizers: ours (epd_builders.tokenizer, vocab 512) and a byte-level BPE of
realistic size (default 32k) trained here on the Python standard library's .py files (no downloads; cached in the
temp dir). For `json_object` and a nested `json_schema`, each library walks a valid document token by token; per
token it fills the next-token bitmask and applies it to a float32 logits row (the same unpack + masked_fill for
both, grammar.apply_bitmask), then accepts the document's token, which must be allowed (a wrong mask fails the run).
Compile time: the median of fresh compiles (no library cache). Mask cost: the median over the walk's tokens, in µs.
`valid`: documents sampled from random logits under each mask that parse and validate (of those that ended).
xgrammar is not a dependency (`pip install xgrammar --no-deps apache-tvm-ffi` to compare); absent, it is skipped.
"""
from __future__ import annotations

import json
import statistics
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from epd_bench.micro import emit, parser

if TYPE_CHECKING:  # the run imports them (torch, tokenizers, the grammar), after --help has answered
    import torch
    from transformers import PreTrainedTokenizerFast

NESTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"], "additionalProperties": False}},
            "required": ["city", "zip", "geo"], "additionalProperties": False},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "manager": {"type": ["string", "null"]},
    },
    "required": ["name", "age", "tags", "address", "role", "active", "manager"],
    "additionalProperties": False,
}
NESTED_DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"],
              "address": {"city": "London", "zip": "12345", "geo": {"lat": 51.5, "lon": -0.12}},
              "role": "admin", "active": True, "manager": None}
OBJECT_DOC = {"id": 7, "items": [{"sku": "a-1", "qty": 2, "price": 3.5}, {"sku": "b-2", "qty": 1, "price": 10}],
              "note": "deliver before noon, please", "paid": False, "coupon": None}
MAX_SAMPLE_TOKENS = 2000
CASES = {"json_object": ({"type": "object"}, OBJECT_DOC), "json_schema": (NESTED_SCHEMA, NESTED_DOC)}


class Matcher(Protocol):
    def fill(self, bitmask: torch.Tensor) -> None: ...
    def accept(self, token: int) -> bool: ...


def large_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of `vocab_size` trained on about 12 MB of the standard library (once; kept in the temp dir)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from epd_builders.tokenizer import SPECIAL_TOKENS

    path = Path(tempfile.gettempdir()) / f"epd-grammar-cost-bpe-{vocab_size}.json"
    if not path.exists():
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(_stdlib_texts(12 << 20), trainer=trainer)
        tok.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|im_end|>", pad_token="<|endoftext|>")


def _stdlib_texts(budget: int) -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for file in sorted(root.glob("*/*.py")) + sorted(root.glob("*.py")):
        if "site-packages" in file.parts or budget <= 0:
            continue
        text = file.read_text(encoding="utf-8", errors="replace")
        budget -= len(text)
        yield text


def xgrammar_factory(tok: PreTrainedTokenizerFast, vocab: int, eos: int) -> Callable[[dict[str, Any]], Callable[[], Matcher]]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])

    class XMatcher:
        def __init__(self, compiled: Any):
            self.m = xgr.GrammarMatcher(compiled)

        def fill(self, bitmask: torch.Tensor) -> None:
            self.m.fill_next_token_bitmask(bitmask, 0)

        def accept(self, token: int) -> bool:
            return bool(self.m.accept_token(token))

    def compile_(schema: dict[str, Any]) -> Callable[[], Matcher]:
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "),
                                                strict_mode=False)
        return lambda: XMatcher(compiled)
    return compile_


def llguidance_factory(tok: PreTrainedTokenizerFast, vocab: int, eos: int) -> Callable[[dict[str, Any]], Callable[[], Matcher]]:
    import llguidance
    import llguidance.hf

    from decoder_service.grammar import fill_bitmask, json_options

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)

    class LMatcher:
        def __init__(self, proto: Any):
            self.m = proto.deep_copy()

        def fill(self, bitmask: torch.Tensor) -> None:
            fill_bitmask(self.m, bitmask)

        def accept(self, token: int) -> bool:
            return bool(self.m.consume_token(token))

    def compile_(schema: dict[str, Any]) -> Callable[[], Matcher]:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=json_options())  # type: ignore[arg-type]
        proto = llguidance.LLMatcher(lltok, grammar, log_level=0)
        assert not proto.is_error(), proto.get_error()
        return lambda: LMatcher(proto)
    return compile_


LIBRARIES = {"xgrammar": xgrammar_factory, "llguidance": llguidance_factory}


def measure(lib: str, tok: Any, case: str, repeats: int) -> dict[str, Any]:
    import torch

    from decoder_service.grammar import apply_bitmask

    vocab, eos = len(tok), int(tok.eos_token_id)
    compile_ = LIBRARIES[lib](tok, vocab, eos)
    schema, doc = CASES[case]
    compile_ms = []
    for _ in range(repeats):
        start = time.perf_counter()
        new_matcher = compile_(schema)
        new_matcher()
        compile_ms.append((time.perf_counter() - start) * 1e3)
    tokens = tok.encode(json.dumps(doc), add_special_tokens=False) + [eos]
    logits = torch.randn(vocab)
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    fill_us, mask_us, accept_us = [], [], []
    for _ in range(repeats):
        matcher = new_matcher()
        for token in tokens:
            start = time.perf_counter()
            matcher.fill(bitmask)
            filled = time.perf_counter()
            row = apply_bitmask(logits, bitmask[0])
            mid = time.perf_counter()
            fill_us.append((filled - start) * 1e6)
            assert row[token] != float("-inf"), f"{lib} masked out token {token} of a valid document"
            assert matcher.accept(token), f"{lib} refused token {token} of a valid document"
            accept_us.append((time.perf_counter() - mid) * 1e6)
            mask_us.append((mid - start) * 1e6)
    valid = _valid_samples(new_matcher, tok, schema, vocab, eos, repeats)
    return {"library": lib, "vocab": vocab, "grammar": case, "compile_ms": statistics.median(compile_ms),
            "fill_us": statistics.median(fill_us),
            "mask_us": statistics.median(mask_us), "accept_us": statistics.median(accept_us),
            "tokens": len(tokens), "valid": valid}


def _valid_samples(new_matcher: Callable[[], Matcher], tok: PreTrainedTokenizerFast, schema: dict[str, Any],
                   vocab: int, eos: int, count: int) -> str:
    """Documents sampled from random logits under the mask: how many of those that ended parse and validate."""
    import jsonschema
    import torch

    from decoder_service.grammar import apply_bitmask

    generator, num_valid, num_ended = torch.Generator().manual_seed(0), 0, 0
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    for _ in range(count):
        matcher, tokens = new_matcher(), []
        for _ in range(MAX_SAMPLE_TOKENS):
            matcher.fill(bitmask)
            row = apply_bitmask(torch.randn(vocab, generator=generator) * 3, bitmask[0])
            token = int(torch.multinomial(torch.softmax(row, -1), 1, generator=generator))
            assert matcher.accept(token)
            if token == eos:
                break
            tokens.append(token)
        else:
            continue
        num_ended += 1
        try:
            jsonschema.validate(json.loads(str(tok.decode(tokens))), schema)
            num_valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return f"{num_valid}/{num_ended}"


def installed() -> tuple[str, ...]:
    """The libraries importable here: llguidance is a dependency; xgrammar only for this comparison."""
    import importlib.util

    return tuple(lib for lib in LIBRARIES if importlib.util.find_spec(lib) is not None)


def run(large_vocab: int, repeats: int, libraries: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    import torch

    from epd_builders.tokenizer import train_tokenizer

    libraries = installed() if libraries is None else libraries
    torch.set_num_threads(1)
    toks = [train_tokenizer("<image>", "<image>")] + ([large_tokenizer(large_vocab)] if large_vocab else [])
    return [measure(lib, tok, case, repeats) for tok in toks for case in CASES for lib in libraries]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'library':<11} {'vocab':>6} {'grammar':<12} {'compile ms':>10} {'fill µs':>7} "
             f"{'mask µs/token':>13} {'accept µs':>9} {'valid':>6}"]
    lines += [f"{r['library']:<11} {r['vocab']:>6} {r['grammar']:<12} {r['compile_ms']:>10.2f} {r['fill_us']:>7.1f} "
              f"{r['mask_us']:>13.1f} {r['accept_us']:>9.1f} {r['valid']:>6}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = parser("grammar_cost", __doc__)
    p.add_argument("--large-vocab", type=int, default=32768, help="0: only our 512-token vocabulary")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    emit(run(args.large_vocab, args.repeats), args.json, table, indent=2)


if __name__ == "__main__":
    main()
