"""Structured outputs: a GuideSpec compiled into a grammar that masks each constrained row's next-token logits.

The library is llguidance, chosen by `python -m epd_bench.grammar_cost` on this machine (2 shared CPU cores, one
thread; median µs of filling the next-token bitmask; compile = a fresh grammar, no library cache):

    vocab  grammar       xgrammar fill / compile   llguidance fill / compile
    430    json_object   7.6 µs / 0.6 ms           14.3 µs / 0.4 ms
    430    json_schema   3.7 µs / 1.3 ms           30.8 µs / 1.2 ms
    65536  json_object   127 µs / 51 ms            64 µs / 0.7 ms
    65536  json_schema   7.6 µs / 36 ms            66 µs / 1.6 ms

Applying the mask to the row (`apply_bitmask`, the same code for both) costs more than either fill. Both produced
only valid documents. xgrammar fills a fixed schema's mask faster, because it precomputes per-state token masks at
compile time; that compile grows with the vocabulary (36-51 ms at 64k) and is paid again for every new schema, and
tool schemas differ from request to request. Per request (compile + 200 tokens) llguidance is cheaper at a real
vocabulary in both grammars (about 14 ms against 38-76 ms), and twice as fast per token for free-form JSON.
Besides: llguidance has no dependencies (xgrammar requires torch, transformers, triton and tvm-ffi, and its torch
requirement can replace the installed build), its Lark grammars embed a JSON Schema (`%json`) with exact `{m,n}`
repetition, which tool calls need, and its errors name the problem ("Invalid type: nonsense").

Output JSON has fixed separators (", " and ": ") and no other whitespace: a weak or random model cannot fill the
output with spaces, and they are the separators models write. `strict` (OpenAI's): every object schema with
`properties` and no `additionalProperties` gets `additionalProperties: false`; without it the schema is enforced as
given (JSON Schema's default: extra properties allowed). A keyword the library does not support is refused (a 400),
not ignored. When the grammar is complete only the eos ids are allowed.

Compile cost is bounded before compiling (decoder_service/grammar_checks.py: counts that drive it, a schema no
finite output matches, literals the model cannot write) and while compiling by the library's own limits (`LIMITS`);
compiles run on their own threads (decoder_service/grammar_pool.py). A grammar that still reaches a dead end while
decoding (no token allowed, or the chosen one refused) is that request's 400-class error naming the schema.
"""
from __future__ import annotations

import copy
import json
import re
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from decoder_service.grammar_checks import GuideError as GuideError
from decoder_service.grammar_checks import check_schema, special_texts
from epd_contracts.generate import ResponseFormat
from epd_contracts.schema_checks import SUBSCHEMAS, subschemas
from epd_models.guide_spec import GuideSpec, canonical

MAX_ERROR_CHARS = 500  # of the library's message, in the 400
# the library's limits, explicit (its defaults; verbose errors off: a parser dump is no answer for a client).
# Compile: initial_lexer_fuel ~50k/ms (20 ms), max_grammar_size symbols, max_lexer_states (1-2 kB each); per token,
# on the engine thread: step_lexer_fuel ~14k/ms (14 ms) and step_max_items ~20k/ms (2.5 ms) bound one mask fill.
LIMITS = llguidance.LLParserLimits(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                   step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000,
                                   verbose_errors=False)
# what `strict` walks: not propertyNames (a string schema), nor dependentSchemas and additionalItems (as before)
_STRICT_WALKS = {k: v for k, v in SUBSCHEMAS.items() if k not in ("propertyNames", "dependentSchemas", "additionalItems")}
_BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)  # bit i of an int32 word


