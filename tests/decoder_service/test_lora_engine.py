"""LoRA adapters with speculative decoding and the prefill/decode hand-off: verification runs each row under its own
adapter, so greedy output with speculation is plain greedy output under each adapter (rows of the base model and of
two adapters in one batch, an image prompt among them), and a model given adapters again by a new engine serves that
engine's adapters; a request handed off under an adapter continues token for token as it runs alone."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from decoder_service.engine.work import Work
from epd_common.lora_flags import LoRAModule
from epd_models.halves import LanguageHalf
from tests.decoder_service.test_handoff import CASES, MemoryStore, handoff_engine, prefill_then_decode, run_one
from tests.decoder_service.test_preemption import prompts
from tests.decoder_service.test_speculative import GREEDY, Reference, accepted, both_ways, oracle, texts
from tests.lora_adapters import make_adapter

__all__ = ["oracle"]  # the fixture: plain runs record their tokens, speculative runs propose them (some made wrong)


def test_speculative_greedy_under_adapters_is_plain_greedy(tiny_model_dirs: dict[str, Path], tmp_path: Path,
                                                           oracle: Reference) -> None:
    model_dir = tiny_model_dirs["qwen2_5_vl"]
    lm = LanguageHalf(model_dir)
    modules = tuple(LoRAModule(n, str(make_adapter(model_dir, tmp_path / n, seed=i))) for i, n in enumerate("ab"))
    ps = prompts(model_dir, lm)
    specs = [(ps[0], GREEDY), (replace(ps[1], lora=1), GREEDY), (replace(ps[2], lora=2), GREEDY),
             (replace(ps[-1], lora=1), GREEDY)]
    plain, spec, engine = both_ways(model_dir, lm, specs, enable_lora=True, max_loras=2, lora_modules=modules)
    assert texts(spec) == texts(plain)
    drafted, kept = accepted(engine)
    assert 0 < kept < drafted
    again = both_ways(model_dir, lm, specs[1:2], enable_lora=True, max_loras=2, lora_modules=modules[::-1])[1]
    assert texts(again) != texts(spec[1:2])  # slot 1 is adapter b now, on the same model


def test_a_request_handed_off_under_an_adapter_continues_as_it_runs_alone(tiny_model_dirs: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    model_dir = tiny_model_dirs["llava"]
    lm = LanguageHalf(model_dir)
    store = MemoryStore()
    modules = (LoRAModule("a", str(make_adapter(model_dir, tmp_path / "a", seed=0))),)
    engine = handoff_engine(model_dir, lm, store, enable_lora=True, lora_modules=modules)
    try:
        image_prompt = prompts(model_dir, lm)[-1]
        params = CASES["greedy"]
        base = run_one(engine, Work(image_prompt, params), 1).texts
        prompt = replace(image_prompt, lora=1)
        alone = run_one(engine, Work(prompt, params), 1)
        first, rest, resume = prefill_then_decode(engine, store, prompt, params, "lora-a")
    finally:
        engine.close()
    assert resume.kv is not None, resume.why
    assert {0: first.texts.get(0, "") + rest.texts.get(0, "")} == alone.texts != base
