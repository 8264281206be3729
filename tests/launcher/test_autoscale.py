"""--autoscale: the launcher follows the planner's count one worker a window, registers a new worker with the proxy
only once it answers /health, takes one out of the proxy before stopping it, and never goes below --min-*;
its flags default from --num-* and refuse what it cannot serve."""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from epd_launcher.autoscale import Autoscaler
from epd_launcher.flags import parse_args
from epd_launcher.group import Worker
from epd_planner.model import Bounds
from epd_planner.planner import PlannerConfig
from tests.loopback_http import LoopbackServer, QuietHandler


class Calls(QuietHandler):
    """A proxy's /instances and a worker's /health in one fake: records each /instances call."""

    seen: list[tuple[str, dict[str, Any]]] = []

    def do_GET(self) -> None:
        self.send_body(200, b'{"status": "ok"}')

    def _record(self, method: str) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).seen.append((method, body))
        self.send_body(201 if method == "POST" else 200, b"{}")

    def do_POST(self) -> None:
        self._record("POST")

    def do_DELETE(self) -> None:
        self._record("DELETE")


@pytest.fixture
def server() -> Iterator[LoopbackServer]:
    Calls.seen = []
    s = LoopbackServer(Calls)
    yield s
    s.close()


@dataclass
class FakeGroup:
    retired: list[str] = field(default_factory=list)

    def retire(self, worker: Worker, grace: float) -> int:
        self.retired.append(worker.url)
        worker.proc.kill()
        return worker.proc.wait()


@dataclass
class FakeSpawner:
    url: str  # every spawned worker's /health is the fake's
    group: FakeGroup = field(default_factory=FakeGroup)
    spawned: list[tuple[str, int]] = field(default_factory=list)

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, role: str, i: int) -> Worker:
        self.spawned.append((role, i))
        return Worker(role=role, url=f"{self.url}?{role}{i}", proc=self.popen("import time; time.sleep(600)"))

    def popen(self, code: str) -> subprocess.Popen[bytes]:
        self.procs.append(subprocess.Popen([sys.executable, "-c", code]))
        return self.procs[-1]

    def reap(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


@pytest.fixture
def spawner(server: LoopbackServer) -> Iterator[FakeSpawner]:
    s = FakeSpawner(server.url)
    yield s
    s.reap()


def autoscaler(spawner: FakeSpawner, encoders: int, bounds: Bounds) -> Autoscaler:
    start = {"encoder": [spawner.spawn("encoder", i) for i in range(encoders)]}
    spawner.spawned.clear()
    cfg = PlannerConfig(spawner.url, "k", window=1.0, bounds=bounds)
    return Autoscaler(spawner, spawner.url, "k", cfg, start, startup_timeout=30, shutdown_timeout=1,  # type: ignore[arg-type]
                      planner=object())  # type: ignore[arg-type]


def test_more_wanted_starts_one_worker_a_window_and_registers_it_once_healthy(server: LoopbackServer,
                                                                            spawner: FakeSpawner) -> None:
    scaler = autoscaler(spawner, 1, Bounds(max_encoders=4))
    scaler.follow({"encoder": 3, "prefill": 0})
    assert spawner.spawned == [("encoder", 1)] and len(scaler.workers["encoder"]) == 2
    assert Calls.seen == [("POST", {"role": "encoder", "url": f"{server.url}?encoder1"})]
    scaler.follow({"encoder": 3})
    assert spawner.spawned[-1] == ("encoder", 2) and len(scaler.workers["encoder"]) == 3


def test_fewer_wanted_takes_the_newest_out_of_the_proxy_then_stops_it_never_below_min(spawner: FakeSpawner) -> None:
    scaler = autoscaler(spawner, 3, Bounds(min_encoders=2, max_encoders=4))
    newest = scaler.workers["encoder"][-1].url
    scaler.follow({"encoder": 1})  # the planner is clamped too; the launcher checks again
    assert Calls.seen == [("DELETE", {"role": "encoder", "url": newest})] and spawner.group.retired == [newest]
    scaler.follow({"encoder": 1})
    scaler.follow({"encoder": 0})
    assert len(scaler.workers["encoder"]) == 2 and spawner.group.retired == [newest]  # held at --min-encoders


def test_a_worker_that_exits_while_loading_is_stopped_and_not_registered(spawner: FakeSpawner) -> None:
    scaler = autoscaler(spawner, 1, Bounds(max_encoders=2))

    def dead(role: str, i: int) -> Worker:
        proc = spawner.popen("raise SystemExit(3)")
        proc.wait()  # exited while loading: it is never asked for /health, so its URL is never reached
        return Worker(role=role, url="http://127.0.0.1:9", proc=proc)

    spawner.spawn = dead  # type: ignore[method-assign]
    assert scaler.add("encoder") is None
    assert Calls.seen == [] and spawner.group.retired == ["http://127.0.0.1:9"] and len(scaler.workers["encoder"]) == 1
    assert scaler.events[-1][0] == "failed"


def test_bounds_default_from_the_start_counts() -> None:
    _, args = parse_args(["--autoscale", "--num-encoders", "2", "--num-decoders", "1"])
    assert (args.min_encoders, args.max_encoders, args.min_decoders, args.max_decoders) == (2, 4, 1, 1)
    assert (args.min_prefills, args.max_prefills) == (0, 0)
    _, args = parse_args(["--autoscale", "--min-encoders", "1", "--max-encoders", "3"])
    assert (args.min_encoders, args.num_encoders, args.max_encoders) == (1, 1, 3)


@pytest.mark.parametrize(("argv", "says"), [
    (["--max-encoders", "3"], "without --autoscale"),
    (["--autoscale", "--proxy-workers", "2"], "--proxy-workers 1"),
    (["--autoscale", "--num-encoders", "3", "--max-encoders", "2"], "outside"),
    (["--autoscale", "--min-encoders", "2"], "outside"),
    (["--autoscale", "--tensor-parallel-size", "2", "--max-decoders", "2"], "GPUs of its own"),
    (["--autoscale", "--target-utilization", "0"], "target-utilization"),
    (["--autoscale", "--encode-servers-urls", "http://a:1", "--decode-servers-urls", "http://b:1"], "attach-mode"),
])
def test_what_autoscale_cannot_serve_exits_2_naming_it(argv: list[str], says: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err
