"""Property-based fuzzing of the proxy's public API against a real stack (proxy, encoder, decoder processes).

Requests come from the proxy's own OpenAPI schema (Schemathesis strategies, positive and negative) and from
hand-written hostile variants (huge / negative / NaN numbers, deep nesting, long strings, wrong types, unknown
and unimplemented fields, duplicate keys, broken media). For each: no 5xx, no hang; every 4xx is an OpenAI error
body; every 200 (and every stream chunk) validates against the official OpenAI schema. After each run every
process is alive and an ordinary request gets the right answer. Failures are collected per class, not shrunk.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.hostile.fuzz_bodies import IMAGES, MAX_TOKENS, base_body, hostile_request, tame, with_raw
from tests.hostile.stack import HostileStack, run_victims, victims_throughout
from tests.openai_schema import validator

CHAT = "/v1/chat/completions"
REQUEST_TIMEOUT = 60.0  # an answer slower than this is a hang
# a whole fuzz run (bodies up to ~2 MB, lists of 50k items) may raise no process's peak RSS by more than this;
# measured here: proxy +141 MiB, decoder +21 MiB, encoder +1 MiB
PEAK_RSS_GROWTH_BOUND = 384 << 20
FUZZ = settings(derandomize=True, database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck))


# --- what a good answer looks like ----------------------------------------------------------------------


def schema_errors(name: str, obj: Any) -> list[str]:
    return [e.message[:200] for e in validator(name).iter_errors(obj)][:2]


def check_error_body(status: int, text: str) -> str | None:
    try:
        body = json.loads(text)
    except ValueError:
        return f"{status} body is not JSON: {text[:120]!r}"
    errors = schema_errors("ErrorResponse", body)
    return f"{status} body is not an OpenAI error: {errors}" if errors else None


def check_stream(resp: httpx.Response) -> str | None:
    done = False
    for line in resp.iter_lines():
        if not line.startswith("data: "):
            continue
        if done:
            return "data after [DONE]"
        if line == "data: [DONE]":
            done = True
            continue
        try:
            chunk = json.loads(line[6:])
        except ValueError:
            return f"stream event is not JSON: {line[:120]!r}"
        if isinstance(chunk, dict) and "error" in chunk:  # a request's own error event is fine if it is a client error, not a server fault
            err = chunk["error"]
            if schema_errors("ErrorResponse", chunk) or err.get("type") != "invalid_request_error":
                return f"stream error event {err.get('type')}/{err.get('code')}: {str(err.get('message'))[:120]}"
        elif errors := schema_errors("CreateChatCompletionStreamResponse", chunk):
            return f"stream chunk invalid: {errors}"
    return None if done else "stream ended without [DONE]"


def exchange(client: httpx.Client, method: str, path: str, content: bytes | None, headers: dict[str, str]) -> Answer:
    """Send one request: its status (0: none), its error code, and the class of what went wrong, or None."""
    try:
        with client.stream(method, path, content=content, headers=headers) as resp:
            if resp.status_code == 200 and resp.headers.get("content-type", "").startswith("text/event-stream"):
                return Answer(200, "", check_stream(resp))
            text = resp.read().decode(errors="replace")
    except httpx.TimeoutException:
        return Answer(0, "", f"no answer within {REQUEST_TIMEOUT}s")
    except httpx.HTTPError as exc:
        return Answer(0, "", f"transport error {type(exc).__name__}")
    code = _error_code(text).split(":")[0] if resp.status_code >= 400 else ""
    return Answer(resp.status_code, code, check_answer(method, resp.status_code, text))


def check_answer(method: str, status: int, text: str) -> str | None:
    if status >= 500:
        return f"{status} {_error_code(text)}"
    if status >= 400:
        return check_error_body(status, text)
    if method == "GET" or status != 200:
        return None
    try:
        errors = schema_errors("CreateChatCompletionResponse", json.loads(text))
    except ValueError:
        return f"200 body is not JSON: {text[:120]!r}"
    return f"200 not a ChatCompletion: {errors}" if errors else None


def _error_code(text: str) -> str:
    try:
        err = json.loads(text)["error"]
        return f"{err.get('code')}: {str(err.get('message'))[:100]}"
    except (ValueError, KeyError, TypeError):
        return f"(no error body) {text[:100]!r}"


@dataclass(frozen=True)
class Answer:
    status: int  # 0: no HTTP answer
    code: str  # the error's code, for a 4xx/5xx
    problem: str | None  # what is wrong with it, None if nothing


@dataclass
class Findings:
    """Failures grouped by class, with the first request of each; stops the run once a process is gone."""

    stack: HostileStack
    classes: dict[str, str] = field(default_factory=dict)  # class -> first request (truncated)
    counts: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)  # "class status code" -> requests
    examples: dict[str, str] = field(default_factory=dict)  # "class status code" -> first request

    @property
    def stopped(self) -> bool:
        return bool(self.stack.dead()) or self.counts["hang"] >= 3

    def record(self, what: str, answer: Answer, request: bytes | None) -> None:
        problem, shown = answer.problem, (request or b"")[:300].decode(errors="replace")
        outcome = f"{what} {answer.status} {answer.code}".rstrip()
        self.statuses[outcome] += 1
        self.examples.setdefault(outcome, shown)
        if problem is None:
            return
        dead = self.stack.dead()
        key = f"{what}: {problem}" + (f" [dead: {', '.join(dead)}]" if dead else "")
        self.counts[key] += 1
        self.counts["hang"] += problem.startswith("no answer")
        self.classes.setdefault(key, shown)

    def report(self) -> str:
        lines = [f"{n}x {key}\n    e.g. {self.classes[key]!r}" for key, n in self.counts.items() if key != "hang"]
        sent = "".join(f"\n  {n}x {k}  e.g. {self.examples[k][:160]!r}" for k, n in sorted(self.statuses.items()))
        return f"{len(lines)} failure class(es):\n" + "\n".join(lines) + f"\nanswers:{sent}"

    def assert_clean_and_healthy(self) -> None:
        dead = self.stack.dead()
        logs = {role: self.stack.log_tail(role, 1500) for role in dead}
        assert not dead, f"{self.report()}\ndead: {dead}\n{logs}"
        assert self.stack.answers_red() == "red", self.report()
        assert not self.classes, self.report()


def assert_memory_bounded(stack: HostileStack, peak_before: dict[str, int]) -> None:
    growth = {role: peak - peak_before[role] for role, peak in stack.peak_rss().items()}
    assert all(g <= PEAK_RSS_GROWTH_BOUND for g in growth.values()), f"peak RSS growth (bytes): {growth}"


def run_beside_victims(stack: HostileStack, findings: Findings, peak_before: dict[str, int],
                       fuzz: Callable[[], None]) -> None:
    """Run the fuzz while ordinary users stream again and again; then: no finding, every process alive and
    right, the users' streams unchanged, memory within its bound."""
    with victims_throughout(stack.base_url) as victims:
        fuzz()
    findings.assert_clean_and_healthy()
    victims.assert_undisturbed()
    assert_memory_bounded(stack, peak_before)


