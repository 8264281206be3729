"""render(max_tokens=...): a prompt that cannot fit is refused before it is tokenized; one that fits never is."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import normalizers, pre_tokenizers

from epd_models.chat import PromptTooLong, render
from epd_models.demo import DEMO_DIR
from epd_models.tokenizer_facts import tokenizer_facts
from tests.hostile.memory import peak_rss_bytes, rss_bytes
from tests.models.test_chat_factories import all_tokenizers, load, today, user

NAMES = ("llava", "qwen2_vl", "demo", "metaspace")
MIB = 2**20
BIG_PROMPT_CHARS = 6_000_000  # what cost a decoder 1.4 GiB before (tokenized in full)
BIG_PROMPT_RSS_BOUND = 48 * MIB  # measured 5 MiB (tokenized in full: ~1.3 GiB); the render copies the text


@pytest.fixture(scope="module")
def toks(tiny_model_dirs: dict[str, Path]) -> dict[str, tuple[Any, str]]:
    return all_tokenizers(tiny_model_dirs)


def _longest_token_text(tok: Any) -> str:
    """The text of the vocab entry covering the most characters: the densest prompt there is."""
    added = set(tok.added_tokens_decoder)
    vocab = [(t, i) for t, i in tok.get_vocab().items() if i not in added]
    return str(tok.decode([max(vocab, key=lambda ti: len(tok.decode([ti[1]])))[1]]))


@pytest.mark.parametrize("name", NAMES)
def test_exactly_max_tokens_fits_and_one_fewer_allowed_is_refused(toks: dict[str, tuple[Any, str]],
                                                                  name: str) -> None:
    tok, template = toks[name]
    for text in ("What color is the shape? " * 40, _longest_token_text(tok) * 300):
        messages = [user(text, images=1)]
        num_tokens = len(today(tok, messages, template))
        assert render(tok, messages, template, max_tokens=num_tokens) == today(tok, messages, template)
        with pytest.raises(PromptTooLong) as info:
            render(tok, messages, template, max_tokens=num_tokens - 1)
        assert info.value.max_tokens == num_tokens - 1 and info.value.num_tokens_at_least >= num_tokens


@pytest.mark.parametrize("name", NAMES)
@settings(deadline=None, max_examples=80, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_the_cheap_bound_never_exceeds_the_true_count(toks: dict[str, tuple[Any, str]], name: str,
                                                               data: st.DataObject) -> None:
    tok, _ = toks[name]
    pieces = st.one_of(st.text(max_size=6), st.sampled_from([_longest_token_text(tok), " ", "\n", "é", "<|im_end|>"]))
    text = "".join(data.draw(st.lists(pieces, max_size=40)))
    assert tokenizer_facts(tok).min_tokens(text) <= len(tok(text, add_special_tokens=False)["input_ids"])


def test_a_6_mb_prompt_is_refused_before_it_is_tokenized() -> None:
    tok, template = load(DEMO_DIR)
    render(tok, [user("warm up")], template, max_tokens=4096)  # facts computed, caches filled
    messages = [user("The shape is red. " * (BIG_PROMPT_CHARS // 18))]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # NOTE: resets VmHWM, so the peak below is this render's alone
    before = rss_bytes()
    with pytest.raises(PromptTooLong) as info:
        render(tok, messages, template, max_tokens=4096)
    growth = peak_rss_bytes() - before
    assert growth < BIG_PROMPT_RSS_BOUND, f"refusal took {growth / MIB:.0f} MiB"
    assert info.value.num_tokens_at_least > 4096


def test_without_a_cheap_bound_the_exact_count_still_refuses() -> None:
    """A pipeline that can drop text (here whitespace) has no cheap bound; the count after tokenizing holds."""
    tok, template = load(DEMO_DIR)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    assert tokenizer_facts(tok).max_chars_per_token is None and tokenizer_facts(tok).min_tokens("x" * 99) == 0
    with pytest.raises(PromptTooLong):
        render(tok, [user("red " * 200)], template, max_tokens=50)


@pytest.mark.parametrize(("normalizer", "factor"), [
    (normalizers.NFC(), 4), (normalizers.NFKC(), 4), (normalizers.Lowercase(), 1),
    (normalizers.Sequence([normalizers.NFD(), normalizers.Replace("  ", " ")]), 2),
    (normalizers.Strip(), None), (normalizers.BertNormalizer(), None),
])
def test_normalizers_that_shrink_text_widen_or_drop_the_bound(normalizer: Any, factor: int | None) -> None:
    tok, _ = load(DEMO_DIR)
    longest = tokenizer_facts(tok).max_chars_per_token
    tok, _ = load(DEMO_DIR)  # a fresh object: facts are cached per tokenizer
    tok.backend_tokenizer.normalizer = normalizer
    got = tokenizer_facts(tok).max_chars_per_token
    assert got == (None if factor is None or longest is None else longest * factor)
