"""Logprobs: each token's real bytes (byte-level BPE and sentencepiece byte fallback), and the sampler's entries."""
from __future__ import annotations

import math

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from decoder_service.engine.logprobs import NEG_LOGPROB, TokenTable, entry, unicode_to_byte
from decoder_service.engine.readback import read_back_rows
from decoder_service.engine.sampling import Sampler
from epd_builders.tokenizer import train_tokenizer
from epd_contracts.sampling import SamplingParams

TEXTS = ["The shape is a red circle.", "héllo → 😀 café", "<|im_start|>user\n日本 ok<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer("<image>", "<image>")


@pytest.fixture(scope="module")
def tokens(tokenizer: PreTrainedTokenizerFast) -> TokenTable:
    return TokenTable(tokenizer)


def sentencepiece() -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: "▁" for space, `<0xHH>` tokens for bytes the vocabulary lacks."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for piece in ["▁", "h", "i", "a", "▁h", "▁hi"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [("▁", "h"), ("▁h", "i")], byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_gpt2_byte_table_covers_every_byte_once() -> None:
    table = unicode_to_byte()
    assert sorted(table.values()) == list(range(256)) and table["Ġ"] == 32 and table["Ċ"] == 10


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_tokens_join_to_the_texts_utf8(tokenizer: PreTrainedTokenizerFast, tokens: TokenTable,
                                                  text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokens.byte_level
    assert b"".join(bytes(tokens.bytes(i)) for i in ids) == text.encode("utf-8")
    assert [tokens.text(i) for i in ids] == [tokenizer.decode([i]) for i in ids]


def test_half_a_character_has_its_raw_bytes_and_replacement_text(tokenizer: PreTrainedTokenizerFast,
                                                                 tokens: TokenTable) -> None:
    ids = tokenizer.encode("→😀", add_special_tokens=False)  # split inside the characters by a tiny vocabulary
    partial = [i for i in ids if not _is_utf8(bytes(tokens.bytes(i)))]
    assert partial and all("\ufffd" in tokens.text(i) for i in partial)
    assert b"".join(bytes(tokens.bytes(i)) for i in ids) == "→😀".encode()


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_table_is_filled_lazily_per_token(tokenizer: PreTrainedTokenizerFast) -> None:
    table = TokenTable(tokenizer)
    assert table._cache == {}
    table.bytes(5)
    assert list(table._cache) == [5]


def test_special_tokens_are_their_plain_text(tokenizer: PreTrainedTokenizerFast, tokens: TokenTable) -> None:
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(end, int)
    assert tokens.text(end) == "<|im_end|>" and tokens.bytes(end) == list(b"<|im_end|>")


def test_sentencepiece_byte_fallback_tokens_are_raw_bytes_and_the_space_marker_a_space() -> None:
    tok = sentencepiece()
    table = TokenTable(tok)
    text = "hi é→ a"
    ids = tok.encode(text, add_special_tokens=False)
    assert not table.byte_level and "<0xC3>" in tok.convert_ids_to_tokens(ids)
    # sentencepiece prepends the space marker to a sequence; every byte of the text follows it
    assert b"".join(bytes(table.bytes(i)) for i in ids) == b" " + text.encode("utf-8")
    hi = tok.convert_tokens_to_ids("▁hi")
    assert isinstance(hi, int) and table.text(hi) == " hi"


def test_entry_sends_minus_infinity_and_nan_as_minus_9999(tokens: TokenTable) -> None:
    made = entry(tokens, 5, -math.inf, [(6, math.nan), (7, -0.5)])
    assert made.logprob == NEG_LOGPROB and [t.logprob for t in made.top_logprobs] == [NEG_LOGPROB, -0.5]
    assert made.bytes == tokens.bytes(5) and made.top_logprobs[1].token == tokens.text(7)


# --- the sampler's entries ------------------------------------------------------------------------------

LOGITS = torch.tensor([0.5, 3.0, 2.9, -1.0, 1.0, -math.inf, 0.0, 2.0])


def chosen_entry(params: SamplingParams, tokens: TokenTable, logits: torch.Tensor = LOGITS,
                 history: tuple[int, ...] = ()) -> tuple[int, Sampler]:
    sampler = Sampler(params, tokens=tokens)
    for token in history:
        sampler.accept(token)
    return int(sampler.choose(logits)), sampler


def test_greedy_token_has_the_top_logprob_of_log_softmax_at_temperature_one(tokens: TokenTable) -> None:
    token, sampler = chosen_entry(SamplingParams(temperature=0, logprobs=3), tokens)
    made = sampler.logprob_entry(token)
    expected = torch.log_softmax(LOGITS, -1)
    assert made is not None and token == 1
    assert made.logprob == pytest.approx(float(expected[1]), abs=1e-6)
    assert made.logprob == max(t.logprob for t in made.top_logprobs) == made.top_logprobs[0].logprob
    assert made.token == tokens.text(1) and made.bytes == tokens.bytes(1)


def test_logprobs_follow_penalties_bias_and_temperature(tokens: TokenTable) -> None:
    params = SamplingParams(temperature=0.7, seed=3, presence_penalty=0.5, frequency_penalty=0.25,
                            logit_bias={4: 1.5}, logprobs=5)
    token, sampler = chosen_entry(params, tokens, history=(1, 1, 2))
    shaped = LOGITS.clone()
    shaped[1] -= 2 * 0.25 + 0.5
    shaped[2] -= 0.25 + 0.5
    shaped[4] += 1.5
    expected = torch.log_softmax(shaped / 0.7, -1)
    made = sampler.logprob_entry(token)
    assert made is not None and made.logprob == pytest.approx(float(expected[token]), abs=1e-5)
    top = [(tokens.text(int(i)), float(v)) for v, i in zip(*torch.topk(expected, 5), strict=True)]
    assert [(t.token, t.logprob) for t in made.top_logprobs] == [(t, pytest.approx(v, abs=1e-5)) for t, v in top]


def test_top_logprobs_are_k_sorted_entries_with_their_bytes(tokens: TokenTable) -> None:
    token, sampler = chosen_entry(SamplingParams(seed=0, logprobs=4), tokens)
    made = sampler.logprob_entry(token)
    assert made is not None and len(made.top_logprobs) == 4
    values = [t.logprob for t in made.top_logprobs]
    assert values == sorted(values, reverse=True)
    ids = torch.topk(LOGITS, 4).indices.tolist()
    assert [(t.token, t.bytes) for t in made.top_logprobs] == [(tokens.text(i), tokens.bytes(i)) for i in ids]


def test_zero_top_logprobs_still_gives_the_chosen_tokens_logprob(tokens: TokenTable) -> None:
    token, sampler = chosen_entry(SamplingParams(temperature=0, logprobs=0), tokens)
    made = sampler.logprob_entry(token)
    assert made is not None and made.top_logprobs == [] and made.logprob < 0


def test_twenty_top_logprobs_over_a_smaller_vocabulary_lists_the_whole_vocabulary(tokens: TokenTable) -> None:
    token, sampler = chosen_entry(SamplingParams(temperature=0.5, seed=1, logprobs=20), tokens)
    made = sampler.logprob_entry(token)
    assert made is not None and len(made.top_logprobs) == len(LOGITS)
    assert made.top_logprobs[-1].logprob == NEG_LOGPROB  # the -inf logit, as OpenAI sends it


@pytest.mark.parametrize("row", [[math.nan] * 4, [-math.inf] * 4, [math.inf, 0.0, math.inf, math.nan]])
def test_logprobs_of_degenerate_rows_are_finite_numbers(tokens: TokenTable, row: list[float]) -> None:
    token, sampler = chosen_entry(SamplingParams(seed=2, logprobs=4, logit_bias={0: 50}), tokens,
                                  torch.tensor(row))
    made = sampler.logprob_entry(token)
    assert made is not None and all(math.isfinite(v) for v in [made.logprob, *(t.logprob for t in made.top_logprobs)])


def test_no_logprobs_asked_means_no_entry_and_no_work(tokens: TokenTable) -> None:
    token, sampler = chosen_entry(SamplingParams(seed=0), tokens)
    assert sampler.logprob_entry(token) is None and sampler._logprobs is None


def test_entry_of_a_token_other_than_the_chosen_one_is_looked_up(tokens: TokenTable) -> None:
    token, sampler = chosen_entry(SamplingParams(temperature=0, logprobs=1), tokens)
    made = sampler.logprob_entry(7)
    assert token == 1 and made is not None and made.token == tokens.text(7)
    assert made.logprob == pytest.approx(float(torch.log_softmax(LOGITS, -1)[7]), abs=1e-6)


class _AllowOnly:
    def __init__(self, allowed: set[int]):
        self.allowed = allowed

    def refused(self, vocab: int, device: torch.device) -> torch.Tensor:
        keep = torch.zeros(vocab, dtype=torch.bool, device=device)
        keep[list(self.allowed)] = True
        return ~keep

    def accept(self, token: int) -> None:
        assert token in self.allowed


def test_logprobs_come_from_before_the_grammar_mask(tokens: TokenTable) -> None:
    sampler = Sampler(SamplingParams(temperature=0, logprobs=2), guide=_AllowOnly({0, 4}), tokens=tokens)
    token = int(sampler.choose(LOGITS))
    made = sampler.logprob_entry(token)
    expected = torch.log_softmax(LOGITS, -1)
    assert token == 4 and made is not None  # the grammar's best, not the model's
    assert made.logprob == pytest.approx(float(expected[4]), abs=1e-6) and made.logprob > NEG_LOGPROB
    assert [t.token for t in made.top_logprobs] == [tokens.text(1), tokens.text(2)]  # the model's real preferences


def test_rows_read_back_together_give_each_row_its_own_entry() -> None:
    """The engine reads every logprobs row back in one transfer; each row's entry is what it reads alone."""
    tokens = TokenTable(train_tokenizer("<image>", "<image>"))
    torch.manual_seed(3)
    samplers = {key: Sampler(SamplingParams(temperature=0, logprobs=k), tokens=tokens) for key, k in
                ((0, 0), (1, 3), (2, 20))}
    chosen = {key: int(s.choose(torch.randn(300))) for key, s in samplers.items()}
    rows = read_back_rows({key: s.packed for key, s in samplers.items() if s.packed is not None})
    assert [len(rows[key]) for key in (0, 1, 2)] == [2, 8, 42]
    for key, s in samplers.items():
        assert s.logprob_entry(chosen[key], rows[key]) == s.logprob_entry(chosen[key])
    assert read_back_rows({}) == {}