@pytest.fixture(scope="module")
def client(stack: HostileStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.base_url, timeout=REQUEST_TIMEOUT) as c:
        yield c


def send_chat(findings: Findings, client: httpx.Client, what: str, raw: bytes,
              content_type: str = "application/json") -> None:
    if not findings.stopped:
        findings.record(what, exchange(client, "POST", CHAT, raw, {"content-type": content_type}), raw)


# --- the tests ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_operation(client: httpx.Client) -> Any:
    """The proxy's chat-completions operation, from the OpenAPI document it serves."""
    doc = client.get("/openapi.json").json()
    return schemathesis.openapi.from_dict(doc)[CHAT]["POST"]


@pytest.mark.e2e
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_requests_generated_from_the_openapi_schema_never_get_a_5xx(
        stack: HostileStack, client: httpx.Client, chat_operation: Any, mode: GenerationMode) -> None:
    findings, peak_before = Findings(stack), stack.peak_rss()

    @settings(FUZZ, max_examples=100)
    @given(case=chat_operation.as_strategy(mode), demo=st.sampled_from([True] * 9 + [False]),
           cap=st.integers(1, MAX_TOKENS), image=st.none() | st.sampled_from(IMAGES))
    def fuzz(case: Any, demo: bool, cap: int, image: str | None) -> None:
        body = tame(case.body, demo, cap, image)
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        send_chat(findings, client, mode.value, raw, case.media_type or "application/json")

    run_beside_victims(stack, findings, peak_before, fuzz)


