"""The step's prefill budget (decoder_service/engine/scheduler.py) and its split between the prompts prefilling
(decoder_service/engine/fairness.py)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from decoder_service.cli import parse_args
from decoder_service.config import DecoderConfig
from decoder_service.engine.fairness import split_prefill_budget
from decoder_service.engine.scheduler import Scheduler


def test_each_prompt_gets_an_equal_part_and_what_one_cannot_use_goes_to_the_others_in_order() -> None:
    # 96 positions between a long, a short and a long prompt: 32 each, the short one's unused 22 to the first
    assert split_prefill_budget({"a": 500, "b": 10, "c": 500}, 96, 16) == {"a": 54, "b": 10, "c": 32}


def test_a_part_is_at_least_a_block_so_later_prompts_may_wait_a_step() -> None:
    assert split_prefill_budget({"a": 100, "b": 100, "c": 100}, 32, 16) == {"a": 16, "b": 16, "c": 0}


def test_a_burst_prefills_an_eighth_of_the_budget_each_a_few_at_a_time_not_a_sliver_each() -> None:
    # 64 prompts of 256 under a 2,032-token budget (2,048 less 16 decode rows): parts of 254 rounded up to whole
    # blocks, in admission order; the next step the one cut short finishes first
    grant = split_prefill_budget({i: 256 for i in range(64)}, 2032, 16)
    assert list(grant.values()) == [256] * 7 + [240] + [0] * 56
    rests = {i: 256 - n for i, n in grant.items() if n < 256}
    assert split_prefill_budget(rests, 2024, 16)[7] == 16


def test_a_short_rest_goes_before_long_prompts_admitted_earlier() -> None:
    # nine long prompts would take the parts in admission order; the short one, admitted last, still completes
    limits: dict[str, int] = {f"long{i}": 1000 for i in range(9)} | {"short": 20}
    grant = split_prefill_budget(limits, 2048, 16)
    assert grant["short"] == 20 and sum(grant.values()) == 2048
    assert [grant[f"long{i}"] for i in range(9)] == [256] * 7 + [2048 - 20 - 7 * 256, 0]
    assert list(grant) == list(limits)  # reported in admission order


def test_no_budget_or_no_prompt_grants_nothing() -> None:
    assert split_prefill_budget({"a": 10}, 0, 16) == {}
    assert split_prefill_budget({}, 64, 16) == {}


def _scheduler(cfg: DecoderConfig) -> Scheduler:
    runner: Any = SimpleNamespace(max_slots=cfg.max_num_seqs)  # prefill_budget reads no more of it
    return Scheduler(runner, cfg.max_prefill_tokens, lambda job, index: None,  # type: ignore[arg-type,return-value]
                     cfg.num_batched_tokens)


def test_by_default_a_step_packs_prompt_chunks_up_to_the_step_budget_beside_its_decode_rows() -> None:
    # vLLM's chunked prefill: decode rows first, then prompt tokens up to --max-num-batched-tokens less those rows
    cfg = DecoderConfig()
    assert cfg.max_prefill_tokens == 0 and cfg.num_batched_tokens == 2048
    assert _scheduler(cfg).prefill_budget(16) == 2048 - 16
    assert _scheduler(DecoderConfig(max_num_batched_tokens=512)).prefill_budget(40) == 512 - 40


def test_a_positive_max_prefill_tokens_still_caps_prompt_tokens_while_streams_decode() -> None:
    sched = _scheduler(DecoderConfig(max_prefill_tokens=32))
    assert sched.prefill_budget(16) == 32 and sched.prefill_budget(0) == 2048


def test_max_prefill_tokens_flag_defaults_to_no_cap_and_refuses_negatives() -> None:
    assert parse_args(["--insecure"]).max_prefill_tokens == 0
    assert parse_args(["--insecure", "--max-prefill-tokens", "64"]).max_prefill_tokens == 64
    with pytest.raises(SystemExit):
        parse_args(["--insecure", "--max-prefill-tokens", "-1"])
