"""Setup work runs on a thread that ends with it (epd_models/torch_threads.py), so the engine thread keeps the
process's only OpenMP team and its workers spin-wait between ops instead of sleeping in the kernel."""
from __future__ import annotations

import contextvars
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from epd_models.torch_threads import on_passing_thread, torch_on_one_thread

REPO = Path(__file__).resolve().parents[2]
_var: contextvars.ContextVar[str] = contextvars.ContextVar("_var", default="unset")


def test_the_work_runs_on_a_thread_of_its_own_that_has_ended_when_it_returns() -> None:
    seen: list[threading.Thread] = []
    _var.set("the caller's")

    def work() -> str:
        seen.append(threading.current_thread())
        return _var.get()

    assert on_passing_thread(work) == "the caller's"  # in the caller's context
    assert seen[0] is not threading.current_thread() and seen[0].name == "epd-setup"
    assert not seen[0].is_alive()


def test_its_exception_is_raised_on_the_calling_thread() -> None:
    def fails() -> None:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        on_passing_thread(fails)


# Another thread does torch work (`setup`: here, the main thread; passing, on_passing_thread; one, an executor thread
# made by torch_on_one_thread), then the "engine" thread runs OPS parallel regions; prints the process's voluntary
# context switches over those OPS. Two CPUs, two threads a team: libgomp throttles its spin-waits only when the
# teams hold more threads than there are CPUs.
SCRIPT = """
import os, sys, threading
from concurrent.futures import ThreadPoolExecutor
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])  # before libgomp counts the CPUs
import torch
from epd_models.torch_threads import on_passing_thread, torch_on_one_thread
torch.set_num_threads(2)
def setup():
    torch.ones(1 << 20).add(1)  # parallel regions on the calling thread (2**20 elements: above torch's grain)
how = sys.argv[1]
pool = ThreadPoolExecutor(1, initializer=torch_on_one_thread)  # lives on, as a decoder's executor does
{"here": setup, "passing": lambda: on_passing_thread(setup), "one": lambda: pool.submit(setup).result()}[how]()
OPS = 2000
def switches():
    total = 0
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/status") as f:
            total += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    return total
def engine():
    x = torch.ones(1 << 20)  # the engine thread's own team, before counting
    before = switches()
    for _ in range(OPS):
        x.add(1)
    print(switches() - before, OPS)
t = threading.Thread(target=engine)
t.start()
t.join()
"""


def switches_per_op(setup: str) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, setup], env=env, capture_output=True, text=True, timeout=300,
                         check=True).stdout.split()
    return int(out[0]) / int(out[1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two teams of two throttle only with two CPUs")
def test_setup_on_a_passing_thread_leaves_the_engine_threads_workers_spinning() -> None:
    # left behind, the setup thread's team throttles the engine thread's: its worker sleeps at about every op
    assert switches_per_op("here") > 0.5
    # on a passing thread it goes with the thread: the worker sleeps only when the machine takes its CPU away
    assert switches_per_op("passing") < 0.25
    # a thread that lives on, made to run torch alone, starts no team
    assert switches_per_op("one") < 0.25


def test_a_thread_made_to_run_torch_alone_runs_it_alone_and_the_others_keep_their_count() -> None:
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    with ThreadPoolExecutor(1, initializer=torch_on_one_thread) as pool:
        assert pool.submit(torch.get_num_threads).result() == 1
    with ThreadPoolExecutor(1) as pool:  # a new thread still starts with the process's count
        assert pool.submit(torch.get_num_threads).result() == before
    assert torch.get_num_threads() == before
