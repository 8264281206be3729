"""A GenerateRequest turned into work the engine can run: the prompt's tokens, checked sampling, a compiled guide.

Everything here runs on a worker thread (`Engine.prepare`), never on the engine thread: tokenizing, rendering
the chat template with tools, and compiling a grammar (milliseconds to seconds for a large schema) delay no
running stream. Whatever cannot run is a 400 naming the field, before the request takes a slot.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from jinja2 import TemplateError

from decoder_service.engine.prefix_hash import PrefixChain, prompt_chain
from decoder_service.engine.work import Prompt, Work
from decoder_service.grammar import CompiledGuide, GuideCompiler, GuideError, spec_for
from decoder_service.image_hits import SaltedHits
from decoder_service.lora import lora_salt
from decoder_service.lora_defaults import default_for
from decoder_service.prompt import build_prompt
from decoder_service.video_gather import Gathered
from epd_common.errors import APIError, bad_request
from epd_contracts.generate import GenerateRequest
from epd_contracts.sampling import SamplingParams
from epd_models.chat import PromptTooLong, chat_template, image_edges, render
from epd_models.tool_parsers import ToolFormat, tool_format

if TYPE_CHECKING:
    from epd_contracts.embeddings import ImageFeatures
    from epd_models.guide_spec import GuideSpec
    from epd_models.halves import LanguageHalf

Gather = Callable[[GenerateRequest], list[Gathered]]  # per image (video): its features and which rows were held


@dataclass(frozen=True)
class PendingGuide:
    """A grammar not in the cache: its spec passed the checks and is compiled (on the grammar pool) by `compile`."""

    spec: GuideSpec
    param: str  # the request field it comes from, named by its 400
    compiler: GuideCompiler

    def compile(self) -> CompiledGuide:
        """Compile (a fraction of a second to seconds: the caller's thread, never the engine's); 400 naming the field."""
        try:
            return self.compiler.compile(self.spec)
        except GuideError as exc:
            raise _refused(exc, self.param) from exc


def _refused(exc: GuideError, param: str) -> APIError:
    return bad_request(exc.message, param=exc.param or param, code=exc.code)


class Preparer:
    """What an engine checks and builds for each request, on the caller's thread (thread-safe)."""

    def __init__(self, lm: LanguageHalf, max_model_len: int, vocab_size: int, max_num_seqs: int, eos_ids: set[int],
                 prefix_block: int = 0):
        self.lm, self.max_model_len, self.vocab_size = lm, max_model_len, vocab_size
        self.prefix_block = prefix_block  # tokens per prefix-cache block; 0: the cache is off
        self.max_num_seqs, self.eos_ids = max_num_seqs, eos_ids
        self.template = chat_template(lm.tokenizer, lm.model_dir)
        self.image_edges = image_edges(lm)  # Gemma 3's "\n\n" around each image, written before tokenizing
        self._compiler: GuideCompiler | None = None
        self._lock = threading.Lock()
        self.salted_hits = SaltedHits()  # images count as cached only for the salt that sent them before

    def prepare(self, req: GenerateRequest, gather: Gather, *, guide: CompiledGuide | None = None,
                compiled: bool = False) -> Work:
        """Tokens (before the gather: with pipelined encode this overlaps the encoder's work), images, checks, guide
        (`compiled`: `guide` is the request's, found and compiled beforehand on the grammar pool; else compiled here)."""
        lora = req.lora or default_for(self.lm.lora.defaults if self.lm.lora is not None else {}, req.images)
        slot = self._lora_slot(lora) if lora else 0  # before any work: an adapter not served is a 400
        try:
            return self._prepare(req, gather, guide, compiled, slot, lora)
        except BaseException:
            self.release(slot)
            raise

    def release(self, slot: int) -> None:
        """The request holding adapter `slot` (its Work's prompt.lora) is over (or never ran)."""
        if slot and self.lm.lora is not None:
            self.lm.lora.release(slot)

    def _prepare(self, req: GenerateRequest, gather: Gather, guide: CompiledGuide | None, compiled: bool,
                 slot: int, lora: str) -> Work:
        params = req.sampling
        self._check_sampling(req, params)
        self._check_images(req)
        tools = self._tool_format() if req.tools and req.tool_choice.mode != "none" else None
        ids = self._completion_ids(req.prompt) if req.prompt is not None else self._render(req, tools)
        guide = guide if compiled else self._guide(req)
        images = gather(req)
        try:
            prompt = build_prompt(self.lm, ids, [g.features for g in images])
        except ValueError as exc:  # placeholder count does not match the images
            raise bad_request(f"cannot build the prompt: {exc}", param="messages") from exc
        if slot:
            prompt = replace(prompt, lora=slot)
        echo = self._echo_text(req, ids) if req.echo else ""
        held = self.salted_hits.visible(req.cache_salt, [ref.mm_hash for ref in req.images],
                                        [((0, g.features.num_tokens),) if ref.cached else g.held
                                         for g, ref in zip(images, req.images, strict=True)])
        positions, chain = self._image_tokens(req, prompt, held, lora)
        return Work(prompt, self._fit(prompt, params), guide, tools, echo, positions, chain, tuple(req.prefix_keys),
                    client=req.cache_salt)

    def _image_tokens(self, req: GenerateRequest, prompt: Prompt, held: list[tuple[tuple[int, int], ...]],
                      lora: str) -> tuple[tuple[int, ...], PrefixChain | None]:
        """The positions of held rows' tokens (`held`: per item, [start, end) ranges of its rows), and the prompt's
        prefix-cache chain (images, videos and clips named by mm_hash). An item's rows are its tokens of the image,
        video or audio token, in prompt order (where merge_image_embeds puts them)."""
        ids: list[int] = prompt.input_ids[0].tolist()
        sizes = [im.num_tokens for im in prompt.images]
        tokens = [self._media_token(im) for im in prompt.images]
        positions = {t: [i for i, x in enumerate(ids) if x == t] for t in set(tokens)}  # per kind, in prompt order
        taken = dict.fromkeys(positions, 0)  # rows of each kind before the item (a track interleaves with its video)
        mine: list[int] = []
        for token, size, ranges in zip(tokens, sizes, held, strict=True):
            start = taken[token]
            for a, b in ranges:
                mine += positions[token][start + a : start + min(b, size)]
            taken[token] += size
        chain = None
        if self.prefix_block:
            chain = prompt_chain(ids, self.prefix_block, lora_salt(req.cache_salt, lora), self.lm.image_token_id,
                                 [(ref.mm_hash, size) for ref, size in zip(req.images, sizes, strict=True)],
                                 video_token_id=self.lm.video_token_id, audio_token_id=self.lm.audio_token_id,
                                 kinds=tokens)
        return tuple(sorted(mine)), chain

    def _lora_slot(self, name: str) -> int:
        """Adapter `name`'s slot, held for the request (`release`); a 400 naming `model` if it is not served."""
        try:
            if self.lm.lora is not None:
                return self.lm.lora.acquire(name)
        except KeyError:
            pass
        held = sorted(self.lm.lora.known) if self.lm.lora is not None else []
        raise bad_request(f"LoRA adapter {name!r} is not served by this decoder (it serves {held or 'none'})",
                          param="model")

    def _media_token(self, item: ImageFeatures) -> int | None:
        """The token an item's rows take (merge_image_embeds' rule)."""
        return (self.lm.audio_token_id if item.audio else self.lm.video_token_id if item.is_video
                else self.lm.image_token_id)

    def _check_sampling(self, req: GenerateRequest, params: SamplingParams) -> None:
        if params.n > self.max_num_seqs:
            raise bad_request(f"n ({params.n}) exceeds this decoder's --max-num-seqs ({self.max_num_seqs})", param="n")
        for name, ids in (("logit_bias", list(params.logit_bias)), ("stop_token_ids", list(params.stop_token_ids))):
            self._check_ids(ids, name)
        if req.echo and params.logprobs is not None:
            raise bad_request("echo with logprobs is not supported: prompt logprobs are not computed", param="echo")

    def _check_images(self, req: GenerateRequest) -> None:
        """Where an image's tokens depend on how many images the prompt has (LLaVA-OneVision), every image must
        have been encoded for this prompt: as one of several exactly when there are several. Videos are not
        counted (its processor counts the images only) and are never multi_image."""
        if not self.lm.adapter.spec.multi_image_variant:
            return
        count = sum(1 for im in req.images if im.video is None)
        for i, im in enumerate(req.images):
            several = count > 1 and im.video is None
            if im.multi_image != several:
                raise bad_request(f"images[{i}].multi_image must be {str(several).lower()} for this model: the prompt "
                                  f"has {count} image(s)", param=f"images.{i}.multi_image")

    def _check_ids(self, ids: list[int], param: str) -> None:
        bad = [i for i in ids if i >= self.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})", param=param)

    def _completion_ids(self, prompt: str | list[int]) -> list[int]:
        """A completions prompt: text tokenized with the tokenizer's own special tokens, or ids as given."""
        if isinstance(prompt, str):
            ids: list[int] = self.lm.tokenizer(prompt)["input_ids"]
        else:
            self._check_ids(prompt, "prompt")
            ids = list(prompt)
        if len(ids) >= self.max_model_len:
            raise bad_request(f"the prompt has {len(ids)} tokens; the model's maximum length is {self.max_model_len}",
                              param="prompt", code="context_length_exceeded")
        return ids

    def _render(self, req: GenerateRequest, tools: ToolFormat | None) -> list[int]:
        try:
            return render(self.lm.tokenizer, req.messages, self.template, max_tokens=self.max_model_len,
                          tools=req.tools if tools is not None else None, tool_format=tools,
                          image_edges=self.image_edges)
        except PromptTooLong as exc:  # refused before the whole prompt is tokenized
            raise bad_request(f"{exc} (the model's maximum length)", param="messages",
                              code="context_length_exceeded") from exc
        except (TemplateError, ValueError, TypeError, KeyError) as exc:
            raise bad_request(f"cannot build the prompt: {exc}", param="messages") from exc

    def _echo_text(self, req: GenerateRequest, ids: list[int]) -> str:
        return req.prompt if isinstance(req.prompt, str) else str(self.lm.tokenizer.decode(ids))

    def _fit(self, prompt: Prompt, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with max_tokens set (unset: the rest of the context); 400 if the prompt leaves no room."""
        room = self.max_model_len - prompt.num_tokens
        max_tokens = sampling.max_tokens or room
        if max_tokens > room or room < 1:
            raise bad_request(f"prompt ({prompt.num_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
                              f"model's maximum length ({self.max_model_len})", param="max_tokens",
                              code="context_length_exceeded")
        return sampling.with_max_tokens(max_tokens)

    def _tool_format(self) -> ToolFormat:
        return tool_format(str(self.lm.config.model_type))

    def find_guide(self, req: GenerateRequest) -> CompiledGuide | PendingGuide | None:
        """The request's grammar if cached, else what to compile once the checks made before compiling pass (a 400
        naming the field if not): of response_format, or of the forced tool calls (required / a named function)."""
        found = self._guide_spec(req)
        if found is None:
            return None
        compiler, (spec, param) = self._guide_compiler(), found
        try:
            if (hit := compiler.lookup(spec)) is not None:
                return hit
            compiler.check(spec)
        except GuideError as exc:
            raise _refused(exc, param) from exc
        return PendingGuide(spec, param, compiler)

    def _guide(self, req: GenerateRequest) -> CompiledGuide | None:
        found = self.find_guide(req)
        return found.compile() if isinstance(found, PendingGuide) else found

    def _guide_spec(self, req: GenerateRequest) -> tuple[GuideSpec, str] | None:
        """(spec, the field it comes from) of response_format or of the forced tool calls; not both."""
        tools = self._tool_format() if req.tools and req.tool_choice.mode != "none" else None
        if req.response_format is None and tools is None:
            return None
        specs: list[tuple[GuideSpec, str]] = []
        try:
            if req.response_format is not None and (spec := spec_for(req.response_format)) is not None:
                specs.append((spec, "response_format"))
        except GuideError as exc:
            raise _refused(exc, "response_format") from exc
        if tools is not None and (spec := self._tool_guide(req, tools)) is not None:
            specs.append((spec, "tool_choice"))
        if len(specs) > 1:
            raise bad_request("response_format cannot be combined with a forced tool_choice (required or a named "
                              "function): both constrain the whole output", param="response_format")
        return specs[0] if specs else None

    def _tool_guide(self, req: GenerateRequest, tools: ToolFormat) -> GuideSpec | None:
        try:
            return tools.guide(req.tools, req.tool_choice)
        except ValueError as exc:  # a named function that is not among the tools
            raise bad_request(str(exc), param="tool_choice") from exc

    def _guide_compiler(self) -> GuideCompiler:
        """Built on the first constrained request (the tokenizer's grammar tables take a while), then kept."""
        with self._lock:
            if self._compiler is None:
                self._compiler = GuideCompiler(self.lm.tokenizer, self.vocab_size, self.eos_ids)
            return self._compiler