@pytest.mark.e2e
def test_hostile_variants_get_their_own_4xx_and_hurt_no_one(stack: HostileStack, client: httpx.Client) -> None:
    findings, peak_before = Findings(stack), stack.peak_rss()

    @settings(FUZZ, max_examples=200)
    @given(request=hostile_request())
    def fuzz(request: tuple[str, bytes]) -> None:
        kind, raw = request
        send_chat(findings, client, kind, raw)

    run_beside_victims(stack, findings, peak_before, fuzz)


@pytest.mark.e2e
@pytest.mark.parametrize("method,path,headers", [
    ("GET", "/v1/models?limit=-1&after=%00", {}),
    ("GET", "/health?" + "a=1&" * 2000, {}),
    ("POST", "/v1/models", {"content-type": "application/json"}),
    ("DELETE", "/health", {}),
    ("GET", "/v1/chat/completions", {}),
    ("GET", "/v1/models/../../health", {}),
    ("GET", "/v1/%00", {}),
    ("POST", CHAT, {"content-type": "text/plain"}),
    ("POST", CHAT, {"content-type": "application/json; charset=utf-16"}),
    ("POST", CHAT, {"content-type": "application/json", "content-encoding": "gzip"}),
    ("POST", CHAT, {"content-type": "application/json", "x-request-id": "r" * 8000}),
    ("POST", CHAT, {"content-type": "application/json", "authorization": "Bearer " + "k" * 4000}),
])
def test_odd_methods_paths_and_headers_get_an_openai_error(stack: HostileStack, client: httpx.Client, method: str,
                                                           path: str, headers: dict[str, str]) -> None:
    findings = Findings(stack)
    raw = json.dumps(base_body(stream=False, image=False)).encode() if method == "POST" else None
    findings.record(f"{method} {path[:40]}", exchange(client, method, path, raw, headers), raw)
    findings.assert_clean_and_healthy()


@pytest.mark.e2e
def test_ordinary_users_stream_the_same_tokens_beside_a_hostile_request(stack: HostileStack,
                                                                       client: httpx.Client) -> None:
    """The harness itself: two ordinary streams give their solo tokens while a bad request is answered."""
    bad = with_raw(base_body(stream=False, image=True), "temperature", "-1")
    run = run_victims(stack.base_url, n=2, during=lambda: client.post(CHAT, content=bad).status_code)
    assert run.during == 400
    run.assert_undisturbed()
    assert len(set(run.solo_texts)) == 2  # the two users asked about different pictures


# --- the checker itself (no stack) ----------------------------------------------------------------------


def fake_server(status: int, body: bytes, content_type: str = "application/json") -> httpx.Client:
    return httpx.Client(base_url="http://proxy", transport=httpx.MockTransport(
        lambda request: httpx.Response(status, content=body, headers={"content-type": content_type})))


def sse_body(*events: Any) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


CHUNK = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "demo",
         "choices": [{"index": 0, "delta": {"content": "red"}, "finish_reason": None}]}
OPENAI_400 = {"error": {"message": "bad", "type": "invalid_request_error", "param": "seed", "code": "invalid_value"}}
SERVER_ERROR = {"error": {"message": "x", "type": "server_error", "param": None, "code": "stream_interrupted"}}


@pytest.mark.parametrize("status,body,content_type,flagged", [
    (400, json.dumps(OPENAI_400).encode(), "application/json", False),
    (200, sse_body(CHUNK, b"[DONE]"), "text/event-stream", False),
    (502, json.dumps(SERVER_ERROR).encode(), "application/json", True),
    (500, b"Internal Server Error", "text/plain", True),
    (422, b'{"detail": [{"msg": "field required"}]}', "application/json", True),  # FastAPI's own body
    (413, b"", "text/plain", True),
    (200, b'{"id": "c", "choices": []}', "application/json", True),  # not a ChatCompletion
    (200, sse_body(CHUNK), "text/event-stream", True),  # no [DONE]
    (200, sse_body(CHUNK, SERVER_ERROR, b"[DONE]"), "text/event-stream", True),  # another user's stream cut
    (200, sse_body({"choices": "x"}, b"[DONE]"), "text/event-stream", True),
    (200, sse_body(b"{not json", b"[DONE]"), "text/event-stream", True),
])
def test_the_checker_flags_server_faults_bare_errors_and_invalid_answers(
        status: int, body: bytes, content_type: str, flagged: bool) -> None:
    with fake_server(status, body, content_type) as client:
        answer = exchange(client, "POST", CHAT, b"{}", {"content-type": "application/json"})
    assert answer.status == status and (answer.problem is not None) == flagged, answer
