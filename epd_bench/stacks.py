"""Starts and stops the systems a comparison runs side by side, each described as data: its processes' commands,
the python (venv) each runs, their cores (taskset) and threads.

Fairness rule ("split" pinning): every system gets the same cores in all. The aggregated decoder and
`transformers serve` are one process each, so they get every core (OMP threads = cores). EPD gives its
encoders their own cores, as a deployment gives them their own GPUs: the decoder gets core 0,
encoders get cores 1..N and, when there are more encoders than spare cores, wrap round onto core 0 and
up (with 2 cores and 2 encoders: decoder 0, encoder 0 on core 1, encoder 1 on core 0). Each worker runs
OMP_NUM_THREADS = the cores it is pinned to. The proxy (the same code in every EPD and aggregated
system) and the benchmark client are not pinned. "none" pinning starts everything unpinned with the
launcher's thread counts (cores // processes). "overlap" pins encoders as "split" does but lets the
decoder use every core (OMP threads = cores), as the aggregated decoder does.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from epd_launcher.group import free_port

HOST = "127.0.0.1"
PORT_TAKEN = ("Address already in use", "Errno 98")  # a port picked free was taken before the server bound it


@dataclass(frozen=True)
class ProcSpec:
    name: str  # "decoder", "encoder0", "proxy", "transformers-serve"
    argv: tuple[str, ...]
    cpus: tuple[int, ...] | None  # None: not pinned
    threads: int | None  # OMP_NUM_THREADS; None: inherit
    url: str  # its /health lives here
    env: tuple[tuple[str, str], ...] = ()

    def command(self) -> list[str]:
        """The command line as started: taskset and env prefixes included."""
        env = [f"{k}={v}" for k, v in self.env] + ([f"OMP_NUM_THREADS={self.threads}"] if self.threads else [])
        pin = ["taskset", "-c", ",".join(map(str, self.cpus))] if self.cpus is not None else []
        return [*pin, *(["env", *env] if env else []), *self.argv]

    def shell(self) -> str:
        home = str(Path.home())
        return " ".join(shlex.quote(a).replace(home, "~") for a in self.command())


@dataclass(frozen=True)
class SystemSpec:
    name: str
    procs: tuple[ProcSpec, ...]  # in start order; the last one is what the client talks to
    model: str  # the `model` field requests must carry
    decoder_url: str | None = None  # an EPD decoder's own API (proxy overhead is measured against it)
    openai_extra: dict[str, object] = field(default_factory=dict)  # epd-bench --extra-body
    ignore_eos: bool = True

    @property
    def url(self) -> str:
        return self.procs[-1].url


def core_layout(num_encoders: int, cores: int) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """(decoder cores, one core tuple per encoder) under the split rule; see the module docstring."""
    if num_encoders < cores:
        return (0, *range(num_encoders + 1, cores)), [(1 + i,) for i in range(num_encoders)]
    return (0,), [((1 + i) % cores,) for i in range(num_encoders)]


def _py(module: str, *args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", module, *args)


def _proc(name: str, argv: tuple[str, ...], port: int, cpus: tuple[int, ...] | None, threads: int | None,
          env: tuple[tuple[str, str], ...] = ()) -> ProcSpec:
    return ProcSpec(name, argv, cpus, threads, f"http://{HOST}:{port}", env)


def _proxy(model_name: str, flags: tuple[str, ...]) -> ProcSpec:
    port = free_port()
    argv = _py("epd_launcher.cli", "--host", HOST, "--port", str(port), "--served-model-name", model_name,
               "--log-level", "warning", *flags)
    return _proc("proxy", argv, port, None, None)


def aggregated(model_dir: Path, cores: int, pin: bool, decoder_flags: tuple[str, ...] = (),
               name: str = "aggregated") -> SystemSpec:
    """decoder_flags: more epd-decoder flags (e.g. `--prefix-cache-bytes 0`); name: the system's, in the results."""
    port = free_port()
    dec = _proc("decoder", _py("decoder_service.cli", "--model", str(model_dir), "--host", HOST, "--port",
                               str(port), "--aggregated", "--log-level", "warning", *decoder_flags),
                port, tuple(range(cores)) if pin else None, cores)
    return SystemSpec(name, (dec, _proxy("bench", ("--aggregated", "--decode-servers-urls", dec.url))),
                      "bench", decoder_url=dec.url)


