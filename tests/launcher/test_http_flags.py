"""Launcher mode hands the proxy's HTTP limits and --shutdown-timeout to every worker it spawns (not the body cap:
each worker sizes its own), and waits for each server's drain before it kills anything."""
from __future__ import annotations

from typing import Any

import pytest

from decoder_service.cli import parse_args as decoder_args
from encoder_service.cli import parse_args as encoder_args
from encoder_service.config import EncoderConfig
from epd_launcher.group import STOP_MARGIN_S, RestartPolicy
from epd_launcher.proxy_procs import ProxyChildren
from proxy.config import ProxyConfig
from tests.launcher.test_cli import spawned_workers

HTTP_ARGV = ["--body-read-timeout", "7.5", "--header-timeout", "3.5", "--timeout-keep-alive", "9",
             "--max-header-bytes", "8192", "--backlog", "77", "--send-timeout", "12.5", "--shutdown-timeout", "4.5",
             "--limit-concurrency", "100", "--max-body-bytes", "1000"]
SHARED = {"body_read_timeout": 7.5, "header_timeout": 3.5, "timeout_keep_alive": 9, "max_header_bytes": 8192,
          "backlog": 77, "send_timeout": 12.5, "shutdown_timeout": 4.5}


def worker_configs(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> list[Any]:
    parse = {"encoder": encoder_args, "decoder": decoder_args}
    return [parse[role]([a for a in extra if a != "--device" and not a.startswith("cuda:")])
            for role, extra in spawned_workers(monkeypatch, argv)]


@pytest.mark.parametrize("num_procs", [1, 3])
def test_the_proxys_http_limits_reach_every_spawned_worker(monkeypatch: pytest.MonkeyPatch, num_procs: int) -> None:
    configs = worker_configs(monkeypatch, ["--num-encoders", "2", "--num-decoders", "2", "--num-prefills", "1",
                                           "--proxy-workers", str(num_procs), *HTTP_ARGV])
    assert len(configs) == 5
    for cfg in configs:
        assert {name: getattr(cfg, name) for name in SHARED} == SHARED
        assert cfg.limit_concurrency == 100 * num_procs  # every proxy process may hold its limit of calls
        assert cfg.max_body_bytes != 1000  # a worker's body is not a client's: its own cap stays
    assert next(c for c in configs if isinstance(c, EncoderConfig)).max_body_bytes == EncoderConfig.max_body_bytes


def test_no_concurrency_limit_stays_none_for_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    assert {cfg.limit_concurrency for cfg in worker_configs(monkeypatch, ["--proxy-workers", "2",
                                                                         "--limit-concurrency", "0"])} == {0}


@pytest.mark.parametrize("value", ["-1", "inf", "soon"])
def test_a_bad_shutdown_timeout_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert encoder_args(["--insecure", "--shutdown-timeout", "0"]).shutdown_timeout == 0  # 0: cut at once
    with pytest.raises(SystemExit) as info:
        encoder_args(["--insecure", "--shutdown-timeout", value])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--shutdown-timeout" in err
    assert "must be a number of seconds >= 0" in err or "invalid seconds value" in err  # not a number: float() says


class StubbornChild:
    """A proxy process that ignores SIGTERM: stop() waits for it, then kills it."""

    pid, exitcode = 4242, None

    def __init__(self) -> None:
        self.waits: list[float | None] = []
        self.killed = False

    def terminate(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        self.waits.append(timeout)

    def kill(self) -> None:
        self.killed, self.exitcode = True, -9


def test_proxy_processes_get_their_shutdown_timeout_to_drain_before_a_kill() -> None:
    cfg = ProxyConfig(encode_urls=("http://127.0.0.1:1",), decode_urls=("http://127.0.0.1:2",), shutdown_timeout=4.5)
    children, child = ProxyChildren(cfg, 1, RestartPolicy(), "unused"), StubbornChild()
    children.procs = [child]  # type: ignore[list-item]
    children.stop()
    assert child.killed and child.waits[0] is not None
    assert cfg.shutdown_timeout < child.waits[0] <= cfg.shutdown_timeout + STOP_MARGIN_S
