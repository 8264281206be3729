"""With the prefix cache on, every output equals the output with it off, token for token, for every family.

Each case runs on one ModelRunner with a prefix cache, request after request as the engine runs them (a prompt's
blocks are kept when its prefill completes, a finished sequence gives its generated ones), and is compared with
the same prompt generated alone without any cache. Each also checks how many tokens were reused, so a cache that
never hits fails too.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoder_service.engine.model_runner import ModelRunner
from decoder_service.engine.prefix_hash import PrefixChain, prompt_chain
from decoder_service.generate import generate
from decoder_service.prompt import Prompt, build_prompt
from epd_builders.tiny import FAMILIES
from epd_contracts.embeddings import ImageFeatures
from epd_contracts.hashing import multi_image_item
from epd_models.chat import chat_template, image_edges, render
from epd_models.halves import LanguageHalf, VisionHalf
from tests.factories import make_image

NUM_NEW = 8
BLOCK = 16


def argmax(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits))


class Chat:
    """Prompts of one family's chat template, their images encoded once and named by a made-up mm_hash."""

    def __init__(self, model_dir: Path, device: str = "cpu"):
        self.vision, self.lm = VisionHalf(model_dir, device=device), LanguageHalf(model_dir, device=device)
        self.template = chat_template(self.lm.tokenizer, model_dir)
        self.features: dict[str, ImageFeatures] = {}

    def image(self, name: str, color: str, several: bool = False) -> str:
        multi = multi_image_item(self.lm.config.model_type, 2 if several else 1)
        key = f"{name}-{multi}"
        if key not in self.features:
            self.features[key] = self.vision.encode([make_image(224, 224, color)], multi_image=multi)[0]
        return key

    def prompt(self, messages: list[dict], images: list[str], salt: str = "") -> tuple[Prompt, PrefixChain]:
        ids = render(self.lm.tokenizer, messages, self.template, image_edges=image_edges(self.lm))
        feats = [self.features[k] for k in images]
        prompt = build_prompt(self.lm, ids, feats)
        chain = prompt_chain(prompt.input_ids[0].tolist(), BLOCK, salt, self.lm.image_token_id,
                             [(k, f.num_tokens) for k, f in zip(images, feats, strict=True)])
        assert chain is not None
        return prompt, chain

    def alone(self, prompt: Prompt) -> list[int]:
        return list(generate(self.lm, prompt, argmax, NUM_NEW, eos_ids=set()))


def run(runner: ModelRunner, prompt: Prompt, chain: PrefixChain, key: int = 0,
        generated: list[int] | None = None) -> tuple[list[int], int]:
    """One request as the engine runs it (prefill in chunks of the runner's size, decode, donate, free): its tokens
    and the prompt tokens it took from the cache."""
    reused = runner.add(key, prompt, chain=chain)
    done: dict = {}
    while not done:
        done = runner.prefill(prompt.num_tokens)
    tokens = [argmax(done[key])]
    while len(tokens) < NUM_NEW:
        tokens.append(argmax(runner.decode({key: tokens[-1]})[key]))
    runner.donate(key, tokens if generated is None else generated)
    runner.remove(key)
    return tokens, reused


def new_runner(lm: LanguageHalf, capacity: int = 1 << 30, chunk: int = 64) -> ModelRunner:
    return ModelRunner(lm, max_slots=2, max_len=768, chunk=chunk, prefix_bytes=capacity, prefix_block=BLOCK)


def user(text: str, num_images: int = 0) -> dict:
    return {"role": "user", "content": [*({"type": "image"} for _ in range(num_images)), {"type": "text", "text": text}]}


SYSTEM = {"role": "system", "content": "You are a careful assistant who describes pictures in plain words."}


