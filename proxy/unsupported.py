"""Request fields this server does not implement: a 400 naming the field, never a silent 200 that ignores it.

A field is accepted when it is harmless here (bookkeeping such as `user`, `metadata`, `store`) or when it
has a value that means "off" (`modalities: ["text"]`, `repetition_penalty: 1`, `best_of: 1`, ...).
Any other field, known (OpenAI's schema, vLLM's extensions) or not, is refused, as OpenAI refuses
"unrecognized request argument"s; an unknown field set to null, false, 0, "", [] or {} is accepted as off.
"""
from __future__ import annotations

from typing import Any

# accepted with any value: they change nothing about the output
HARMLESS = frozenset({
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options",
})
# field -> the values (besides null) that mean the feature is off; any other value is refused. Implemented fields
# (n, logprobs, top_logprobs, response_format, tools, tool_choice, parallel_tool_calls, logit_bias, min_p,
# stop_token_ids, the sampling contract's) are request fields of their own and never reach this table.
OFF: dict[str, tuple[Any, ...]] = {
    # OpenAI chat completions (../shared/openai/chat-completions.schema.json): not implemented
    "functions": ([],), "function_call": ("none",),  # deprecated spelling of tools: use tools / tool_choice
    "audio": (), "modalities": (["text"],), "prediction": (), "web_search_options": (), "reasoning_effort": (),
    "verbosity": (), "moderation": (),
    # vLLM extensions that change the output (top_k, ignore_eos, min_p, stop_token_ids are implemented)
    "repetition_penalty": (1,), "min_tokens": (0,), "best_of": (1,), "use_beam_search": (False,),
    "length_penalty": (1,), "bad_words": ([],), "allowed_token_ids": ([],),
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "echo": (False,), "add_generation_prompt": (True,), "continue_final_message": (False,), "chat_template": (),
    "chat_template_kwargs": ({},), "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "guided_decoding_backend": (), "structured_outputs": (), "prompt_logprobs": (), "truncate_prompt_tokens": (),
    "logits_processors": (), "return_tokens_as_token_ids": (False,),
    # /v1/completions: an inserted suffix (fill-in-the-middle) is not implemented
    "suffix": ("",),
    # message fields (assistant turns echoed back by clients carry them, mostly null)
    "refusal": ("",),
}
_EMPTY: tuple[Any, ...] = (False, "", [], {})  # with None; 0 == False
_MESSAGE_HARMLESS = frozenset({"annotations"})


def _is_off(name: str, value: Any) -> bool:
    return value is None or any(_same(value, off) for off in OFF.get(name, _EMPTY))


def _same(value: Any, off: Any) -> bool:
    """Equal and of the same kind: `logprobs: 0` is off, `logprobs: "false"` is not (bool is an int)."""
    if isinstance(off, (bool, int, float)):
        return isinstance(value, (bool, int, float)) and value == off
    return type(value) is type(off) and bool(value == off)


def unsupported_parameter(fields: dict[str, Any], harmless: frozenset[str] = HARMLESS) -> tuple[str, str] | None:
    """The first field (in request order) this server cannot honour, with why; None if all can be."""
    for name, value in fields.items():
        if name in harmless or _is_off(name, value):
            continue
        offs = OFF.get(name)
        if offs is None:
            return name, "unrecognized request argument (this server does not implement it)"
        hint = " or ".join(repr(v) for v in offs) if offs else "null"
        return name, f"not supported by this server; leave it out or set it to {hint}"
    return None


def unsupported_message_field(fields: dict[str, Any]) -> tuple[str, str] | None:
    """The same check for a message's extra fields (`tool_calls`, `audio`, ...)."""
    return unsupported_parameter(fields, _MESSAGE_HARMLESS)
