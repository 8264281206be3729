"""The command lines a vLLM user types: defaults in --help, --version, checked --log-level, one mode at a time,
and vLLM's --prefill-servers-urls."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from decoder_service.cli import parse_args as decoder_args
from encoder_service.cli import parse_args as encoder_args
from epd_common.cli import package_version
from epd_launcher.flags import ATTACH_FLAGS, LAUNCHER_FLAGS, build_parser, parse_args

ATTACH = ["--encode-servers-urls", "http://e:1", "--decode-servers-urls", "http://d:2"]
PROGRAMS: dict[str, Callable[[list[str]], Any]] = {
    "disagg-epd-proxy": parse_args, "epd-encoder": encoder_args, "epd-decoder": decoder_args}


def usage_error(parse: Callable[[list[str]], Any], argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def help_text(program: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        PROGRAMS[program](["--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("program", PROGRAMS)
def test_help_gives_every_flag_a_help_text_and_its_default(program: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser() if program == "disagg-epd-proxy" else None
    text = " ".join(help_text(program, capsys).split())
    assert "(default: " in text and "--version" in text
    if parser is not None:
        for action in parser._actions:
            assert action.help, f"{action.option_strings} has no help"
        assert "(default: 8000)" in text and "(default: demo)" in text


@pytest.mark.parametrize("program", PROGRAMS)
def test_help_never_prints_a_key_from_the_environment(program: str, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_INTERNAL_KEY", "internal-secret-123")
    monkeypatch.setenv("EPD_API_KEY", "api-secret-456")
    text = help_text(program, capsys)
    assert "internal-secret-123" not in text and "api-secret-456" not in text


@pytest.mark.parametrize("program", PROGRAMS)
def test_keys_are_read_from_the_files_their_FILE_variables_name(program: str, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Any) -> None:
    """How compose and Kubernetes hand keys over: EPD_INTERNAL_KEY_FILE=/run/secrets/internal_key."""
    (tmp_path / "internal").write_text("internal-from-file\n")
    (tmp_path / "api").write_text("api-from-file")
    monkeypatch.setenv("EPD_INTERNAL_KEY_FILE", str(tmp_path / "internal"))
    monkeypatch.setenv("EPD_API_KEY_FILE", str(tmp_path / "api"))
    args = PROGRAMS[program](["--insecure"] + (ATTACH if program == "disagg-epd-proxy" else []))
    args = args[1] if isinstance(args, tuple) else args
    assert args.internal_key == "internal-from-file"
    if program == "disagg-epd-proxy":
        assert args.api_key == "api-from-file"
    # a key given twice, or a file that cannot be read, stops the program with the reason, before anything starts
    monkeypatch.setenv("EPD_INTERNAL_KEY", "also-in-env")
    with pytest.raises(SystemExit, match="both EPD_INTERNAL_KEY and EPD_INTERNAL_KEY_FILE are set"):
        PROGRAMS[program](["--insecure"])
    monkeypatch.delenv("EPD_INTERNAL_KEY")
    monkeypatch.setenv("EPD_INTERNAL_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(SystemExit, match="EPD_INTERNAL_KEY_FILE: cannot read .*missing"):
        PROGRAMS[program](["--insecure"])


def test_proxy_help_groups_flags_by_mode_and_has_no_worker_only_flags(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_text("disagg-epd-proxy", capsys)
    launcher, attach = text.index("launcher mode"), text.index("attach mode (workers")
    for flag in LAUNCHER_FLAGS:
        assert launcher < text.index(f"  {flag} ") < attach
    for flag in ATTACH_FLAGS:
        assert text.index(f"  {flag} ") > attach
    for worker_only in ("--ec-curve-allowed-clients", "--device", "--ec-bind", "--ec-cache-bytes"):
        assert worker_only not in text
    assert launcher < text.index("  --max-num-seqs ") < attach  # the decoders' engine flags are launcher flags
    assert launcher < text.index("  --dtype ") < attach  # as vLLM's: passed to every spawned worker


@pytest.mark.parametrize("program", PROGRAMS)
def test_version_comes_from_the_package(program: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        PROGRAMS[program](["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"{program} {package_version()}"
    assert package_version()[0].isdigit()  # installed in .venv (pip install -e)


@pytest.mark.parametrize("program", PROGRAMS)
def test_log_level_is_checked_and_case_insensitive(program: str, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_INSECURE", "1")  # workers refuse to start without keys otherwise
    parse = PROGRAMS[program]
    args = parse(["--log-level", "DEBUG"])
    assert (args[1] if isinstance(args, tuple) else args).log_level == "debug"
    assert "argument --log-level: invalid choice: 'loud'" in usage_error(parse, ["--log-level", "loud"], capsys)


@pytest.mark.parametrize("launcher,attach", [
    (["--model", "demo"], ATTACH), (["--num-encoders", "2"], ["--dynamic-registration"]),
    (["--max-restarts", "1"], ["--insecure"]), (["--worker-host", "0.0.0.0"], ["--prefill-servers-urls", "disable"]),
])
def test_launcher_and_attach_flags_together_are_a_usage_error(launcher: list[str], attach: list[str],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(parse_args, [*launcher, *attach], capsys)
    assert f"launcher-mode flags ({launcher[0]})" in err and f"attach-mode flags ({attach[0]}" in err


def test_the_mode_follows_the_flags_given_and_defaults_still_apply() -> None:
    _, launcher = parse_args(["--model", "bench", "--port", "9000"])
    _, attach = parse_args(ATTACH)
    assert not launcher.attach and launcher.model == "bench" and launcher.encode_servers_urls is None
    assert attach.attach and attach.model == "demo" and attach.num_encoders == 1 and attach.port == 8000
    assert not parse_args([])[1].attach


@pytest.mark.parametrize("value", ["disable", "none", "", "NONE", " Disable "])
def test_vllm_prefill_servers_urls_meaning_no_prefill_stage_is_accepted(value: str) -> None:
    from epd_launcher.cli import _prefill_urls

    _, args = parse_args([*ATTACH, "--prefill-servers-urls", value])
    assert args.attach and _prefill_urls(args.prefill_servers_urls) == ()


def test_prefill_urls_are_taken_in_attach_mode_and_reach_the_proxy_config() -> None:
    from epd_launcher.cli import _config, _prefill_urls

    _, args = parse_args([*ATTACH, "--prefill-servers-urls", "http://p1:8300", "http://p2:8300/"])
    args.prefill_urls = _prefill_urls(args.prefill_servers_urls)
    assert _config(args, ("http://e:1",), ("http://d:2",), None, None).prefill_urls == ("http://p1:8300",
                                                                                          "http://p2:8300")
    with pytest.raises(ValueError, match="not both"):
        _prefill_urls(["http://p1:8300", "disable"])
    with pytest.raises(ValueError):
        _prefill_urls(["p1:8300/path"])


def test_prefix_affinity_flags_work_in_both_modes_and_reach_the_proxy_config() -> None:
    from epd_launcher.cli import _config

    for mode in ([], ["--model", "demo"], ATTACH):
        _, args = parse_args(mode)
        cfg = _config(args, ("http://e:1",), ("http://d:2",), None, None)
        assert cfg.prefix_affinity and cfg.affinity_load_gap == 4  # the defaults
        _, args = parse_args([*mode, "--no-prefix-affinity", "--affinity-load-gap", "0"])
        cfg = _config(args, ("http://e:1",), ("http://d:2",), None, None)
        assert not cfg.prefix_affinity and cfg.affinity_load_gap == 0


@pytest.mark.parametrize("argv", [["--affinity-load-gap", "-1"], ["--prefix-cache-bytes", "-5"],
                                  ["--affinity-load-gap", "many"]])
def test_negative_or_non_numeric_affinity_and_cache_sizes_are_usage_errors(argv: list[str],
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert f"argument {argv[0]}" in usage_error(parse_args, argv, capsys)


def test_prefix_cache_bytes_is_a_launcher_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(["--prefix-cache-bytes", "0"])[1].prefix_cache_bytes == 0
    assert parse_args([])[1].prefix_cache_bytes is None  # not given: the decoders keep their own default
    err = usage_error(parse_args, [*ATTACH, "--prefix-cache-bytes", "1024"], capsys)
    assert "launcher-mode flags (--prefix-cache-bytes)" in err
