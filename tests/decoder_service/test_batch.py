"""Batched decoding over the paged K/V pool equals one-sequence decoding, token for token; forks share blocks."""
from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path

import pytest
import torch

from decoder_service.engine.model_runner import ModelRunner
from decoder_service.engine.prefix_hash import prompt_chain
from decoder_service.generate import generate
from decoder_service.prompt import Prompt, build_prompt
from epd_models.chat import chat_template, render
from epd_models.halves import LanguageHalf, VisionHalf
from tests.factories import make_image

NUM_NEW = 12
# (image sizes and colours, words of text): text-only, one and two images, prompts of different lengths
PROMPTS = [
    ([], 3),
    ([(224, 224, "red")], 1),
    ([(168, 112, "blue"), (224, 224, "green")], 2),
    ([], 40),
    ([(112, 168, "red")], 12),
]


def prompts(model_dir: Path) -> tuple[LanguageHalf, list[Prompt]]:
    vision, lm = VisionHalf(model_dir), LanguageHalf(model_dir)
    template = chat_template(lm.tokenizer, model_dir)
    out = []
    for sizes, num_words in PROMPTS:
        parts: list[dict] = [{"type": "image"} for _ in sizes]
        text = " ".join(["what color is the shape"] * num_words)
        ids = render(lm.tokenizer, [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}], template)
        features = vision.encode([make_image(w, h, c) for w, h, c in sizes]) if sizes else []
        out.append(build_prompt(lm, ids, features))
    return lm, out


def single(lm: LanguageHalf, prompt: Prompt) -> list[int]:
    return list(generate(lm, prompt, lambda logits: int(torch.argmax(logits)), NUM_NEW, eos_ids=set()))


def batched(lm: LanguageHalf, all_prompts: list[Prompt], max_slots: int, chunk: int, budget: int) -> list[list[int]]:
    """Admit prompts as slots free up, prefill within a token budget per step, decode the rest together."""
    runner = ModelRunner(lm, max_slots=max_slots, max_len=1024, chunk=chunk)
    waiting = list(enumerate(all_prompts))
    out: dict[Hashable, list[int]] = {i: [] for i in range(len(all_prompts))}
    next_token: dict[Hashable, int] = {}
    while waiting or runner.rows:
        while waiting and not runner.is_full:
            runner.add(*waiting.pop(0))
        for key, logits in runner.prefill(budget).items():
            next_token[key] = int(torch.argmax(logits))
        feed = {}
        for key, token in list(next_token.items()):
            out[key].append(token)
            if len(out[key]) == NUM_NEW:
                runner.remove(key)
                del next_token[key]
            else:
                feed[key] = token
        next_token = {key: int(torch.argmax(logits)) for key, logits in runner.decode(feed).items()}
    return [out[i] for i in range(len(all_prompts))]


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_batched_greedy_equals_single_sequence_greedy(tiny_model_dirs: dict[str, Path], family: str) -> None:
    lm, all_prompts = prompts(tiny_model_dirs[family])
    expected = [single(lm, p) for p in all_prompts]
    assert len({tuple(e) for e in expected}) == len(expected), "prompts too alike to prove anything"
    # 3 slots for 5 prompts: slots are reused while others run; chunks of 16 split long prefills
    assert batched(lm, all_prompts, max_slots=3, chunk=16, budget=24) == expected
    assert batched(lm, all_prompts, max_slots=5, chunk=256, budget=4096) == expected