def epd(model_dir: Path, num_encoders: int, cores: int, pin: bool, decoder_all_cores: bool = False,
        decoder_flags: tuple[str, ...] = (), name: str = "", proxy_flags: tuple[str, ...] = ()) -> SystemSpec:
    """As aggregated(); name defaults to epd-<N>enc; proxy_flags: more launcher (proxy) flags."""
    dec_cores, enc_cores = core_layout(num_encoders, cores)
    if decoder_all_cores:  # "overlap" pinning: encoders as in "split", the decoder may use every core
        dec_cores = tuple(range(cores))
    threads_none = max(1, cores // (num_encoders + 1))  # what the launcher gives each worker
    encs = []
    for i, cpus in enumerate(enc_cores):
        port = free_port()
        argv = _py("encoder_service.cli", "--model", str(model_dir), "--host", HOST, "--port", str(port),
                   "--ec-bind", f"tcp://{HOST}:0", "--log-level", "warning")
        encs.append(_proc(f"encoder{i}", argv, port, cpus if pin else None, len(cpus) if pin else threads_none))
    port = free_port()
    dec = _proc("decoder", _py("decoder_service.cli", "--model", str(model_dir), "--host", HOST, "--port",
                               str(port), "--log-level", "warning", *decoder_flags),
                port, dec_cores if pin else None, len(dec_cores) if pin else threads_none)
    proxy = _proxy("bench", ("--encode-servers-urls", *(e.url for e in encs), "--decode-servers-urls", dec.url,
                             *proxy_flags))
    return SystemSpec(name or f"epd-{num_encoders}enc", (*encs, dec, proxy), "bench", decoder_url=dec.url)


def transformers_serve(exe: Path, model_dir: Path, eos_id: int, cores: int, pin: bool) -> SystemSpec:
    """`transformers serve` from its own venv; it rejects ignore_eos, so EOS is banned with logit_bias."""
    port = free_port()
    argv = (str(exe), "serve", str(model_dir), "--host", HOST, "--port", str(port), "--device", "cpu")
    proc = _proc("transformers-serve", argv, port, tuple(range(cores)) if pin else None, cores,
                 env=(("HF_HUB_OFFLINE", "1"),))
    return SystemSpec("transformers-serve", (proc,), str(model_dir), ignore_eos=False,
                      openai_extra={"logit_bias": {str(eos_id): -100.0}})


class Running:
    """A started system: its processes (logs under log_dir) until stop()."""

    def __init__(self, spec: SystemSpec, log_dir: Path):
        self.spec, self.procs = spec, []
        log_dir.mkdir(parents=True, exist_ok=True)
        for p in spec.procs:
            cmd = p.command() if shutil.which("taskset") or p.cpus is None else [*p.argv]
            # EPD_INSECURE: benchmark workers run on loopback without keys (they are secure by default)
            env = {**os.environ, "EPD_INSECURE": "1", **dict(p.env),
                   **({"OMP_NUM_THREADS": str(p.threads)} if p.threads else {})}
            with (log_dir / f"{spec.name}-{p.name}.log").open("wb") as log:
                self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p, proc in zip(self.spec.procs, self.procs, strict=True):
            while not _healthy(p.url):
                if proc.poll() is not None:
                    raise RuntimeError(f"{self.spec.name} {p.name} exited with {proc.returncode} during start-up")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.spec.name} {p.name} not healthy after {timeout} s")
                time.sleep(0.25)

    def pids(self) -> dict[str, int]:
        return {p.name: proc.pid for p, proc in zip(self.spec.procs, self.procs, strict=True)}

    def stop(self, grace: float = 20.0) -> None:
        for proc in reversed(self.procs):  # the front door first
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def resolve_model(name: str) -> Path:
    """The checkpoint dir of a preset or a path, via a child process so this one never imports torch."""
    out = subprocess.run([sys.executable, "-c", "import sys; from epd_models.resolve import resolve_model; "
                          "print(resolve_model(sys.argv[1]))", name], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def log_tail(spec: SystemSpec, log_dir: Path, chars: int = 1500) -> str:
    return "".join((log_dir / f"{spec.name}-{p.name}.log").read_text(errors="replace")[-chars:] for p in spec.procs)


def start_retrying(factories: dict[str, Callable[[], SystemSpec]], log_dir: Path, timeout_s: float,
                   tries: int = 3) -> tuple[dict[str, Running], dict[str, str]]:
    """Start every system at once (start-ups overlap) and wait for each; one whose port was taken between the pick
    and the bind is started again on fresh ports (up to `tries` times in all); one that fails otherwise is left out
    with its log's tail. (running systems, why any was left out); the caller stops the running ones."""
    running = {name: Running(make(), log_dir) for name, make in factories.items()}
    up: dict[str, Running] = {}
    skipped: dict[str, str] = {}
    try:
        for name, make in factories.items():
            for attempt in range(1, tries + 1):
                r = running.pop(name) if attempt == 1 else Running(make(), log_dir)
                running[name] = r
                try:
                    r.wait_healthy(timeout_s)
                    up[name] = running.pop(name)
                    break
                except (RuntimeError, TimeoutError) as exc:
                    tail = log_tail(r.spec, log_dir)
                    running.pop(name).stop()
                    if attempt == tries or not any(s in tail for s in PORT_TAKEN):
                        skipped[name] = f"{exc}: {tail.strip()[-800:]}"
                        break
                    print(f"{name}: a port was taken before it bound; starting again on fresh ports", flush=True)
    except BaseException:  # Ctrl-C during start-up: no server outlives the comparison
        for r in [*running.values(), *up.values()]:
            r.stop()
        raise
    return up, skipped


@contextmanager
def started(factories: dict[str, Callable[[], SystemSpec]], log_dir: Path,
            timeout_s: float = 600.0) -> Iterator[tuple[list[Running], dict[str, str]]]:
    """start_retrying, then every system stopped when the block ends (also on Ctrl-C or SIGTERM)."""
    up, skipped = start_retrying(factories, log_dir, timeout_s)
    print(f"[{time.strftime('%H:%M:%S')}] up: {list(up)}; left out: {list(skipped)}", flush=True)
    try:
        yield list(up.values()), skipped
    finally:
        for r in up.values():
            r.stop()


def rebuilt(specs: list[SystemSpec], build: Callable[[], list[SystemSpec]]) -> dict[str, Callable[[], SystemSpec]]:
    """Factories for `started`: the first try starts `specs`; a retry builds them again (fresh ports)."""
    first = {s.name: s for s in specs}

    def factory(name: str) -> Callable[[], SystemSpec]:
        return lambda: first.pop(name, None) or next(s for s in build() if s.name == name)

    return {name: factory(name) for name in list(first)}


def systems_summary(specs: list[SystemSpec], skipped: dict[str, str]) -> dict[str, Any]:
    """Each started system's processes as run (cores, threads, command line), for the summary and the docs."""
    return {s.name: [{"name": p.name, "cpus": p.cpus, "threads": p.threads, "command": p.shell()} for p in s.procs]
            for s in specs if s.name not in skipped}


class RunStart(NamedTuple):
    """A comparison's start: its clock, its run folder, the load before it, the checkpoint, whether to pin."""

    started: float
    run_dir: Path
    load_before: tuple[float, ...]
    model_dir: Path
    pin: bool

    @classmethod
    def of(cls, args: Any, model_dir: Path | None = None) -> RunStart:
        """From a comparison's --model (or the checkpoint it made), --out-dir and --pinning (split pins only where
        taskset is found)."""
        started, load_before = time.monotonic(), os.getloadavg()
        run_dir = args.out_dir / datetime.now().strftime("%Y%m%d-%H%M%S")
        return cls(started, run_dir, load_before, model_dir or resolve_model(args.model),
                   getattr(args, "pinning", "split") != "none" and shutil.which("taskset") is not None)

    def summary(self, model: str, specs: list[SystemSpec], skipped: dict[str, str], **more: Any) -> dict[str, Any]:
        """The comparison's summary: when, which model, the machine, its load before and after, the pinning, each
        started system's processes as run (cores, threads, command line), then `more`."""
        systems = systems_summary(specs, skipped)
        return {"date": datetime.now().strftime("%Y-%m-%d %H:%M"), "model": model, "model_dir": str(self.model_dir),
                "cores": len(os.sched_getaffinity(0)), "load_before": self.load_before, "load_after": os.getloadavg(),
                "pinning": "split" if self.pin else "none", "skipped": skipped, "systems": systems, **more,
                "wall_s": round(time.monotonic() - self.started, 1)}
