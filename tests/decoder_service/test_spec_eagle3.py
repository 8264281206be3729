"""Speculative decoding with EAGLE-3 heads (the published format, random weights from epd_builders/eagle3.py): greedy
output is plain greedy's token for token for every family, images in the prompt; the heads are fed the target's
hidden states; heads that do not fit the target are refused at start."""
from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from decoder_service.engine.spec.config import SpecConfig
from decoder_service.preflight import check_draft_model
from epd_builders.eagle3 import build_eagle3
from epd_builders.tiny import FAMILIES
from epd_common.startup import ConfigError
from epd_models.halves import LanguageHalf
from tests.decoder_service.engine_run import run
from tests.decoder_service.test_preemption import prompts
from tests.decoder_service.test_speculative import GREEDY, K, accepted, plain_texts, spec_engine, texts


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_eagle3_heads_is_plain_greedy(tiny_model_dirs: dict[str, Path], tmp_path: Path,
                                                  family: str) -> None:
    target = tiny_model_dirs[family]
    heads = build_eagle3(target, tmp_path / "eagle3")
    check_draft_model(target, str(heads), "eagle3")
    lm = LanguageHalf(target)
    ps = prompts(target, lm)
    specs = [(ps[0], GREEDY), (ps[-1], GREEDY), (ps[-1], msgspec.structs.replace(GREEDY, logprobs=2))]
    expected = plain_texts(target, lm, specs)
    cfg = SpecConfig("eagle3", K, disable_by_batch_size=64, model=str(heads))
    with spec_engine(target, lm, cfg) as engine:
        assert texts(run(engine, specs)) == expected
        drafted, kept = accepted(engine)
        assert drafted > 0  # the heads were fed the target's hidden states and proposed
        run(engine, specs[:1])  # its first step forgets the rows that left: at most its own last step stays
        eagle = engine.speculator.eagle  # type: ignore[union-attr]
        assert len(eagle.aux) <= 1 and all(len(v) <= K + 1 for v in eagle.aux.values())
        print(f"{family}: EAGLE-3 (random heads) kept {kept} of {drafted}")


def test_heads_that_do_not_fit_the_target_are_refused(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    target = tiny_model_dirs["llava"]
    heads = build_eagle3(target, tmp_path / "ok")
    config = json.loads((heads / "config.json").read_text())
    for name, change, says in (("wide", {"hidden_size": 128}, "hidden size 128"),
                               ("layers", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}},
                                "not that")):
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**config, **change}))
        (bad / "model.safetensors").write_bytes((heads / "model.safetensors").read_bytes())
        with pytest.raises(ConfigError, match=says):
            check_draft_model(target, str(bad), "eagle3")
    with pytest.raises(ConfigError, match="cannot read"):
        check_draft_model(target, str(tmp_path), "eagle3")
