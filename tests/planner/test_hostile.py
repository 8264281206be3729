"""Hostile answers from the proxy and the workers: 500s, garbage, timeouts, NaN, negative or huge values, counters
that go backwards, a wrong /instances. The planner says which endpoint it could not read and keeps the current
counts; it never raises and never scales on garbage (the fake encoder is busy all the time, so a plan made from
garbage would not be 1)."""
from __future__ import annotations

import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd_planner.model import decide
from epd_planner.sample import Sample
from epd_planner.signals import MAX_BODY_BYTES, collect
from tests.planner.fakes import FakeFleet, serve_fleet

ENCODER, DECODER = "/encoder-0/metrics", "/decoder-0/metrics"
OK_ENCODER = "epd_encoder_items_encoded_total 0\nepd_encoder_queue_wait_seconds_sum 0\nepd_encoder_queue_wait_seconds_count 0\n"


def text(body: str, status: int = 200) -> tuple[int, bytes]:
    return status, body.encode()


HOSTILE_WORKER = {
    "500": lambda: text("internal error", 500),
    "not prometheus": lambda: text("}}} {{{ this is not metrics\n"),
    "binary": lambda: (200, bytes(range(256)) * 4),
    "empty": lambda: text(""),
    "NaN busy": lambda: text(f"epd_encoder_run_seconds_total NaN\n{OK_ENCODER}"),
    "infinite busy": lambda: text(f"epd_encoder_run_seconds_total +Inf\n{OK_ENCODER}"),
    "negative busy": lambda: text(f"epd_encoder_run_seconds_total -5\n{OK_ENCODER}"),
    "huge busy": lambda: text(f"epd_encoder_run_seconds_total 1e300\n{OK_ENCODER}"),
    "buckets not cumulative": lambda: text(
        'epd_encoder_run_seconds_total 1\nepd_encoder_items_encoded_total 1\nepd_encoder_queue_wait_seconds_bucket'
        '{le="0.1"} 5\nepd_encoder_queue_wait_seconds_bucket{le="+Inf"} 2\nepd_encoder_queue_wait_seconds_sum 1\n'
        'epd_encoder_queue_wait_seconds_count 2\n'),
    "over the size cap": lambda: (200, b"#" * (MAX_BODY_BYTES + 10)),
}


def read_twice(fleet: FakeFleet, hostile: str | None = None) -> tuple[Sample, Sample]:
    with fleet.client() as client:
        a = collect(fleet.base, "key", client=client)
        if hostile is not None:
            fleet.answers[hostile] = fleet.answers.pop(f"later:{hostile}")
        b = collect(fleet.base, "key", client=client)
    return a, b


def assert_kept(a: Sample, b: Sample, roles: tuple[str, ...], needle: str) -> None:
    d = decide(a, b)
    for role in roles:
        plan = d.plans[role]
        assert not plan.readable and plan.desired == plan.current == 1, plan
        assert needle in plan.reason, plan.reason


@pytest.mark.parametrize("kind", sorted(HOSTILE_WORKER))
def test_a_garbage_encoder_keeps_the_encoder_count_and_says_why(kind: str) -> None:
    fleet = FakeFleet(busy_share=1.0)
    fleet.answers[f"later:{ENCODER}"] = HOSTILE_WORKER[kind]
    a, b = read_twice(fleet, ENCODER)
    (enc,) = b.of("encoder")
    assert enc.error is not None and enc.error.startswith(f"cannot read {fleet.encoder_url}") and not enc.values
    assert_kept(a, b, ("encoder",), f"cannot read {fleet.encoder_url}")
    assert decide(a, b).plans["decoder"].readable  # the others are planned as usual


def test_a_timeout_is_a_reason_not_a_hang() -> None:
    fleet = FakeFleet(busy_share=1.0)

    def timeout() -> tuple[int, bytes]:
        raise httpx.ReadTimeout("read timed out")
    fleet.answers[f"later:{DECODER}"] = timeout
    a, b = read_twice(fleet, DECODER)
    assert_kept(a, b, ("decoder",), "timeout")


def test_a_worker_that_never_answers_is_given_up_after_the_timeout() -> None:
    with serve_fleet(FakeFleet()) as fleet:
        fleet.answers[ENCODER] = fleet.hanging
        started = time.monotonic()
        sample = collect(fleet.base, timeout=0.3)
        took = time.monotonic() - started
    (enc,) = sample.of("encoder")
    assert enc.error is not None and "timeout" in enc.error.lower()
    assert took < 30  # a hang guard: the timeout, not the handler's 60 s, ended the read
    assert sample.of("decoder")[0].error is None


@pytest.mark.parametrize(("first", "later", "says"), [
    (10, 5, "went backwards"),  # a counter that goes backwards (a restart)
    (0, 1000, "busy"),  # an encoder busy longer than the wall time: garbage
])
def test_encoder_run_seconds_that_cannot_be_keep_the_count(first: int, later: int, says: str) -> None:
    fleet = FakeFleet()
    fleet.answers[ENCODER] = lambda: text(f"epd_encoder_run_seconds_total {first}\n{OK_ENCODER}")
    fleet.answers[f"later:{ENCODER}"] = lambda: text(f"epd_encoder_run_seconds_total {later}\n{OK_ENCODER}")
    a, b = read_twice(fleet, ENCODER)
    assert_kept(a, b, ("encoder",), says)


