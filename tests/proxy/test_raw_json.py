"""Bytes that already are JSON (harness bodies, the body sent to the engine, vLLM's prompt-id
list) go into captures verbatim instead of being parsed and encoded again. These tests pin that
the shortcut never changes what a capture says, and that anything unusual takes the normal path."""

import json
import uuid

import orjson
import pytest

from polar_core.schema import CallRecord
from polar_proxy import jsonutil
from polar_proxy.capture import encode_record
from polar_proxy.engines import TokenData, get_engine
from polar_proxy.engines.vllm import lift_prompt_ids

BIG = 2**70 + 3


@pytest.mark.parametrize("doc", [
    {"id": "a", "prompt_token_ids": [5, 6, 7], "choices": []},      # in the middle
    {"prompt_token_ids": [5, 6, 7], "id": "a"},                    # first
    {"id": "a", "choices": [{"index": 0}], "prompt_token_ids": [9]},  # last
    {"prompt_token_ids": [1]},                                     # alone
    {"id": "a", "prompt_token_ids": [], "x": 1},                   # empty
])
def test_lift_takes_the_list_out_and_leaves_valid_json(doc):
    payload = orjson.dumps(doc)
    rest, ids = lift_prompt_ids(payload)
    assert ids is not None and ids.json == orjson.dumps(doc["prompt_token_ids"])
    assert len(ids) == len(doc["prompt_token_ids"]) and list(ids) == doc["prompt_token_ids"]
    assert orjson.loads(rest) == {k: v for k, v in doc.items() if k != "prompt_token_ids"}


@pytest.mark.parametrize("payload", [
    b'{"prompt_token_ids":[1, 2]}',            # spaces: not vLLM's compact form
    b'{"prompt_token_ids":null}',
    b'{"prompt_token_ids":[1,-2]}',
    b'{"prompt_token_ids":[1,,2]}',
    b'{"prompt_token_ids":[[1],[2]]}',
    b'{"prompt_token_ids":[1.5]}',
    b'{"text":"no ids here"}',
])
def test_lift_leaves_anything_unusual_to_the_normal_parse(payload):
    assert lift_prompt_ids(payload) == (payload, None)


def test_the_key_inside_a_string_is_not_lifted():
    doc = {"choices": [{"message": {"content": '{"prompt_token_ids":[1,2]}'}}], "prompt_token_ids": [7, 8]}
    tokens = TokenData()
    out = get_engine("vllm").parse(orjson.dumps(doc), tokens)
    assert out["choices"] == doc["choices"] and out["prompt_token_ids"] is tokens.prompt_token_ids  # lifted, unparsed
    assert list(tokens.prompt_token_ids) == [7, 8]


def test_engine_parse_keeps_the_first_chunks_ids_and_parses_later_chunks_normally():
    engine, tokens = get_engine("vllm"), TokenData()
    first = {"id": "c", "choices": [{"index": 0, "delta": {"content": ""}}], "prompt_token_ids": list(range(3000))}
    chunk = engine.parse(orjson.dumps(first), tokens)
    engine.read_chunk(chunk, tokens)
    assert isinstance(tokens.prompt_token_ids, jsonutil.RawIds) and list(tokens.prompt_token_ids) == list(range(3000))
    later = {"id": "c", "choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [4]}], "prompt_token_ids": [1]}
    chunk = engine.parse(orjson.dumps(later), tokens)
    assert chunk == later  # ids already known: nothing lifted, nothing replaced
    engine.read_chunk(chunk, tokens)
    assert list(tokens.prompt_token_ids) == list(range(3000)) and tokens.sampled_token_ids == [4]


def test_malformed_payload_still_raises_decode_error():
    with pytest.raises(orjson.JSONDecodeError):
        get_engine("vllm").parse(b'{"prompt_token_ids":[1,2],', TokenData())


def test_capture_line_is_the_same_as_with_parsed_values():
    body = {"model": "m", "messages": [{"role": "user", "content": "héllo \u2028 \"q\""}], "temperature": 1e-5}
    sent = {"model": "served", "messages": body["messages"], "logprobs": True}
    ids = list(range(100, 140))
    plain = CallRecord(call_id=uuid.uuid4().hex, session_id="s", native_request=body, normalized_request=sent,
                       prompt_token_ids=ids)
    raw = CallRecord(call_id=plain.call_id, session_id="s",
                     native_request=jsonutil.raw_json(json.dumps(body).encode()),
                     normalized_request=jsonutil.raw_json(orjson.dumps(sent)),
                     prompt_token_ids=jsonutil.RawIds(orjson.dumps(ids), len(ids)))
    assert json.loads(encode_record(raw)) == json.loads(encode_record(plain))
    assert encode_record(raw).count(b"\n") == 1


def test_capture_with_raw_values_survives_the_big_integer_fallback():
    rec = CallRecord(session_id="s", native_request=jsonutil.raw_json(b'{"seed":1}'),
                     output_tool_calls=[{"name": "f", "arguments": {"n": BIG}}],
                     prompt_token_ids=jsonutil.RawIds(b"[1,2,3]", 3))
    line = json.loads(encode_record(rec))
    assert line["native_request"] == {"seed": 1} and line["prompt_token_ids"] == [1, 2, 3]
    assert line["output_tool_calls"][0]["arguments"]["n"] == BIG


def test_bodies_with_raw_line_breaks_are_not_kept_raw():
    assert jsonutil.raw_json(b'{\n  "a": 1\n}') is None
    assert jsonutil.raw_json(b'{"a":1}\r') is None
    assert jsonutil.raw_json(b'{"a":"x\\ny"}').json == b'{"a":"x\\ny"}'


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("pretty", [False, True])
def test_capture_holds_the_harness_body_and_the_engines_ids(reverse_proxy, upstream, helpers, stream, pretty):
    session = f"raw-{uuid.uuid4().hex[:8]}"
    body = {"model": "gpt-x", "stream": stream, "max_tokens": 16, "seed": 7,
            "messages": [{"role": "user", "content": "count to three, naïvely \u2603"}]}
    data = json.dumps(body, indent=2 if pretty else None).encode()
    ans = helpers.request(reverse_proxy.url + "/v1/chat/completions", data,
                          headers={"content-type": "application/json", "x-polar-session": session})
    assert ans.status == 200, ans.body[:300]
    got = upstream.upstream.responses[-1]
    rec = helpers.read_records(reverse_proxy.capture_dir, session)[-1]
    assert rec["native_request"] == body
    assert rec["normalized_request"] == upstream.upstream.requests[-1]
    assert rec["prompt_token_ids"] == got["prompt_token_ids"] and rec["prompt_token_ids"]
    assert rec["sampled_token_ids"] == got["token_ids"]
    assert b"prompt_token_ids" not in ans.body  # engine fields never reach the harness