def test_the_pool_is_its_blocks_and_a_row_holds_only_the_blocks_its_positions_need(
        tiny_model_dirs: dict[str, Path]) -> None:
    lm, (short, *_) = prompts(tiny_model_dirs["llava"])
    text = lm.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_position = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 4  # K and V, float32
    runner = ModelRunner(lm, max_slots=3, max_len=100, prefix_block=16, num_blocks=40)
    assert runner.cache.nbytes == 40 * 16 * per_position
    runner.add("a", short)
    assert len(runner.rows["a"].blocks) == -(-short.num_tokens // 16) == runner.blocks.num_usable - runner.num_free_blocks


def poison_pool(runner: ModelRunner) -> None:
    """Earlier owners left non-finite K/V in every block but the null one."""
    for layer in runner.cache.paged_layers:
        for pool in (layer.keys, layer.values):
            assert pool is not None
            (pool[:, 1:] if runner.cache.head_major else pool[1:]).fill_(float("nan"))


def test_forks_share_the_prompts_full_blocks_copy_its_last_and_decode_like_its_own_prefill(
        tiny_model_dirs: dict[str, Path]) -> None:
    lm, (short, _, _, long, _) = prompts(tiny_model_dirs["llava"])
    runner = ModelRunner(lm, max_slots=5, max_len=1024, chunk=16)
    poison_pool(runner)
    runner.add("a", long)
    runner.add("b", short)
    runner.add("c", long, forks=["c1", "c2"])  # reserves two more rows
    assert runner.is_full
    done = runner.prefill(budget=long.num_tokens * 2 + short.num_tokens)
    assert list(runner.rows) == ["a", "b", "c", "c1", "c2"] and set(done) == {"a", "b", "c", "c1", "c2"}
    assert runner.num_prefilled_tokens == 2 * long.num_tokens + short.num_tokens  # the forks prefilled nothing
    full = long.num_tokens // runner.block_size
    c, c1, c2 = (runner.rows[k].blocks for k in ("c", "c1", "c2"))
    assert c[:full] == c1[:full] == c2[:full]  # the same blocks: shared, not copied
    assert len({c[full], c1[full], c2[full]}) == 3  # the partial last block: one each
    assert all(runner.blocks.refs[b] == 3 for b in c[:full])
    tokens = {key: [int(torch.argmax(logits))] for key, logits in done.items()}
    for _ in range(NUM_NEW - 1):
        for key, logits in runner.decode({k: t[-1] for k, t in tokens.items()}).items():
            tokens[key].append(int(torch.argmax(logits)))
    assert tokens["c"] == tokens["c1"] == tokens["c2"] == tokens["a"] == single(lm, long)
    for key in list(runner.rows):
        runner.remove(key)
    assert runner.num_free_blocks == runner.blocks.num_usable and not any(runner.blocks.refs)


def test_a_fork_behind_a_row_still_prefilling(tiny_model_dirs: dict[str, Path]) -> None:
    lm, (short, _, _, long, _) = prompts(tiny_model_dirs["llava"])
    runner = ModelRunner(lm, max_slots=4, max_len=1024, chunk=8)
    runner.add("c", short, forks=["c1"])
    runner.add("b", long)
    done: dict[Hashable, torch.Tensor] = {}
    while "c" not in done:  # chunks of 8 for both rows in each forward
        done.update(runner.prefill(budget=16))
    assert set(done) == {"c", "c1"} and list(runner.rows) == ["c", "b", "c1"] and not runner.rows["b"].prefilled
    while not runner.rows["b"].prefilled:
        done.update(runner.prefill(budget=64))
    tokens = [int(torch.argmax(done["b"]))]
    feed: dict[Hashable, int] = {"c": int(torch.argmax(done["c"])), "c1": int(torch.argmax(done["c1"]))}
    for _ in range(NUM_NEW - 1):
        out = runner.decode({**feed, "b": tokens[-1]})
        feed = {k: int(torch.argmax(out[k])) for k in ("c", "c1")}
        tokens.append(int(torch.argmax(out["b"])))
    assert tokens == single(lm, long)


def test_prefix_reuse_is_zero_copy_the_second_rows_table_names_the_first_rows_blocks(
        tiny_model_dirs: dict[str, Path]) -> None:
    lm, (_, _, _, long, _) = prompts(tiny_model_dirs["llava"])
    chain = prompt_chain(long.input_ids.view(-1).tolist(), 16)
    assert chain is not None
    runner = ModelRunner(lm, max_slots=2, max_len=1024, chunk=64, prefix_bytes=1 << 30, prefix_block=16)
    runner.add("a", long, chain=chain)
    done = runner.prefill(budget=long.num_tokens)
    reused = runner.add("b", long, chain=chain)
    full = (long.num_tokens - 1) // 16
    assert reused == full * 16 and runner.rows["b"].blocks[:full] == runner.rows["a"].blocks[:full]
    assert all(runner.blocks.refs[b] == 2 for b in runner.rows["a"].blocks[:full])
    done.update(runner.prefill(budget=long.num_tokens))
    assert runner.num_prefilled_tokens == 2 * long.num_tokens - full * 16
    assert torch.equal(int(torch.argmax(done["a"])) * torch.ones(1), int(torch.argmax(done["b"])) * torch.ones(1))
