"""disagg-epd-proxy --speculative-config JSON: checked as epd-decoder checks it (a bad one, or a method the decoder
does not run, is a usage error, exit 2, before anything starts) and passed, as given, to every spawned decoder and
prefill worker; never to an encoder."""
from __future__ import annotations

import pytest

from decoder_service.engine.spec.config import parse_spec_config
from epd_launcher import spawn
from epd_launcher.flags import parse_args
from epd_launcher.group import Secrets
from tests.launcher.test_cli import RecordingGroup

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


def spawned(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> list[tuple[str, list[str]]]:
    """(encoder / decoder / prefill, extra arguments) of each worker the launcher would spawn (no GPU)."""
    monkeypatch.setenv("EPD_INSECURE", "1")
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    _, args = parse_args(argv)
    group = RecordingGroup()
    spawn.spawn_workers(group, args, Secrets.generate(), args.model)  # type: ignore[arg-type]
    return [("prefill" if "prefill" in extra else role, extra) for role, extra in group.spawned]


def test_each_decoder_and_prefill_worker_gets_the_json_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from decoder_service.cli import parse_args as decoder_args

    workers = spawned(monkeypatch, ["--num-decoders", "2", "--num-prefills", "1", "--speculative-config", NGRAM])
    assert [kind for kind, _ in workers] == ["encoder", "decoder", "decoder", "prefill"]
    assert all("--speculative-config" not in extra for kind, extra in workers if kind == "encoder")
    for _, extra in workers[1:]:
        assert extra[extra.index("--speculative-config") + 1] == NGRAM
        assert decoder_args(extra).speculative_config == parse_spec_config(NGRAM)


def test_not_given_it_is_not_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not [a for _, extra in spawned(monkeypatch, ["--num-prefills", "1"]) for a in extra
                if a == "--speculative-config"]


@pytest.mark.parametrize("text", [NGRAM, '{"model": "/models/draft", "num_speculative_tokens": 4}',
                                  '{"method": "eagle3", "model": "/models/eagle3", "num_speculative_tokens": 3}'])
def test_every_method_the_decoder_runs_is_taken_and_passed_as_given(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    workers = spawned(monkeypatch, ["--speculative-config", text])
    (decoder,) = [extra for kind, extra in workers if kind == "decoder"]
    assert decoder[decoder.index("--speculative-config") + 1] == text


@pytest.mark.parametrize("text,says", [
    ('{"method": "medusa", "model": "/models/medusa", "num_speculative_tokens": 4}', "'medusa' (trained heads)"),
    ('{"method": "eagle", "model": "/models/eagle", "num_speculative_tokens": 3}', "'eagle' (trained heads)"),
    ('{"method": "eagle3", "num_speculative_tokens": 3}', "need \"model\": PATH"),
    ('{"method": "ngram", "model": "/models/draft", "num_speculative_tokens": 3}', "ngram takes none"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}', "unknown key(s) lookahead"),
    ("ngram", "is not JSON"),
])
def test_a_config_the_decoder_would_refuse_is_a_usage_error_naming_why(
        text: str, says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_INSECURE", "1")
    with pytest.raises(SystemExit) as refused:
        parse_args(["--num-decoders", "2", "--speculative-config", text])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "argument --speculative-config: " in err and says in err, err
