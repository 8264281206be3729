"""The wall time of each decode step by phase, taken from outside the engine (no instrumentation in it).

`StepClock(engine)` wraps methods of the live engine in this process (instance attributes, so nothing else
changes) and hooks the LM's modules; it runs against any revision whose engine has `step`, `scheduler.schedule`,
`runner.run` (or `model_runner.run`) and `postprocess`, and whose `LanguageHalf.module` has `language_model` and
`lm_head`: today's engine and the base commit's alike (epd_bench/decoder.py runs both). Phases are exclusive
(a phase's time leaves out the phases called inside it), per step, on the engine thread:
- forward: inside `lm.module.language_model(...)` and `lm.module.lm_head(...)` (forward hooks);
- schedule: inside `scheduler.schedule()`;
- runner: inside the runner's `run()` outside the forward (token ids, positions, masks, block tables);
- postprocess: inside `postprocess()` outside read_back: choosing each row's token, and everything per row;
- read_back: inside the read-back functions the engine module calls (one transfer of every row's token);
- other: the rest of `step()`.
With `per_row_hooks(True)` (a second run: these hooks cost about 1 us a call, and inflate what they split)
postprocess is split further: sampling (what is left of it: choosing tokens on the device, the loop over rows),
accept (`_accept()` per row: sampler accept, stop checks, metrics), detokenize (the detokenizer's `add`) and
events (`Job.emit`: handing an event to the request's asyncio loop).
A step counts as a decode step when every running sequence is decoding at its start (none waiting, none
prefilling: each sequence has a token to feed back) and the step's forwards ran exactly one token per running row.
This file imports nothing of the project, so it loads the same way beside any revision.
"""
from __future__ import annotations

import functools
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

PHASES = ("schedule", "runner", "forward", "postprocess", "read_back", "other")
ROW_PHASES = ("sampling", "accept", "detokenize", "events")  # postprocess, split by the per-row hooks
_DETOK_METHODS = ("add", "add_decoded", "decode_windows")