@pytest.mark.parametrize("health", ['{"max_num_seqs": "lots"}', '{"max_num_seqs": 0}', '{"max_num_seqs": true}',
                                    "[]", "not json", '{"max_num_seqs": 1e400}'])
def test_a_decoder_health_without_a_sane_max_num_seqs_keeps_the_decoders(health: str) -> None:
    fleet = FakeFleet()
    fleet.answers["later:/decoder-0/health"] = lambda: text(health)
    a, b = read_twice(fleet, "/decoder-0/health")
    assert_kept(a, b, ("decoder",), f"cannot read {fleet.decoder_url}")


@pytest.mark.parametrize("answer", [lambda: text("no", 500), lambda: text("epd_proxy_time_to_first_token_seconds_sum NaN\n"),
                                    lambda: text("")])
def test_a_garbage_proxy_keeps_every_count(answer: object) -> None:
    fleet = FakeFleet(busy_share=1.0)
    fleet.answers["later:/metrics"] = answer  # type: ignore[assignment]
    a, b = read_twice(fleet, "/metrics")
    assert_kept(a, b, ("encoder", "decoder"), "cannot read")
    assert not decide(a, b).plans["prefill"].readable


@pytest.mark.parametrize("body", ['{"detail": "no"}', "[]", '{"encoders": "x"}', '{"encoders": [{"healthy": true}]}',
                                  '{"encoders": [{"url": "file:///etc/passwd", "healthy": true}]}', "not json",
                                  '{"decoders": [{"url": "http://x", "healthy": "yes"}]}'])
def test_a_wrong_instances_answer_keeps_every_count(body: str) -> None:
    fleet = FakeFleet(busy_share=1.0)
    fleet.answers["later:/instances"] = lambda: text(body, 200 if body != '{"detail": "no"}' else 401)
    a, b = read_twice(fleet, "/instances")
    assert b.error is not None and "/instances" in b.error
    d = decide(a, b)
    assert d.desired == d.current == {"encoder": 1, "prefill": 0, "decoder": 1}  # the last known counts
    assert all(not p.readable for p in d.plans.values())


@pytest.mark.parametrize("change", ["new", "gone"])
def test_a_fleet_that_changed_during_the_window_keeps_that_role(change: str) -> None:
    """A worker that joined (no read at the window's start) or left (its load is not in the rest's) in the window."""
    fleet = FakeFleet(busy_share=1.0)
    without = f'{{"encoders": [], "decoders": [{{"url": "{fleet.decoder_url}", "healthy": true}}]}}'
    reads = []
    with fleet.client() as client:
        for listed in ((False, True) if change == "new" else (True, False)):
            if listed:
                fleet.answers.pop("/instances", None)
            else:
                fleet.answers["/instances"] = lambda: text(without)
            reads.append(collect(fleet.base, client=client))
    a, b = reads
    plan = decide(a, b).plans["encoder"]
    assert not plan.readable and plan.desired == plan.current == b.replicas("encoder")
    assert f"{fleet.encoder_url}: {change} in this window" in plan.reason
    assert decide(a, b).plans["decoder"].readable


def test_an_unreachable_proxy_is_a_report_not_a_crash() -> None:
    sample = collect("http://127.0.0.1:9", timeout=0.5)  # port 9 (discard): nothing listens on loopback
    assert sample.error is not None and "/instances" in sample.error and not sample.workers
    d = decide(sample, collect("http://127.0.0.1:9", timeout=0.5))
    assert all(not p.readable and p.desired == p.current == 0 for p in d.plans.values())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300) | st.sampled_from([f"epd_encoder_run_seconds_total {v}\n" for v in
                                                ("nan", "-0.5", "1e309", "0x10", "1_000", "  7", "7 8 9")]))
def test_any_encoder_answer_is_read_or_refused_never_a_crash(body: str) -> None:
    fleet = FakeFleet()
    fleet.answers[ENCODER] = lambda: text(body)
    with fleet.client() as client:
        sample = collect(fleet.base, client=client)
    (enc,) = sample.of("encoder")
    assert (enc.error is None) == bool(enc.values)
    Sample.from_json(sample.to_json())  # whatever was kept is JSON (no NaN, no Infinity)


def test_an_unhealthy_worker_is_not_read_and_its_role_is_not_planned_smaller() -> None:
    fleet = FakeFleet()  # idle: one encoder would do
    two = (f'{{"encoders": [{{"url": "{fleet.encoder_url}", "healthy": true}}, {{"url": "{fleet.base}/encoder-1", '
           f'"healthy": false, "reason": "down"}}], "decoders": [{{"url": "{fleet.decoder_url}", "healthy": true}}]}}')
    fleet.answers["/instances"] = lambda: text(two)
    with fleet.client() as client:
        a, b = collect(fleet.base, client=client), collect(fleet.base, client=client)
    assert [w.error for w in b.of("encoder")] == [None, None] and not b.of("encoder")[1].values  # listed, not read
    plan = decide(a, b).plans["encoder"]
    assert plan.readable and plan.current == plan.desired == 2 and "1 unhealthy: not planning fewer" in plan.reason
    # every one unhealthy: nothing to read, the count is kept
    fleet.answers["/instances"] = lambda: text(two.replace('"healthy": true}, {"url"', '"healthy": false}, {"url"'))
    with fleet.client() as client:
        c = collect(fleet.base, client=client)
    plan = decide(b, c).plans["encoder"]
    assert not plan.readable and plan.desired == 2 and "none of them is healthy" in plan.reason
