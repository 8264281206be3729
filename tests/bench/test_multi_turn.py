"""epd-bench's multi-turn and shared-prefix workloads against the fake streaming server: history, interleaving,
per-turn metrics, the shared system message."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from epd_bench.backends import RequestInput, RequestOutput, _decoder_body
from epd_bench.conversations import MultiTurnSpec, build_conversations
from epd_bench.dataset import DatasetSpec, SampleRequest, build_dataset
from epd_bench.metrics import turn_means
from epd_bench.serve import run
from tests.bench.conftest import FakeBehaviour, FakeServer


def multi_turn(fake: FakeServer, *flags: str) -> dict[str, Any]:
    return run(["--base-url", fake.url, "--disable-tqdm", "--dataset", "multi-turn", "--random-input-len", "5",
                "--random-output-len", "3", "--image-size", "16", *flags])


def _answer(request_number: int) -> str:
    """What the tagging fake server streams to its n-th request (1-based) for max_tokens 3."""
    return "".join(f"r{request_number}t{i} " for i in range(3))


@pytest.mark.parametrize("fake_server", [FakeBehaviour(tag_answers=True)], indirect=True)
def test_each_turn_resends_the_history_with_the_actual_answers(fake_server: FakeServer) -> None:
    r = multi_turn(fake_server, "--conversations", "3", "--turns", "3", "--max-concurrency", "2")
    assert r["completed"] == 9 and r["turns"] == [1, 2, 3] * 3 and r["dataset_name"] == "multi-turn"
    bodies = fake_server.bodies
    for body in bodies:
        messages = body["messages"]
        turn = (len(messages) + 1) // 2
        first = messages[0]["content"]
        assert [p["type"] for p in first] == ["image_url", "text"]  # the images stay in the first turn
        assert all(m["content"][-1]["type"] == "text" and len(m["content"]) == 1 for m in messages[2::2])
        if turn > 1:  # the turn before is a request whose messages are this one's but the last two
            before = next(i for i, b in enumerate(bodies) if b["messages"] == messages[:-2])
            assert messages[-2] == {"role": "assistant", "content": _answer(before + 1)}
    assert len({b["messages"][0]["content"][0]["image_url"]["url"] for b in bodies}) == 3  # an image each


@pytest.mark.parametrize("fake_server", [FakeBehaviour(ttft_s=0.1)], indirect=True)
def test_conversations_interleave_up_to_the_concurrency(fake_server: FakeServer) -> None:
    r = multi_turn(fake_server, "--conversations", "3", "--turns", "2", "--max-concurrency", "2")
    assert fake_server.max_in_flight == 2
    # two conversations start together and each sends turn 2 as soon as turn 1 is answered; the third waits for a
    # conversation to finish
    assert [len(b["messages"]) for b in fake_server.bodies] == [1, 1, 3, 3, 1, 3]
    for c in range(3):
        first, second = 2 * c, 2 * c + 1
        assert r["start_times"][second] >= r["start_times"][first] + r["e2els"][first] - 1e-3


def test_per_turn_metrics(fake_server: FakeServer) -> None:
    """The fake server reports 10 cached tokens per message before the last (and 10 prompt tokens per message)."""
    r = multi_turn(fake_server, "--conversations", "2", "--turns", "3", "--images-per-request", "0",
                   "--system-prompt-len", "4")
    # turn k: system + 2(k-1) history messages + the question
    assert r["cached_tokens"] == [10, 30, 50] * 2 and r["input_lens"] == [20, 40, 60] * 2
    assert r["mean_cached_tokens_turn2plus"] == pytest.approx(40.0)
    assert r["mean_prompt_tokens_turn2plus"] == pytest.approx(50.0)
    ttft = {k: [t * 1000 for t, turn in zip(r["ttfts"], r["turns"], strict=True) if turn in k] for k in ((1,), (2, 3))}
    assert r["mean_ttft_ms_turn1"] == pytest.approx(sum(ttft[(1,)]) / 2)
    assert r["mean_ttft_ms_turn2plus"] == pytest.approx(sum(ttft[(2, 3)]) / 4)
    assert r["mean_cached_tokens"] == pytest.approx(30.0)


def test_turn_means_from_canned_outputs() -> None:
    def out(turn: int, ttft: float, cached: int, ok: bool = True) -> RequestOutput:
        return RequestOutput(success=ok, ttft=ttft, turn=turn, cached_tokens=cached, prompt_tokens=100 * turn)

    ok = [out(1, 1.0, 0), out(2, 0.2, 80), out(3, 0.4, 160), out(1, 3.0, 16)]
    assert turn_means(ok) == {"mean_ttft_ms_turn1": pytest.approx(2000.0), "mean_ttft_ms_turn2plus":
                              pytest.approx(300.0), "mean_cached_tokens_turn2plus": 120.0,
                              "mean_prompt_tokens_turn2plus": 250.0}
    assert turn_means([out(1, 1.0, 0)])["mean_ttft_ms_turn2plus"] is None  # single-turn: no later turns


@pytest.mark.parametrize("fake_server", [FakeBehaviour(fail_every=2)], indirect=True)
def test_a_failed_turn_ends_its_conversation(fake_server: FakeServer) -> None:
    r = multi_turn(fake_server, "--conversations", "1", "--turns", "3")
    assert len(fake_server.bodies) == 2  # turn 2 failed: turn 3 has no answer to build on and is never sent
    assert r["successes"] == [True, False, False] and r["turns"] == [1, 2, 3]
    assert "HTTP 500" in r["errors"][1] and r["errors"][2] == "not sent: turn 2 failed"


def test_shared_prefix_requests_share_the_system_message(fake_server: FakeServer) -> None:
    r = run(["--base-url", fake_server.url, "--disable-tqdm", "--dataset", "shared-prefix", "--system-prompt-len", "12",
             "--num-prompts", "4", "--random-input-len", "3", "--random-output-len", "2", "--num-warmups", "1"])
    warm, *measured = fake_server.bodies
    system = measured[0]["messages"][0]
    assert system["role"] == "system" and len(system["content"].split()) == 12
    assert all(b["messages"][0] == system for b in measured)
    assert warm["messages"][0] != system  # a warm-up leaves nothing a measured request could reuse
    questions = [b["messages"][1]["content"] for b in measured]
    assert len({q[0]["text"] for q in questions}) == 4 and all(len(q) == 1 for q in questions)  # no images
    assert r["dataset"]["system_prompt_len"] == 12 and r["turns"] == [1] * 4 and r["mean_ttft_ms_turn2plus"] is None


def test_the_workloads_are_seeded() -> None:
    spec = MultiTurnSpec(DatasetSpec(input_len=6, image_width=8, image_height=8, system_prompt_len=5, seed=1), 3, 2)
    assert build_conversations(spec, 1) == build_conversations(spec, 1)
    other = build_conversations(replace(spec, base=replace(spec.base, seed=2)))[1]
    assert other[0].turns[0].prompt != build_conversations(spec)[1][0].turns[0].prompt
    warm, convs = build_conversations(spec, 2)
    assert len(warm) == 2 and all(len(c.turns) == 1 for c in warm) and [len(c.turns) for c in convs] == [2] * 3
    assert warm[0].turns[0].system != convs[0].turns[0].system == convs[2].turns[1].system
    # a system prompt is drawn on its own: the rest of the random dataset stays what it was
    plain = DatasetSpec(num_prompts=4, input_len=6, image_width=8, image_height=8, seed=1)
    with_system = build_dataset(replace(plain, system_prompt_len=7))[1]
    assert [replace(s, system="") for s in with_system] == build_dataset(plain)[1]


def test_decoder_backend_sends_the_history_with_images_inline() -> None:
    spec = MultiTurnSpec(DatasetSpec(input_len=3, image_width=8, image_height=8, images_per_request=2,
                                     system_prompt_len=2), 1, 2)
    conv = build_conversations(spec)[1][0]
    inp = RequestInput(url="u", model="m", sample=conv.turns[1], history=conv.history(["an answer"]))
    body = _decoder_body(inp)
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "user"] and len(body["images"]) == 2
    assert body["messages"][1]["content"][:2] == [{"type": "image"}, {"type": "image"}]
    assert body["messages"][2]["content"] == "an answer"


@pytest.mark.parametrize("fake_server", [FakeBehaviour(usage=True)], indirect=True)
def test_conversations_default_to_the_prompt_count(fake_server: FakeServer) -> None:
    r = multi_turn(fake_server, "--num-prompts", "5", "--turns", "2", "--images-per-request", "0")
    assert r["dataset"]["conversations"] == 3 and r["num_prompts"] == 6 and len(r["turns"]) == 6


@pytest.mark.parametrize("bad", [["--dataset", "shared-prefix", "--system-prompt-len", "0"], ["--turns", "0"],
                                 ["--conversations", "-1"], ["--dataset", "chat"]])
def test_bad_workload_flags_are_usage_errors(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run(["--base-url", "http://127.0.0.1:9", *bad])
    assert exc.value.code == 2


def test_sample_request_without_system_sends_none() -> None:
    from epd_bench.backends import chat_messages

    sample = SampleRequest(prompt="hi", images=(), image_ids=(), output_len=1)
    assert [m["role"] for m in chat_messages(RequestInput(url="u", model="m", sample=sample))] == ["user"]