class StepClock:
    def __init__(self, engine: Any):
        self.engine, self.enabled = engine, False
        self.steps: list[tuple[int, dict[str, float]]] = []  # (rows, phase -> seconds) of each decode step
        self._stack: list[list[Any]] = []  # [phase, start, seconds of children]
        self._times: dict[str, float] = {}
        self._tokens = 0  # tokens the step's forwards ran
        self._thread: int | None = None
        self._undo: list[Callable[[], None]] = []  # removes the per-row hooks
        self._install()

    def _install(self) -> None:
        """The hooks called a few times per step (their cost per row is negligible)."""
        e = self.engine
        runner = getattr(e, "runner", None) or e.model_runner
        e.step = self._step(e.step)
        e.scheduler.schedule = self._timed("schedule", e.scheduler.schedule)
        runner.run = self._timed("runner", runner.run)
        e.postprocess = self._timed("postprocess", e.postprocess)
        for engine_module in _step_modules(e):  # the read-back functions as the engine's step calls them
            for name, fn in list(vars(engine_module).items()):
                if callable(fn) and getattr(fn, "__module__", "").endswith("readback"):
                    setattr(engine_module, name, self._timed("read_back", fn))
        module = e.lm.module
        for part in (module.language_model, module.lm_head):
            part.register_forward_pre_hook(self._forward_pre, with_kwargs=True)
            part.register_forward_hook(self._forward_post)

    def per_row_hooks(self, on: bool) -> None:
        """Hooks called for each row (about 1 us each: they inflate what they split): `_accept`, the detokenizer and
        `Job.emit` of every job in this process (a bench process: nothing else runs in it)."""
        for undo in self._undo:
            undo()
        self._undo = []
        if not on:
            return
        if hasattr(self.engine, "_accept"):  # an engine whose rows are accepted by a method of its own
            self._patch(self.engine, "_accept", "accept", instance=True)
        else:  # today's: engine/postprocess.py's `accept`, called by name in that module
            post = sys.modules[type(self.engine).__module__.rsplit(".", 1)[0] + ".engine.postprocess"]
            self._patch(post, "accept", "accept")
        for mod in list(sys.modules.values()):
            name = getattr(mod, "__name__", "")
            if name.endswith(".detokenizer") and hasattr(mod, "IncrementalDetokenizer"):
                for meth in _DETOK_METHODS:
                    if meth in vars(mod.IncrementalDetokenizer):
                        self._patch(mod.IncrementalDetokenizer, meth, "detokenize")
            if name.endswith("sequence") and hasattr(mod, "Job"):
                self._patch(mod.Job, "emit", "events")

    def _patch(self, owner: Any, attr: str, phase: str, instance: bool = False) -> None:
        original = getattr(owner, attr) if instance else vars(owner)[attr]
        setattr(owner, attr, self._timed(phase, original))
        self._undo.append(lambda: delattr(owner, attr) if instance else setattr(owner, attr, original))

    def _on_engine_thread(self) -> bool:
        return self._thread == threading.get_ident()

    def _push(self, phase: str) -> None:
        self._stack.append([phase, time.perf_counter(), 0.0])

    def _pop(self) -> None:
        phase, start, children = self._stack.pop()
        spent = time.perf_counter() - start
        self._times[phase] = self._times.get(phase, 0.0) + spent - children
        if self._stack:
            self._stack[-1][2] += spent

    def _timed(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self._on_engine_thread() or not self._stack:
                return fn(*args, **kwargs)
            self._push(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self._pop()
        return wrapper

    def _forward_pre(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._on_engine_thread() and self._stack:
            if module is self.engine.lm.module.language_model:
                x = kwargs.get("inputs_embeds", kwargs.get("input_ids", args[0] if args else None))
                self._tokens += int(x.shape[0] * x.shape[1]) if x is not None and x.dim() >= 2 else 0
            self._push("forward")

    def _forward_post(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        if self._on_engine_thread() and self._stack and self._stack[-1][0] == "forward":
            self._pop()

    def _step(self, step: Callable[[], None]) -> Callable[[], None]:
        @functools.wraps(step)
        def wrapper() -> None:
            self._thread = threading.get_ident()
            if not self.enabled:
                return step()
            rows, decoding = self._decoding_rows()
            self._times, self._tokens, self._stack = {}, 0, []
            self._push("other")
            try:
                step()
            finally:
                self._pop()
                self._stack = []
            if decoding and rows and self._tokens == rows:
                self.steps.append((rows, self._times))
        return wrapper

    def _decoding_rows(self) -> tuple[int, bool]:
        """(running sequences, whether all of them decode this step and nothing waits)."""
        e = self.engine
        running = e.scheduler.running
        waiting = len(e.scheduler.waiting) + e._jobs.qsize()
        preempted = getattr(e.scheduler, "num_preempted", 0)
        all_fed = all(getattr(seq, "pending", 0) is not None for seq in running.values())
        return len(running), waiting == 0 and not preempted and all_fed

    def report(self, rows: int, phases: tuple[str, ...] = PHASES) -> dict[str, Any] | None:
        """Microseconds per row of the decode steps with exactly `rows` rows: host (step minus forward), by phase.

        Each value is the median over those steps (so the phases need not add up to the host total exactly)."""
        steps = [t for n, t in self.steps if n == rows]
        if not steps:
            return None

        def per_row(values: list[float]) -> float:
            return round(statistics.median(values) * 1e6 / rows, 1)
        host = [sum(t.values()) - t.get("forward", 0.0) for t in steps]
        return {"steps": len(steps), "host_us_per_row": per_row(host),
                "step_us_per_row": per_row([sum(t.values()) for t in steps]),
                "phases_us_per_row": {p: per_row([t.get(p, 0.0) for t in steps]) for p in phases}}


def _step_modules(engine: Any) -> list[Any]:
    """The modules whose functions an engine's step calls by name: those of its classes (the service's Engine and,
    today, the LLMEngine under it) and, where it has one, the engine's postprocess module."""
    names = {cls.__module__ for cls in type(engine).__mro__ if cls.__module__ != "builtins"}
    names |= {name for name in sys.modules if name.endswith("engine.postprocess")}
    return [sys.modules[name] for name in sorted(names)]