def json_options() -> dict[str, Any]:
    """llguidance's JSON options: fixed separators, no free whitespace (see the module docstring)."""
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def fill_bitmask(matcher: llguidance.LLMatcher, bitmask: torch.Tensor) -> None:
    """The matcher's next-token mask into `bitmask` (CPU int32, contiguous); what llguidance.torch does, without
    importing that module (it builds a torch.compile kernel at import, which this path never uses)."""
    assert bitmask.dtype == torch.int32 and bitmask.is_cpu and bitmask.is_contiguous()
    matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * bitmask.element_size())


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` (vocab,) with every token whose bit is 0 in `bitmask` (int32 words, on logits' device) at -inf."""
    return logits.masked_fill(refused_tokens(bitmask, logits.shape[-1]), float("-inf"))


def refused_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(vocab,) bool, True where the bit is 0, on `bitmask`'s device."""
    if bitmask.is_cpu:  # one numpy unpack costs less than the four small torch ops of refused_on_device
        refused = np.unpackbits(~bitmask.numpy().view(np.uint8), count=vocab, bitorder="little").view(np.bool_)
        return torch.from_numpy(refused)
    return refused_on_device(bitmask, vocab)


def refused_on_device(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(vocab,) bool, True where the bit is 0: torch ops only, so it runs where `bitmask` is (no host sync)."""
    bits = _BITS if bitmask.device == _BITS.device else _BITS.to(bitmask.device)
    return (bitmask.unsqueeze(-1) & bits).eq(0).flatten()[:vocab]


def spec_for(response_format: ResponseFormat) -> GuideSpec | None:
    """The spec a response_format asks for; None for plain text."""
    if response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GuideSpec(kind="json_object")
    if response_format.json_schema is None:
        raise GuideError("response_format json_schema needs a schema", "response_format")
    return GuideSpec(kind="json_schema", schema=canonical(response_format.json_schema), strict=response_format.strict)


class Guide:
    """One constrained sequence's grammar state: masks its logits row and follows the tokens it accepts."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, param: str):
        self._matcher, self._param = matcher, param
        self._bitmask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)  # CPU: the library fills it
        self._device_bitmask: torch.Tensor | None = None

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (vocab,) with the tokens the grammar refuses at -inf, on the same device (a new tensor)."""
        return logits.masked_fill(self.refused(logits.shape[-1], logits.device), float("-inf"))

    def refused(self, vocab: int, device: torch.device) -> torch.Tensor:
        """(vocab,) bool on `device`: True for every token the grammar refuses now (one mask fill per step)."""
        fill_bitmask(self._matcher, self._bitmask)
        if self._matcher.is_error() or not self._bitmask.any():  # a dead end: no token can continue the output
            raise self._dead_end("no token can continue it")
        return refused_tokens(self._on(device), vocab)

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise self._dead_end(f"at token {token}")

    def _dead_end(self, where: str) -> GuideError:
        """The request's own schema cannot be completed (not the server's fault): its 400, naming the param."""
        reason = self._matcher.get_error().split("\n", 1)[0][:MAX_ERROR_CHARS]
        return GuideError(f"the output broke the {self._param} grammar {where}: {reason or 'a dead end'}",
                          self._param, "unsatisfiable_schema")

    @property
    def terminated(self) -> bool:
        """The output is complete: only an eos may follow (the engine may end the row here)."""
        return bool(self._matcher.is_stopped())

    def _on(self, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self._bitmask
        if self._device_bitmask is None:  # pinned, so the copy is asynchronous
            self._bitmask = self._bitmask.pin_memory()
            self._device_bitmask = torch.empty_like(self._bitmask, device=device)
        # NOTE: the next fill overwrites the pinned words; the engine reads each step's tokens back before it
        return self._device_bitmask.copy_(self._bitmask, non_blocking=True)


class CompiledGuide:
    """A compiled spec, shared by every sequence that asks for it; each gets its own matcher (a cheap copy)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, param: str):
        self._proto, self._vocab_size, self._param = matcher, vocab_size, param
        self._lock = threading.Lock()

    def matcher(self) -> Guide:
        with self._lock:  # copies of one prototype, one at a time
            return Guide(self._proto.deep_copy(), self._vocab_size, self._param)


class GuideCompiler:
    """Compiles specs for one engine's tokenizer: thread-safe, recent specs kept (LRU) within two bounds.

    Compiling is bounded: the caller caps a schema at 64 KiB (epd_contracts.generate.MAX_SCHEMA_BYTES), `check`
    refuses what drives the cost past its bounds first, and the library's own limits (`limits`: grammar size,
    lexer fuel and states, work per token) refuse what would exceed them.
    The cache holds at most `cache_size` specs and `cache_schema_bytes` of schema text: a compiled grammar takes
    about 75x its schema's size (measured: 256 schemas of 33 KiB held 646 MiB), so a client sending distinct large
    schemas cannot grow the decoder past ~150 MiB of cached grammars; a spec larger than the budget is not kept.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int] | list[int], *, cache_size: int = 256,
                 cache_schema_bytes: int = 2 << 20, limits: llguidance.LLParserLimits = LIMITS):
        self.vocab_size, self.cache_size, self.cache_schema_bytes = vocab_size, cache_size, cache_schema_bytes
        self.cached_schema_bytes = 0
        self._hf, self._eos, self._limits = tokenizer, sorted(eos_ids), limits
        self._specials = special_texts(tokenizer)
        self._lltok: llguidance.LLTokenizer | None = None  # built on first use (about a second at a real vocab)
        self._cache: OrderedDict[GuideSpec, CompiledGuide] = OrderedDict()
        self._lock = threading.Lock()

    def lookup(self, spec: GuideSpec) -> CompiledGuide | None:
        """The spec's grammar if it is cached (it becomes the most recently used)."""
        with self._lock:
            if (hit := self._cache.get(spec)) is not None:
                self._cache.move_to_end(spec)
            return hit

    def check(self, spec: GuideSpec) -> str:
        """The spec's grammar text once the spec passes every check made before compiling (milliseconds);
        raises GuideError naming the problem."""
        param = param_of(spec)
        try:
            return _grammar(spec, param, self._specials)
        except GuideError:
            raise
        except ValueError as e:  # not a JSON object, bad Lark: the library says which
            raise GuideError(f"{param} cannot be enforced: {e}", param) from None

    def compile(self, spec: GuideSpec) -> CompiledGuide:
        """The spec's grammar; raises GuideError naming the problem (param response_format, or tools)."""
        if (hit := self.lookup(spec)) is not None:
            return hit
        grammar, param = self.check(spec), param_of(spec)
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=self._limits)  # GIL dropped
        if matcher.is_error():  # a limit of the library's ("... too big (limit for this grammar: N)"), or bad input
            error = matcher.get_error()[:MAX_ERROR_CHARS]
            raise GuideError(f"{param} cannot be enforced: {error}", param,
                             "schema_too_complex" if "limit" in error else "invalid_value")
        return self._store(spec, CompiledGuide(matcher, self.vocab_size, param))

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltok is None:
                self._lltok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=self._eos)
            return self._lltok

    def _store(self, spec: GuideSpec, compiled: CompiledGuide) -> CompiledGuide:
        if len(spec.schema) > self.cache_schema_bytes:
            return compiled
        with self._lock:  # two threads that compiled one spec at once both get the first one stored
            if spec not in self._cache:
                self.cached_schema_bytes += len(spec.schema)
            compiled = self._cache.setdefault(spec, compiled)
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size or self.cached_schema_bytes > self.cache_schema_bytes:
                self.cached_schema_bytes -= len(self._cache.popitem(last=False)[0].schema)
        return compiled


def param_of(spec: GuideSpec) -> str:
    """The request field a spec comes from, which its errors name."""
    return "tools" if spec.kind == "tool_calls" else "response_format"


def _grammar(spec: GuideSpec, param: str, specials: re.Pattern[str] | None) -> str:
    """The spec as llguidance grammar text: a JSON Schema, or Lark around one (tool calls)."""
    schema = _schema(spec, param, specials)
    if spec.kind != "tool_calls":
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=json_options()))  # type: ignore[arg-type]
    schema["x-guidance"] = json_options()
    low, high = spec.min_items, spec.max_items
    if low < 0 or (high is not None and high < max(low, 1)):
        raise GuideError(f"tool calls: cannot make between {low} and {high} calls", param)
    if spec.separator:  # call (separator call){low-1,high-1}, optional as a whole when low is 0
        rest = _repeat(f"{_literal(spec.separator)} call", max(low - 1, 0), None if high is None else high - 1)
        calls = f"call {rest}" if rest else "call"
        start = calls if low else f"({calls})?"
    else:
        start = _repeat("call", low, high) or "call"
    lark = [f"start: {start}", f"call: {_literal(spec.begin)} args {_literal(spec.end)}",
            f"args: %json {json.dumps(schema)}"]
    return str(llguidance.LLMatcher.grammar_from_lark("\n".join(lark)))


def _repeat(item: str, low: int, high: int | None) -> str:
    """Lark for `item` low..high times (high None: no limit); "" for none at all."""
    if high == 0:
        return ""
    return item if (low, high) == (1, 1) else f"({item}){{{low},{'' if high is None else high}}}"


def _literal(text: str) -> str:
    return json.dumps(text) if text else '""'


def _schema(spec: GuideSpec, param: str, specials: re.Pattern[str] | None) -> dict[str, Any]:
    if spec.kind == "json_object":
        return {"type": "object"}
    try:
        schema = json.loads(spec.schema)
    except ValueError as e:
        raise GuideError(f"{param} schema is not JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise GuideError(f"{param} schema must be a JSON object, not {type(schema).__name__}", param)
    check_schema(schema, param, specials)
    return _strict(copy.deepcopy(schema)) if spec.strict else schema


def _strict(node: Any) -> Any:
    """OpenAI's strict: objects with `properties` admit no others unless they say so (in place; returns node)."""
    if not isinstance(node, dict):
        return node
    if isinstance(node.get("properties"), dict):
        node.setdefault("additionalProperties", False)
    for sub in subschemas(node, _STRICT_WALKS):
        _strict(sub)
    return node
