"""LoRA adapters (decoder_service/lora.py, epd_models/lora/): under an adapter the language model gives exactly the
tokens of transformers' generate() on the PEFT-merged model, with an image in the prompt, in a batch that mixes the
base model and three adapters, prefilled in chunks beside decoding rows; and the engine gives every row of a mixed
batch exactly its solo answer."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from decoder_service.config import DecoderConfig
from decoder_service.engine.sampling import Sampler
from decoder_service.generate import generate
from decoder_service.lora import attach_loras
from decoder_service.prompt import Prompt
from epd_common.lora_flags import LoRAModule
from epd_contracts.sampling import SamplingParams
from epd_models.halves import LanguageHalf, VisionHalf
from epd_models.lora.layers import LoRASet
from tests.decoder_service.engine_run import greedy, make_engine, run
from tests.lora_adapters import make_adapter, merged_model
from tests.models.test_parity import NUM_NEW, _batched, _prompt, _reference

FAMILIES = ("llava", "qwen2_vl", "gemma3")
NAMES = ("a", "b", "c")


def adapters_for(model_dir: Path, folder: Path) -> dict[str, Path]:
    """Three adapters of ranks 16, 8 and 8."""
    return {name: make_adapter(model_dir, folder / name, seed=i, rank=8 if i else 16) for i, name in enumerate(NAMES)}


def with_adapters(model_dir: Path, tmp_path: Path, device: str) -> tuple[dict[str, Path], LanguageHalf, LoRASet,
                                                                         tuple[Prompt, list, str]]:
    """Three adapters (adapters_for) on the LM of `model_dir`, exact linears, and its one-image prompt."""
    adapters = adapters_for(model_dir, tmp_path)
    lm = LanguageHalf(model_dir, device=device)
    prompt = _prompt(lm, VisionHalf(model_dir, device=device), model_dir, "one_image")
    lora = attach_loras(lm, lora_config(adapters))
    assert lora is not None
    return adapters, lm, lora, prompt


def lora_config(adapters: dict[str, Path], cpu_exact_linear: bool = True) -> DecoderConfig:
    return DecoderConfig(enable_lora=True, max_loras=len(adapters), cpu_exact_linear=cpu_exact_linear,
                         lora_modules=tuple(LoRAModule(n, str(p)) for n, p in adapters.items()))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_adapter_gives_the_merged_models_tokens_in_a_batch_mixing_adapters(
        tiny_model_dirs: dict[str, Path], tmp_path: Path, family: str, device: str) -> None:
    model_dir = tiny_model_dirs[family]
    adapters, lm, lora, (prompt, images, prompt_text) = with_adapters(model_dir, tmp_path, device)
    prompts = [prompt] + [replace(prompt, lora=lora.slot(n)) for n in NAMES] * 2
    # chunks of rows of different adapters in each step; decode rows of one adapter apart (the gathered form)
    got = _batched(lm, prompts, NUM_NEW, chunk=5, budget=7)
    assert got[4:] == got[1:4]
    assert got[0] == _reference(model_dir, prompt_text, images, device)
    for name, tokens in zip(NAMES, got[1:4], strict=True):
        assert tokens == _reference(model_dir, prompt_text, images, device, merged_model(model_dir, adapters[name]))
    assert len({tuple(t) for t in got}) == 4, "every adapter changes the answer (else this proves little)"


@pytest.mark.parametrize("exact", [True, False], ids=["exact-linear", "prepacked"])
def test_the_engine_gives_each_row_of_a_mixed_batch_its_solo_answer(tiny_model_dirs: dict[str, Path],
                                                                    tmp_path: Path, exact: bool) -> None:
    """With --cpu-exact-linear and with the default prepacked linears (the LoRA matmuls prepacked too)."""
    model_dir = tiny_model_dirs["llava"]
    adapters = adapters_for(model_dir, tmp_path)
    lm = LanguageHalf(model_dir)
    prompt = _prompt(lm, VisionHalf(model_dir), model_dir, "one_image")[0]
    cfg = lora_config(adapters, cpu_exact_linear=exact)
    engine = make_engine(model_dir, lm, max_model_len=2048, **{k: getattr(cfg, k) for k in (
        "enable_lora", "max_loras", "cpu_exact_linear", "lora_modules")})
    try:
        assert engine.lm.lora is not None
        prompts = [prompt] + [replace(prompt, lora=engine.lm.lora.slot(n)) for n in NAMES] * 2
        together = run(engine, [(p, greedy(NUM_NEW)) for p in prompts])
        alone = [run(engine, [(p, greedy(NUM_NEW))])[0] for p in prompts]
    finally:
        engine.close()
    assert [r.answer() for r in together] == [r.answer() for r in alone]
    assert len({r.text for r in together}) == 4
    assert all(m.packed is not None for m in lm.module.modules() if hasattr(m, "packed")) != exact


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_sampling_under_an_adapter_gives_the_merged_models_tokens(
        tiny_model_dirs: dict[str, Path], tmp_path: Path, family: str, device: str) -> None:
    """A seeded request (temperature 0.8, top-k 20) under an adapter draws the tokens transformers' sampling
    generate() draws on the PEFT-merged model from the same seed: one torch.multinomial per token, on the same
    distribution, from a generator seeded alike (the engine's per request, transformers' the global one)."""
    model_dir = tiny_model_dirs[family]
    adapters, lm, lora, (prompt, images, prompt_text) = with_adapters(model_dir, tmp_path, device)
    merged = merged_model(model_dir, adapters["b"])
    answers = []
    for seed in (1, 2, 3):
        params = SamplingParams(max_tokens=NUM_NEW, temperature=0.8, top_k=20, seed=seed, ignore_eos=True)
        ours = list(generate(lm, replace(prompt, lora=lora.slot("b")), Sampler(params, device), NUM_NEW, set()))
        torch.manual_seed(seed)
        if device != "cpu":
            torch.cuda.manual_seed_all(seed)
        want = _reference(model_dir, prompt_text, images, device, merged, do_sample=True, temperature=0.8,
                          top_k=20, top_p=1.0)
        assert ours == want, seed
        answers.append(tuple(ours))
    assert len(set(answers)) == 3, "each seed draws its own answer (else this proves little)"
