"""A quantized checkpoint through the launcher: `disagg-epd-proxy --model AWQ_DIR --quantization awq --dtype float32`
(an encoder and a decoder process; the launcher passes both flags on) answers with the tokens of its dequantized
twin served aggregated, its logprobs within 1e-5 (the twin's weights are memory-mapped, the dequantized ones fresh
memory: tests/models/test_quant_exact.py says why the last bit may differ), and the decoder's /health says how its
weights are held."""
from __future__ import annotations

import pytest

from tests.e2e.answers import aggregated, logprobs, tokens
from tests.e2e.stack import health, launched, urls_of
from tests.e2e.test_families import chat
from tests.quant_models import QuantModels


@pytest.mark.e2e
def test_awq_through_the_launcher_answers_as_its_twin(quant_model_dirs: QuantModels,
                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    quant, twin = quant_model_dirs["qwen2_5_vl", "awq"]
    images = [(224, 224, "red"), (168, 112, "blue")]
    with launched(tmp_path_factory.mktemp("awq"), "--model", str(quant), "--num-encoders", "1", "--num-decoders",
                  "1", "--quantization", "awq", "--dtype", "float32") as epd, aggregated(twin) as agg:
        got, want = chat(epd.base_url, quant.name, images), chat(agg, twin.name, images)
        decoder = health(urls_of(epd, "decoders")[0])
    assert tokens(got) == tokens(want) and len(set(tokens(got))) > 1
    assert logprobs(got) == pytest.approx(logprobs(want), abs=1e-5)
    quantization = decoder["loaded"]["quantization"]
    assert (quantization["method"], quantization["weights"]) == ("awq", "dequantized to float32 at load")
    assert quantization["quantized_linears"] == quantization["dequantized"] > 0
