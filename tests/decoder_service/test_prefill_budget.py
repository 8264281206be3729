"""The step's prefill budget split between the prompts prefilling (decoder_service/engine/fairness.py)."""
from decoder_service.engine.fairness import split_prefill_budget


def test_each_prompt_gets_an_equal_part_and_what_one_cannot_use_goes_to_the_others_in_order() -> None:
    # 96 positions between a long, a short and a long prompt: 32 each, the short one's unused 22 to the first
    assert split_prefill_budget({"a": 500, "b": 10, "c": 500}, 96, 16) == {"a": 54, "b": 10, "c": 32}


def test_a_part_is_at_least_a_block_so_later_prompts_may_wait_a_step() -> None:
    assert split_prefill_budget({"a": 100, "b": 100, "c": 100}, 32, 16) == {"a": 16, "b": 16, "c": 0}


def test_no_budget_or_no_prompt_grants_nothing() -> None:
    assert split_prefill_budget({"a": 10}, 0, 16) == {}
    assert split_prefill_budget({}, 64, 16) == {}
