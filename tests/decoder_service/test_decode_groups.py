"""CPU decode attention groups (StepInputs.decode_runs): rows are fed sorted by length, and a row much longer than
the others attends in a group of its own, so the short rows no longer gather and attend over the long row's
length; the tokens and logits are the one-group step's."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoder_service.engine.model_runner import ModelRunner
from decoder_service.engine.step_inputs import DECODE_SPLIT_BLOCKS
from decoder_service.prompt import Prompt, build_prompt
from epd_models.chat import chat_template, render
from epd_models.halves import LanguageHalf

WORDS = (3, 160, 6, 9)  # one long prompt among short ones, not in length order


def prompt(lm: LanguageHalf, words: int) -> Prompt:
    text = " ".join(["what color is the shape"] * words)
    ids = render(lm.tokenizer, [{"role": "user", "content": [{"type": "text", "text": text}]}],
                 chat_template(lm.tokenizer, lm.model_dir))
    return build_prompt(lm, ids, [])


def decode(lm: LanguageHalf, split: bool, steps: int) -> tuple[list[dict[int, int]], list[dict[int, torch.Tensor]],
                                                                list[list[int]]]:
    """Greedy tokens and logits of `steps` decode steps, and the decode groups' widths in blocks of the first."""
    runner = ModelRunner(lm, max_slots=len(WORDS), max_len=2048, chunk=4096)
    runner.inputs.split_decode = split
    for key, words in enumerate(WORDS):
        runner.add(key, prompt(lm, words))
    feed = {k: int(torch.argmax(v)) for k, v in runner.prefill(1 << 16).items()}
    tokens, logits, widths = [feed], [], []
    for _ in range(steps):
        runner.grow(feed)
        if not widths:
            plan, _, _ = runner.inputs.plan(runner._decode_segments(feed), feed)
            widths = [[int(g.table.shape[1])] * g.table.shape[0] for g in plan.groups if g.decode]
        out = runner.decode(feed)
        logits.append(out)
        feed = {k: int(torch.argmax(v)) for k, v in out.items()}
        tokens.append(feed)
    return tokens, logits, widths


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_a_long_decode_row_attends_alone_and_every_row_gets_the_one_group_steps_logits(
        tiny_model_dirs: dict[str, Path], family: str) -> None:
    lm = LanguageHalf(tiny_model_dirs[family])
    lengths = sorted(prompt(lm, w).num_tokens for w in WORDS)
    assert lengths[-1] > 2 * lengths[-2] and lengths[-1] - lengths[-2] >= DECODE_SPLIT_BLOCKS * 16  # it splits
    split_tokens, split_logits, split_widths = decode(lm, True, 4)
    one_tokens, one_logits, one_widths = decode(lm, False, 4)
    assert len(one_widths) == 1 and len(split_widths) == 2 and [len(g) for g in split_widths] == [3, 1]
    assert split_widths[0][0] == -(-(lengths[-2] + 1) // 16) < split_widths[1][0] == one_widths[0][0]
    assert split_tokens == one_tokens
    for split, one in zip(split_logits, one_logits, strict=True):
        for key in one:
            torch.testing.assert_close(split[key], one[key], rtol=1e-4, atol=1e-4)


def test_rows_of_like_lengths_share_one_group(tiny_model_dirs: dict[str, Path]) -> None:
    lm = LanguageHalf(tiny_model_dirs["llava"])
    runner = ModelRunner(lm, max_slots=3, max_len=2048, chunk=4096)
    for key, words in enumerate((3, 6, 9)):
        runner.add(key, prompt(lm, words))
    feed = {k: int(torch.argmax(v)) for k, v in runner.prefill(1 << 16).items()}
    runner.grow(feed)
    segments = runner._decode_segments(feed)
    assert [s.start for s in segments] == sorted(s.start for s in segments)
    plan, _, _ = runner.inputs.plan(segments, feed)
    assert [g.table.shape[0] for g in plan.groups] == [3]
