"""A decoder started with --speculative-config, through its HTTP app (tracing on in memory): its answer's proposals
show on /metrics (`epd_decoder_spec_decode_*`), in /health (`spec_decode`) and on the request's `decode` span
(`epd.spec.*`), and all three agree; a decoder without it exports zeros and has no `spec_decode` in /health."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from decoder_service.config import DecoderConfig
from decoder_service.engine.spec.config import SpecConfig
from decoder_service.server import create_app
from epd_models.halves import LanguageHalf
from tests import test_tracing_off
from tests.decoder_service.test_handoff_tracing import finished

MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Name three colours and describe each one."}]}]
SAMPLING = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}  # a tiny random model's answer falls into a cycle
SPEC = "epd_decoder_spec_decode_"

exported = test_tracing_off.exported  # the fixture: tracing on in this process, spans kept in memory


def spec_samples(text: str) -> dict[str, float]:
    return {name.removeprefix(SPEC): float(value) for line in text.splitlines() if line.startswith(SPEC)
            for name, value in [line.rsplit(" ", 1)]}


def serve(model_dir: Path, spec: SpecConfig | None, traceparent: str) -> tuple[dict[str, float], dict[str, Any]]:
    """One greedy answer from a fresh decoder app; (its spec_decode samples, its /health) after it."""
    cfg = DecoderConfig(max_num_seqs=4, max_model_len=512, prefix_cache_bytes=0, speculative_config=spec)
    with TestClient(create_app(cfg, lm=LanguageHalf(model_dir))) as client:
        with client.stream("POST", "/generate", json={"messages": MESSAGES, "sampling": SAMPLING},
                           headers={"traceparent": traceparent}) as resp:
            assert resp.status_code == 200, resp.read()
            assert json.loads(list(resp.iter_lines())[-1])["type"] == "done"
        return spec_samples(client.get("/metrics").text), client.get("/health").json()


def test_proposals_show_alike_on_metrics_health_and_the_decode_span(
        exported: Any, tiny_model_dirs: dict[str, Path]) -> None:
    trace = "5e" * 16
    samples, health = serve(tiny_model_dirs["llava"], SpecConfig(num_speculative_tokens=4),
                            f"00-{trace}-{'3' * 16}-01")
    decode = finished(exported, {"decode", "POST /generate"}, trace)["decode"].attributes
    summary = health["spec_decode"]
    assert summary["k"] == 4 and 0 < summary["accepted_tokens"] <= summary["draft_tokens"]
    assert samples["num_drafts_total"] == summary["drafts"] > 0
    assert samples["num_draft_tokens_total"] == summary["draft_tokens"] == decode["epd.spec.draft_tokens"]
    assert samples["num_accepted_tokens_total"] == summary["accepted_tokens"] == decode["epd.spec.accepted_tokens"]
    per_pos = [samples[f'num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(4)]
    assert per_pos == summary["accepted_per_position"] and sum(per_pos) == summary["accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)  # a draft's position i is kept only after 0..i-1 were


def test_without_speculation_the_counters_are_zero_and_health_has_no_spec_decode(
        tiny_model_dirs: dict[str, Path]) -> None:
    samples, health = serve(tiny_model_dirs["llava"], None, f"00-{'6f' * 16}-{'4' * 16}-01")
    assert "spec_decode" not in health
    assert samples == {f"{name}_total": 0 for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
