"""Issue 29's smaller refusals, each a 400 naming the field (OpenAI's envelope on /v1, Anthropic's on /v1/messages),
the server serving afterwards: a tool message answering no call, Anthropic tool_use ids used twice and tool_results
answering no tool_use, strings and bools where integers are wanted (``n: "2"``), logit_bias keys that are not
canonical token ids (``"5\\n"``), bools as embedding token ids. None of them needs the engine: the fake serves."""

from __future__ import annotations

from typing import Any

import pytest

from tests.service.conftest import FakeService

MODEL = "gemma-3-270m-q4_k_m"
USER = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
ASKED = {"role": "assistant", "content": None, "tool_calls": [CALL]}


def _openai_400(fake: FakeService, path: str, body: dict[str, Any], param: str) -> str:
    r = fake.client.post(path, json=body)
    assert r.status_code == 400, (body, r.text)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
    _still_serves(fake)
    return str(err["message"])


def _anthropic_400(fake: FakeService, path: str, body: dict[str, Any], param: str) -> None:
    r = fake.client.post(path, json=body)
    assert r.status_code == 400, (body, r.text)
    out = r.json()
    # Anthropic's envelope has no param: the message names the field first.
    assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error", out
    assert out["error"]["message"].startswith(param + ":"), (param, out)
    _still_serves(fake)


def _still_serves(fake: FakeService) -> None:
    r = fake.client.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


def _chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": 2, **extra}


def test_a_tool_message_answers_a_call_an_earlier_assistant_message_made(fake: FakeService) -> None:
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    # The answered call: served.
    r = fake.client.post("/v1/chat/completions", json=_chat([USER, ASKED, result]))
    assert r.status_code == 200, r.text
    # No call at all, another call's id, and a result given before its call.
    _openai_400(fake, "/v1/chat/completions", _chat([USER, result]), "messages[1].tool_call_id")
    other = {**result, "tool_call_id": "call_2"}
    msg = _openai_400(fake, "/v1/chat/completions", _chat([USER, ASKED, result, other]), "messages[3].tool_call_id")
    assert "call_2" in msg
    _openai_400(fake, "/v1/chat/completions", _chat([USER, result, ASKED]), "messages[1].tool_call_id")


def _tool_use(i: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": i, "name": "get_weather", "input": {"city": "Paris"}}


def _tool_result(i: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": i, "content": "sunny"}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_anthropic_tool_use_ids_are_unique_and_every_result_answers_one(fake: FakeService, path: str) -> None:
    def body(*messages: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}, *messages]}
        return out if path.endswith("count_tokens") else {**out, "max_tokens": 2}

    good = body({"role": "assistant", "content": [_tool_use("toolu_1")]},
                {"role": "user", "content": [_tool_result("toolu_1")]})
    assert fake.client.post(path, json=good).status_code == 200
    # The same id twice in one message, and again in a later turn.
    _anthropic_400(fake, path, body({"role": "assistant", "content": [_tool_use("toolu_1"), _tool_use("toolu_1")]}),
                   "messages[1].content[1].id")
    _anthropic_400(fake, path, body({"role": "assistant", "content": [_tool_use("toolu_1")]},
                                    {"role": "user", "content": [_tool_result("toolu_1")]},
                                    {"role": "assistant", "content": [_tool_use("toolu_1")]}),
                   "messages[3].content[0].id")
    # A result for no tool_use, and for one of another id.
    _anthropic_400(fake, path, body({"role": "assistant", "content": "ok"},
                                    {"role": "user", "content": [_tool_result("toolu_9")]}),
                   "messages[2].content[0].tool_use_id")
    _anthropic_400(fake, path, body({"role": "assistant", "content": [_tool_use("toolu_1")]},
                                    {"role": "user", "content": [_tool_result("toolu_1"), _tool_result("toolu_2")]}),
                   "messages[2].content[1].tool_use_id")


TYPED: list[tuple[dict[str, Any], str]] = [
    ({"n": "2"}, "n"), ({"n": 2.0}, "n"), ({"n": True}, "n"),
    ({"max_tokens": "2"}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"seed": "7"}, "seed"), ({"top_k": 1.0}, "top_k"),
    ({"temperature": "0.5"}, "temperature"), ({"temperature": True}, "temperature"),
    ({"stream": "true"}, "stream"), ({"stream": 1}, "stream"),
    ({"logprobs": "true"}, "logprobs"), ({"top_logprobs": "2", "logprobs": True}, "top_logprobs"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"parallel_tool_calls": "false"}, "parallel_tool_calls"),
]


def test_chat_fields_take_json_types_not_coerced_strings(fake: FakeService) -> None:
    for extra, param in TYPED:
        _openai_400(fake, "/v1/chat/completions", _chat([USER], **extra), param)


def test_typed_fields_of_completions_embeddings_and_messages(fake: FakeService) -> None:
    _openai_400(fake, "/v1/completions", {"prompt": "a b", "max_tokens": 2, "n": "2"}, "n")
    _openai_400(fake, "/v1/completions", {"prompt": "a b", "max_tokens": 2, "logprobs": "1"}, "logprobs")
    _openai_400(fake, "/v1/completions", {"prompt": "a b", "max_tokens": 2, "echo": "false"}, "echo")
    _openai_400(fake, "/v1/embeddings", {"input": "a b", "dimensions": "8"}, "dimensions")
    _anthropic_400(fake, "/v1/messages", {"model": MODEL, "max_tokens": "2", "messages": [USER]}, "max_tokens")
    _anthropic_400(fake, "/v1/messages", {"model": MODEL, "max_tokens": 2, "stream": "true", "messages": [USER]},
                   "stream")
    # An integer is still a number, as in JSON Schema and OpenAI's API.
    r = fake.client.post("/v1/chat/completions", json=_chat([USER], temperature=1, top_p=1))
    assert r.status_code == 200, r.text


def test_logit_bias_keys_are_canonical_token_ids(fake: FakeService) -> None:
    for key in ("5\n", "5 ", " 5", "05", "+5", "5.0", "\u0665", "1_0", ""):
        msg = _openai_400(fake, "/v1/chat/completions", _chat([USER], logit_bias={key: -100}), "logit_bias")
        assert "token id" in msg, (key, msg)
    r = fake.client.post("/v1/chat/completions", json=_chat([USER], logit_bias={"5": -100, "0": 1}))
    assert r.status_code == 200, r.text


def test_embedding_token_ids_are_integers_not_bools(fake: FakeService) -> None:
    for bad in ([True, False], [1, True], [[True]], [[1, 2], [False]], [1.0, 2.0]):
        _openai_400(fake, "/v1/embeddings", {"input": bad}, "input")
    r = fake.client.post("/v1/embeddings", json={"input": [1, 0]})
    assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text
