"""A byte-level BPE tokenizer trained on the fly, with a chat template, for the tiny and demo models."""
from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from epd_models.tool_prompt import CALL_BEGIN, CALL_END, RESULT_BEGIN, RESULT_END, TOOLS_FOOTER, TOOLS_HEADER

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
]
COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
SHAPES = ["circle", "square", "triangle"]
QUESTIONS = {"color": "What color is the shape?", "shape": "What shape is it?"}


def _text(s: str) -> str:
    """A Jinja string literal printing `s` (a JSON string literal of ASCII text reads the same in Jinja)."""
    return "{{ " + json.dumps(s) + " }}"


# NOTE: `image` stands for what one image part renders to; the decoder expands it to num_tokens.
# Tools as Qwen2.5's template renders them: the tools block ends the system turn (a new one if there is none),
# assistant calls are <tool_call> JSON, a run of tool results is one user turn of <tool_response> blocks. The words
# are epd_models/tool_prompt.py's, so this template and render()'s fallback for a tool-blind template agree.
# A conversation without tools renders as it did before tools existed (tests/models/test_chat_tools.py).
_TEMPLATE = (
    "{%- macro body(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for c in content -%}"
    "{%- if c['type'] in ('image', 'image_url') -%}{{ '@IMAGE@' }}@VIDEO@"
    "{%- elif c['type'] == 'text' -%}{{ c['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}{{ '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' and messages[0]['content'] -%}"
    "{{ body(messages[0]['content']) }}{{ '\\n\\n' }}{%- endif -%}"
    + _text(TOOLS_HEADER) + "{%- for t in tools -%}{{ '\\n' }}{{ t | tojson }}{%- endfor -%}"
    + _text(TOOLS_FOOTER) + "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if tools and loop.first and m['role'] == 'system' -%}"
    "{%- elif m['role'] == 'assistant' and m['tool_calls'] -%}{{ '<|im_start|>assistant' }}"
    "{%- if m['content'] -%}{{ '\\n' }}{{ body(m['content']) }}{%- endif -%}"
    "{%- for tc in m['tool_calls'] -%}{%- set f = tc['function'] -%}{{ '\\n' }}"
    + _text(CALL_BEGIN) + "{{ {'name': f['name'], 'arguments': f['arguments']} | tojson }}" + _text(CALL_END) +
    "{%- endfor -%}{{ '<|im_end|>\\n' }}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\\n' }}" + _text(RESULT_BEGIN) + "{{ body(m['content']) }}" + _text(RESULT_END) +
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}"  # as before tools existed, text for text (tests patch these lines)
    "{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- else -%}{%- for c in m['content'] -%}"
    "{%- if c['type'] in ('image', 'image_url') -%}{{ '@IMAGE@' }}@VIDEO@"
    "{%- elif c['type'] == 'text' -%}{{ c['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


VIDEO_TOKEN = "<|video_pad|>"  # every tiny checkpoint's video token (config video_token_id, where it takes video)


def chat_template(image_markup: str, video_markup: str | None = None) -> str:
    """The template, writing `image_markup` for each image part and `video_markup` for each video part (None:
    video parts are not rendered, as before videos existed: the demo model's committed template)."""
    video = "" if video_markup is None else (
        "{%- elif c['type'] in ('video', 'video_url') -%}{{ " + json.dumps(video_markup) + " }}")
    return _TEMPLATE.replace("@IMAGE@", image_markup).replace("@VIDEO@", video)


def video_markup(image_token: str, image_markup: str) -> str | None:
    """What a video part renders to: the image markup with the image token swapped for the video token (Qwen:
    <|vision_start|><|video_pad|><|vision_end|>, as its templates write a video; "<image>" -> "<|video_pad|>"),
    or None where the markup does not hold the image token (Gemma 3's <start_of_image>: no video)."""
    return image_markup.replace(image_token, VIDEO_TOKEN) if image_token in image_markup else None


def corpus() -> list[str]:
    lines = [f"The shape is a {c} {s}. It is {c}. It is a {s}." for c in COLORS for s in SHAPES]
    lines += list(QUESTIONS.values()) + ["user", "assistant", "system", "Describe the image.", "Hello, how are you?"]
    lines += ["The quick brown fox jumps over the lazy dog. 0123456789 ,.;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`"]
    return lines * 4


def train_tokenizer(image_token: str, image_markup: str, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a small BPE and wrap it with the attributes processors read (image_token, ...); its chat template
    renders video parts as `video_markup` makes them."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": image_token, "video_token": VIDEO_TOKEN},
        chat_template=chat_template(image_markup, video_markup(image_token, image_markup)),
    )