@pytest.mark.parametrize("family", FAMILIES)
def test_second_turn_of_an_image_chat_reuses_the_first_and_equals_no_cache(tiny_model_dirs: dict[str, Path],
                                                                           family: str, device: str) -> None:
    """Turn 1: an image and a question. Turn 2: turn 1, its answer and a new question. With the cache, turn 2
    prefills only past turn 1's cached blocks (images, M-RoPE positions, DeepStack and Gemma 3's image masks
    included), and both turns give the tokens they give with no cache."""
    chat = Chat(tiny_model_dirs[family], device)
    img = chat.image("red", "red")
    turn1 = [SYSTEM, user("What colour is the shape in this picture?", 1)]
    p1, c1 = chat.prompt(turn1, [img])
    runner = new_runner(chat.lm)
    out1, reused1 = run(runner, p1, c1)
    assert reused1 == 0 and out1 == chat.alone(p1)
    answer = str(chat.lm.tokenizer.decode(out1, skip_special_tokens=True))
    p2, c2 = chat.prompt([*turn1, {"role": "assistant", "content": answer}, user("And how big is it?")], [img])
    out2, reused2 = run(runner, p2, c2, key=1)
    assert out2 == chat.alone(p2)
    # at least turn 1's full blocks (Gemma 3 may stop at an image's start: never here, the image is early)
    assert reused2 >= (p1.num_tokens // BLOCK) * BLOCK > 0
    assert reused2 % BLOCK == 0 and reused2 < p2.num_tokens


def test_a_different_picture_at_the_same_place_never_hits(tiny_model_dirs: dict[str, Path]) -> None:
    """Same text, same placeholder ids, another picture: only the blocks before the first image token are reused."""
    chat = Chat(tiny_model_dirs["qwen2_vl"])
    red, blue = chat.image("red", "red"), chat.image("blue", "blue")
    messages = [SYSTEM, user("What colour is the shape in this picture?", 1)]
    runner = new_runner(chat.lm)
    run(runner, *chat.prompt(messages, [red]))
    p_blue, c_blue = chat.prompt(messages, [blue])
    out, reused = run(runner, p_blue, c_blue, key=1)
    first_image_token = p_blue.input_ids[0].tolist().index(chat.lm.image_token_id)
    assert 0 < reused <= first_image_token and out == chat.alone(p_blue)
    assert chat.alone(p_blue) != chat.alone(chat.prompt(messages, [red])[0]), "the pictures must change the answer"


def test_partial_blocks_salts_and_generated_blocks(tiny_model_dirs: dict[str, Path]) -> None:
    """A prompt sharing 37 tokens with a cached one reuses 32 (whole blocks only); another salt reuses nothing;
    a finished sequence's generated tokens are cached too (a prompt that continues them reuses past its prompt)."""
    chat = Chat(tiny_model_dirs["llava"])
    base = chat.lm.tokenizer("the quick brown fox jumps over the lazy dog " * 8)["input_ids"][:60]

    def text(ids: list[int], salt: str = "") -> tuple[Prompt, PrefixChain]:
        chain = prompt_chain(ids, BLOCK, salt)
        assert chain is not None
        return Prompt(torch.tensor([ids]), []), chain

    runner = new_runner(chat.lm)
    first, _ = run(runner, *text(base))
    other = base[:37] + [t + 1 for t in base[37:50]]
    p, c = text(other)
    out, reused = run(runner, p, c, key=1)
    assert reused == 32 and out == chat.alone(p)
    p, c = text(other, salt="tenant-b")
    out, reused = run(runner, p, c, key=0)
    assert reused == 0 and out == chat.alone(p)
    continued = base + first[: NUM_NEW - 1] + base[:20]  # the fed-back tokens (the last one never was)
    p, c = text(continued)
    out, reused = run(runner, p, c, key=1)
    assert reused == ((len(base) + NUM_NEW - 1) // BLOCK) * BLOCK > (len(base) // BLOCK) * BLOCK
    assert out == chat.alone(p)


def test_eviction_under_pressure_keeps_outputs_exact(tiny_model_dirs: dict[str, Path]) -> None:
    """A cache of 6 blocks, prompts of 4-5 blocks each: every store evicts, outputs stay exact, bytes stay bounded,
    and the most recent prompt's blocks are the ones kept."""
    chat = Chat(tiny_model_dirs["qwen2_5_vl"])
    img = chat.image("red", "red")
    runner = new_runner(chat.lm, capacity=1)  # resized below, once the block size in bytes is known
    assert runner.prefix is not None
    runner.prefix.capacity = 6 * runner.prefix.block_bytes
    prompts = [chat.prompt([user(f"Question number {i}: what is in the picture, and why? " * 2, 1)], [img])
               for i in range(3)]
    for i, (p, c) in enumerate(prompts * 2):
        out, _ = run(runner, p, c, key=i % 2)
        assert out == chat.alone(p)
        assert runner.prefix.nbytes <= runner.prefix.capacity
    assert runner.prefix.evicted > 0
    last, chain = prompts[-1]
    assert len(runner.prefix.match(chain.keys)) >= 1  # the last prompt's root survived the pressure
