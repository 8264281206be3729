"""A byte-level BPE tokenizer trained on the fly, with a chat template, for the tiny and demo models."""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
]
COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
SHAPES = ["circle", "square", "triangle"]
QUESTIONS = {"color": "What color is the shape?", "shape": "What shape is it?"}

# NOTE: `image` stands for what one image part renders to; the decoder expands it to num_tokens.
_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- else -%}{%- for c in m['content'] -%}"
    "{%- if c['type'] in ('image', 'image_url') -%}{{ '@IMAGE@' }}"
    "{%- elif c['type'] == 'text' -%}{{ c['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def chat_template(image_markup: str) -> str:
    return _TEMPLATE.replace("@IMAGE@", image_markup)


def corpus() -> list[str]:
    lines = [f"The shape is a {c} {s}. It is {c}. It is a {s}." for c in COLORS for s in SHAPES]
    lines += list(QUESTIONS.values()) + ["user", "assistant", "system", "Describe the image.", "Hello, how are you?"]
    lines += ["The quick brown fox jumps over the lazy dog. 0123456789 ,.;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`"]
    return lines * 4


def train_tokenizer(image_token: str, image_markup: str, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a small BPE and wrap it with the attributes processors read (image_token, ...)."""
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
        extra_special_tokens={"image_token": image_token, "video_token": "<|video_pad|>"},
        chat_template=chat_template(image_markup),
    )
