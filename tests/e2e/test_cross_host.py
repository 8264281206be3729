"""Cross-host: two encoders and a decoder each in its own network namespace, the proxy in the root one.

Each namespace is a "host" with its own address on a bridge in the root namespace (veth pairs), so every
HTTP call and every ZeroMQ link (decoder gathers, the proxy's cache-event subscriptions) crosses a real
interface over TCP, never loopback. Then one encoder's link goes down and the fleet must keep answering.
Needs root and iproute2; skipped otherwise.
"""
from __future__ import annotations

import base64
import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from epd_builders.tokenizer import COLORS
from tests.e2e.stack import ROOT, demo_png, health, wait_healthy
from tests.ports import REUSE_PORT_ENV, PortHolds

pytestmark = pytest.mark.e2e

ENC_HTTP, ENC_EC, DEC_HTTP = 8001, 9000, 8002  # the ports deploy/docker-compose*.yml use; each "host" has its own
REQUEST_TIMEOUT = 20.0  # seconds for one chat completion


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True, timeout=10).stdout


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.213.X.0/24 no address or route on this machine overlaps (runs in parallel pick different ones)."""
    used = [ipaddress.ip_interface(a).network for a in re.findall(r"inet (\S+)", _ip("-4", "-o", "addr"))]
    used += [ipaddress.ip_network(line.split()[0]) for line in _ip("-4", "route").splitlines()
             if line and line.split()[0] != "default"]
    for k in range(256):
        net = ipaddress.ip_network(f"10.213.{(os.getpid() + k) % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.213.X.0/24 subnet")


@dataclass(frozen=True)
class Host:
    ns: str  # network namespace
    veth: str  # the root-side end of its link: `ip link set VETH down` cuts the host off
    addr: str


@dataclass
class Net:
    """A bridge in the root namespace and one namespace per host; names are unique to this test process."""

    prefix: str = field(default_factory=lambda: f"epd{os.getpid()}")
    subnet: ipaddress.IPv4Network = field(default_factory=_free_subnet)
    hosts: list[Host] = field(default_factory=list)
    bridge_up: bool = False
    forward_rule: list[str] = field(default_factory=list)  # the iptables rule build() added, for close()

    def build(self, n: int) -> None:
        bridge, gateway = f"{self.prefix}br", self.subnet.network_address + 1
        _ip("link", "add", bridge, "type", "bridge")
        self.bridge_up = True
        _ip("addr", "add", f"{gateway}/{self.subnet.prefixlen}", "dev", bridge)
        _ip("link", "set", bridge, "up")
        if shutil.which("iptables"):
            # NOTE: a host running Docker sets FORWARD's policy to DROP, and its br_netfilter passes bridged frames
            # through that chain: without this rule host-to-host traffic on the bridge is dropped. Where iptables
            # cannot add it (no netfilter), nothing filters the bridge either.
            rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
            if subprocess.run(["iptables", "-I", *rule], capture_output=True, timeout=10).returncode == 0:
                self.forward_rule = rule
        for i in range(n):
            host = Host(f"{self.prefix}n{i}", f"{self.prefix}h{i}", str(self.subnet.network_address + 2 + i))
            _ip("netns", "add", host.ns)
            self.hosts.append(host)
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", f"{self.prefix}p{i}")
            _ip("link", "set", host.veth, "master", bridge, "up")
            _ip("link", "set", f"{self.prefix}p{i}", "netns", host.ns, "name", "eth0")
            _ip("-n", host.ns, "addr", "add", f"{host.addr}/{self.subnet.prefixlen}", "dev", "eth0")
            _ip("-n", host.ns, "link", "set", "eth0", "up")
            _ip("-n", host.ns, "link", "set", "lo", "up")

    def close(self) -> None:
        """Kill whatever still runs in the namespaces, then delete them (their veths go too) and the bridge.
        Best effort at every step, so one failure never leaves the rest behind."""

        def run(*args: str) -> str:
            return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10).stdout

        for host in self.hosts:
            for pid in run("netns", "pids", host.ns).split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            run("netns", "del", host.ns)
            run("link", "del", host.veth)  # only there if it was never moved into the namespace
        if self.bridge_up:
            run("link", "del", f"{self.prefix}br")
        if self.forward_rule:
            subprocess.run(["iptables", "-D", *self.forward_rule], capture_output=True, timeout=10)


@pytest.fixture
def net() -> Iterator[Net]:
    if sys.platform != "linux" or shutil.which("ip") is None:
        pytest.skip("cross-host test needs Linux and iproute2's `ip` to create network namespaces")
    if os.geteuid() != 0:
        pytest.skip("cross-host test needs root to create network namespaces (ip netns add)")
    net = Net()
    try:
        net.build(3)
    except subprocess.CalledProcessError as exc:
        net.close()
        pytest.skip(f"cannot create network namespaces and a bridge here: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
    try:
        yield net
    finally:
        net.close()


class Procs:
    """Processes each started in a new session, so killing its process group reaches all of it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[tuple[subprocess.Popen[bytes], Path]] = []
        self.holds = PortHolds()  # loopback ports of the processes started here, held for their lives

    def spawn(self, ns: str | None, module: str, args: list[str], name: str,
              held: bool = False) -> subprocess.Popen[bytes]:
        """`held`: its --port is one of `holds` (it binds beside the hold)."""
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "EPD_INSECURE": "1",
               **(REUSE_PORT_ENV if held else {})}
        wrap = ["ip", "netns", "exec", ns] if ns else []
        log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([*wrap, sys.executable, "-m", module, *args], stdout=out,
                                    stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        self.started.append((proc, log))
        return proc

    def log(self, proc: subprocess.Popen[bytes]) -> Path:
        return next(log for p, log in self.started if p is proc)

    def stop_all(self) -> None:
        """SIGTERM each process group (the proxy first), SIGKILL what is still there after 20 s."""
        for proc, _ in reversed(self.started):
            if proc.poll() is not None:  # reaped: its group id may belong to someone else by now
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.holds.close()


@pytest.fixture
def procs(net: Net, tmp_path: Path) -> Iterator[Procs]:
    """Depends on `net` so its processes are stopped before the namespaces go."""
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


def ask(proxy: str, *images: tuple[str, int]) -> httpx.Response:
    """The demo's colour question about demo pictures given as (colour, seed)."""
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        demo_png(colour, seed)).decode()}} for colour, seed in images]
    content = [*parts, {"type": "text", "text": "What color is the shape?"}]
    body = {"model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{proxy}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT)


def unreachable(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=1.0)
    except httpx.TransportError:
        return True
    return False


def test_requests_cross_hosts_over_tcp_and_survive_losing_an_encoder(net: Net, procs: Procs) -> None:
    enc_hosts, dec_host = net.hosts[:2], net.hosts[2]
    encoders = {}
    for i, h in enumerate(enc_hosts):
        proc = procs.spawn(h.ns, "encoder_service.cli",
                           ["--model", "demo", "--host", h.addr, "--port", str(ENC_HTTP),
                            "--ec-bind", f"tcp://{h.addr}:{ENC_EC}"], f"encoder-{i}")
        encoders[f"http://{h.addr}:{ENC_HTTP}"] = proc
    decoder = f"http://{dec_host.addr}:{DEC_HTTP}"
    dec_proc = procs.spawn(dec_host.ns, "decoder_service.cli",
                           ["--model", "demo", "--host", dec_host.addr, "--port", str(DEC_HTTP)], "decoder")
    port = procs.holds.take()
    proxy = f"http://127.0.0.1:{port}"
    # probes every 0.5 s (1 s timeout): a host that drops off is taken out within seconds
    proxy_proc = procs.spawn(None, "epd_launcher.cli", ["--host", "127.0.0.1", "--port", str(port), "--startup-timeout", "90",
                                                 "--health-interval", "0.5", "--health-timeout", "1",
                                                 "--encode-servers-urls", *encoders, "--decode-servers-urls", decoder],
                             "proxy", held=True)
    for url, proc in [*encoders.items(), (decoder, dec_proc), (proxy, proxy_proc)]:
        wait_healthy(url, proc, procs.log(proc), timeout=90)

    # every encoder serves embeddings on its own host's address, not loopback
    for h, url in zip(enc_hosts, encoders, strict=True):
        assert health(url)["ec_address"] == f"tcp://{h.addr}:{ENC_EC}"

    # four new images in one request, placed by rendezvous under the load bound: at most ceil(1.25 * 4 / 2) = 3 on
    # one encoder, so both encode some; the decoder gathers from each over TCP
    resp = ask(proxy, ("red", 1), ("blue", 2), ("red", 3), ("blue", 4))
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] > 4 * 64  # every image's 64 tokens reached the decoder
    counts = [health(url)["num_encoded"] for url in encoders]
    assert sum(counts) == 4 and min(counts) >= 1, counts

    # encoder 0's host drops off the network while everything keeps running
    lost, kept = list(encoders)
    _ip("link", "set", enc_hosts[0].veth, "down")
    assert unreachable(lost)
    assert encoders[lost].poll() is None  # the process is alive, only its link is gone
    before = health(kept)["num_encoded"]
    answers_right(proxy, 0)  # at once: this one may still try the lost host first, and fails over
    # the event the rest depends on (no wall-clock bound: a busy machine only makes it later): the proxy took the
    # lost encoder out of service, by its probes or by the failed call
    wait_for(lambda: counter(proxy, "epd_proxy_workers_marked_down_total") >= 1, "the lost encoder marked down")
    failovers = counter(proxy, "epd_proxy_failovers_total")
    for seed in range(1, 10):
        answers_right(proxy, seed)
    assert counter(proxy, "epd_proxy_failovers_total") == failovers  # none of them tried the lost host
    assert health(kept)["num_encoded"] == before + 10  # every new image was encoded on the encoder still reachable


def answers_right(proxy: str, seed: int) -> None:
    colour = COLORS[seed % len(COLORS)]
    resp = ask(proxy, (colour, 100 + seed))
    assert resp.status_code == 200, f"request {seed} after the link went down: {resp.status_code} {resp.text}"
    assert resp.json()["choices"][0]["message"]["content"] == colour


def counter(proxy: str, name: str) -> float:
    """A proxy counter's samples for the encoders (role="encoder")."""
    lines = httpx.get(f"{proxy}/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(f'{name}{{role="encoder"}}'))


def wait_for(check: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.2)
