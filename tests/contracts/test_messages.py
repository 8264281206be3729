"""The HTTP messages between processes: round trips, and every refusal names the field it is about."""
from __future__ import annotations

import msgspec
import pytest

from epd_contracts.encode import EncodeItem, EncodeRequest
from epd_contracts.generate import Event, GenerateRequest, ImageRef, Usage
from epd_contracts.limits import MAX_PARTS_PER_MESSAGE
from epd_contracts.sampling import SamplingParams
from epd_contracts.validation import ContractError, decode_json

USER = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]


def param_of(body: bytes, type_: type) -> str | None:
    with pytest.raises(ContractError) as err:
        decode_json(body, type_)
    return err.value.param


def test_generate_request_round_trips() -> None:
    req = GenerateRequest(messages=USER, images=[ImageRef(mm_hash="a" * 64, source="tcp://h:1", pending=True)],
                          sampling=SamplingParams(max_tokens=5, stop=("\n",)))
    assert decode_json(msgspec.json.encode(req), GenerateRequest) == req


@pytest.mark.parametrize("body,param", [
    (b'{"messages": [], "sampling": {}}', "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "sampling": {"stop": ["a", ""]}}', "sampling.stop.1"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "sampling": {"top_p": -Infinity}}', "sampling.top_p"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "images": [{"mm_hash": ""}]}', "images.0.mm_hash"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "images": [{"mm_hash": "a", "bytes": 1}]}', "images.0.bytes"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": [' + b",".join([b"{}"] * (MAX_PARTS_PER_MESSAGE + 1)) + b"]}]}",
     "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "cache_salt": "' + b"s" * 257 + b'"}', "cache_salt"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "prefix_keys": ["' + b"k" * 65 + b'"]}', "prefix_keys.0"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "prefix_keys": [""]}', "prefix_keys.0"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "prefix_keys": [' + b",".join([b'"k"'] * 100_000) + b"]}",
     "prefix_keys"),
    (b"{not json", None),
])
def test_generate_request_refusals_name_the_field(body: bytes, param: str | None) -> None:
    assert param_of(body, GenerateRequest) == param


def test_encode_request_refusals_name_the_item() -> None:
    assert param_of(b'{"items": [{"data": "eA=="}, {"mm_hash": "a"}]}', EncodeRequest) == "items.1.data"
    assert decode_json(b'{"items": [{"data": "eA=="}]}', EncodeRequest) == EncodeRequest(items=[EncodeItem(data="eA==")])


def test_events_leave_out_what_they_do_not_carry() -> None:
    done = Event(type="done", finish_reason="stop", usage=Usage(prompt_tokens=2, completion_tokens=1, total_tokens=3))
    assert msgspec.json.encode(Event(type="delta", text="x")) == b'{"type":"delta","text":"x"}'
    assert msgspec.json.decode(msgspec.json.encode(done), type=Event) == done



def test_a_body_nested_past_the_decoders_recursion_is_a_contract_error() -> None:
    # messages are free-form JSON objects, the one place a body can nest without a type to stop it
    body = b'{"messages": [{"role": "user", "content": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}"
    with pytest.raises(ContractError, match="nested too deeply"):
        decode_json(body, GenerateRequest)
