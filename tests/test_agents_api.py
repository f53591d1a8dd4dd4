"""What agents and apps call, through the official ``openai`` and ``anthropic`` clients, on the embedded model over
real HTTP: tool calls (required, named, streamed, a round trip), logit_bias, n choices from one prompt evaluation,
embeddings, the Anthropic Messages API, and thinking split from the answer (an injected template that thinks)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Callable

import anthropic
import jsonschema
import numpy as np
import openai
import pytest

from tests.conftest import EMBEDDED_NAME, ROOT, ServiceProcess
from tests.prom import value as prom_value

pytestmark = pytest.mark.slow

KEY = "agents-test-key"
ENV = {"GGUF_CONFIRM_LOADS": "false", "GGUF_CONTEXT_LENGTH": "4096", "GGUF_EMBEDDING_TOKENS": "128",
       "GGUF_API_KEYS": KEY}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather of a city",
                                      "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time of a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                                                "maxLength": 24}},
                                                     "required": ["city"], "additionalProperties": False}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def svc(service_factory: Callable[..., ServiceProcess]) -> ServiceProcess:
    s = service_factory(**ENV)
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def client(svc: ServiceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(svc: ServiceProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=svc.url, api_key=KEY, max_retries=0, timeout=300)


def _call(msg: Any) -> tuple[str, dict[str, Any]]:
    assert msg.tool_calls, msg
    fn = msg.tool_calls[0].function
    return fn.name, json.loads(fn.arguments)


def test_a_required_tool_call_has_arguments_valid_against_the_schema(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=EMBEDDED_NAME, messages=ASK, tools=TOOLS[:1], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=80, temperature=0.8, seed=3)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    name, args = _call(choice.message)
    assert name == "get_weather"
    jsonschema.validate(args, WEATHER_SCHEMA)
    assert choice.message.tool_calls[0].id.startswith("call_") and choice.message.tool_calls[0].type == "function"


def test_a_named_tool_choice_calls_that_tool(client: openai.OpenAI) -> None:
    for wanted in ("get_time", "get_weather"):
        r = client.chat.completions.create(
            model=EMBEDDED_NAME, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
            tool_choice={"type": "function", "function": {"name": wanted}})
        name, args = _call(r.choices[0].message)
        assert name == wanted and len(r.choices[0].message.tool_calls) == 1
        jsonschema.validate(args, next(t for t in TOOLS if t["function"]["name"] == wanted)["function"]["parameters"])


def test_streamed_tool_call_deltas_reassemble_to_the_plain_call(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=EMBEDDED_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                              parallel_tool_calls=True, max_tokens=120, temperature=0.7, seed=11)
    plain = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    n_arg_deltas = 0
    for ev in client.chat.completions.create(stream=True, **kw):
        for ch in ev.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    c["id"], c["name"] = d.id, d.function.name
                if d.function and d.function.arguments:
                    c["arguments"] += d.function.arguments
                    n_arg_deltas += 1
    # Parallel calls asked for: the base model may go on calling until max_tokens (finish_reason length); the call
    # that cut short is dropped from both answers alike, so every call returned is whole.
    assert finish == plain.finish_reason and finish in ("tool_calls", "length")
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(t.function.name, t.function.arguments) for t in plain.message.tool_calls]
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), next(
            t for t in TOOLS if t["function"]["name"] == c["name"])["function"]["parameters"])
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert n_arg_deltas == len(calls)  # a call's arguments go out in one piece, once they are whole


def test_a_tool_result_round_trips(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=EMBEDDED_NAME, messages=ASK, tools=TOOLS[:1], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny and 21 degrees celsius."},
    ]
    second = client.chat.completions.create(model=EMBEDDED_NAME, messages=history, tools=TOOLS[:1], max_tokens=16,
                                            temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert isinstance(second.choices[0].message.content, str) or second.choices[0].message.tool_calls
    # The call and its result are in the prompt the template rendered.
    without = client.chat.completions.create(model=EMBEDDED_NAME, messages=ASK, tools=TOOLS[:1], max_tokens=1)
    assert second.usage.prompt_tokens > without.usage.prompt_tokens + 20
    # A tool message must name its call.
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=EMBEDDED_NAME, max_tokens=2,
                                       messages=ASK + [{"role": "tool", "content": "x"}])  # type: ignore[list-item]
    assert e.value.body["param"] == "messages[1].tool_call_id"  # type: ignore[index]


def test_logit_bias_removes_a_word_from_greedy_output(client: openai.OpenAI, embedded_model: str) -> None:
    from llama_cpp import Llama

    vocab = Llama(model_path=embedded_model, vocab_only=True, verbose=False)
    prompt = "The capital of France is Paris. The capital of Germany is Berlin. The capital of France is"
    kw: dict[str, Any] = dict(model=EMBEDDED_NAME, prompt=prompt, max_tokens=6, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    word = plain.split()[0].strip(".,")
    assert word
    banned: set[int] = set()
    for variant in (word, " " + word, word.lower(), " " + word.lower(), word.capitalize(), " " + word.capitalize()):
        banned.update(vocab.tokenize(variant.encode(), add_bos=False, special=False)[:1])
    biased = client.completions.create(logit_bias={str(t): -100 for t in banned}, **kw).choices[0].text
    assert word not in biased, (plain, biased, banned)
    # Unknown token ids and out-of-range biases are 400s naming logit_bias.
    for bias in ({"999999999": -1}, {"12": 101}, {"abc": 1}, {"-1": 1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(logit_bias=bias, **kw)
        assert e.value.body["param"] == "logit_bias"  # type: ignore[index]


def _evaluated(svc: ServiceProcess) -> float:
    r = svc.client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
    return prom_value(r.text, "gguf_prompt_tokens_evaluated", model=EMBEDDED_NAME)


def test_n_choices_evaluate_the_prompt_once(svc: ServiceProcess, client: openai.OpenAI) -> None:
    before = _evaluated(svc)
    r = client.chat.completions.create(model=EMBEDDED_NAME, messages=[{"role": "user", "content": "Tell me a story."}],
                                       n=3, max_tokens=8, temperature=1.0, seed=5, extra_body={"cache_prompt": False,
                                                                                                 "ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 24 and r.usage.total_tokens == r.usage.prompt_tokens + 24
    assert _evaluated(svc) - before == r.usage.prompt_tokens  # once, not three times
    assert len({c.message.content for c in r.choices}) > 1
    # Streamed: every choice's deltas under its index, one usage with the prompt once. (Sampled choices need not
    # repeat the plain run's text: which slots the choices get changes how the batch is laid out, and the CPU
    # kernels round by layout; batch_invariant mode is the engine's answer to that.)
    streamed: dict[int, str] = {}
    usage = None
    for ev in client.chat.completions.create(model=EMBEDDED_NAME, messages=[{"role": "user", "content": "Tell me a story."}],
                                             n=3, max_tokens=8, temperature=1.0, seed=5, stream=True,
                                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        usage = ev.usage or usage
        for ch in ev.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + (ch.delta.content or "")
    assert sorted(streamed) == [0, 1, 2] and all(streamed.values())
    assert usage is not None and usage.completion_tokens == 24 and usage.prompt_tokens == r.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=EMBEDDED_NAME, messages=ASK, n=5, max_tokens=2)
    assert e.value.body["param"] == "n" and "GGUF_PARALLEL" in e.value.body["message"]  # type: ignore[index]


def test_embeddings_have_n_embd_unit_norm_and_base64_is_the_same_floats(client: openai.OpenAI) -> None:
    texts = ["The cat sat on the mat.", "Quarterly revenue grew by four percent."]
    floats = client.embeddings.create(model=EMBEDDED_NAME, input=texts, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1]
    v = np.array([d.embedding for d in floats.data])
    assert v.shape == (2, 640)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 4
    # The client asks for base64 by default and decodes it with numpy; decoded by hand too.
    default = client.embeddings.create(model=EMBEDDED_NAME, input=texts)
    assert np.array_equal(np.array([d.embedding for d in default.data]), v)
    raw = client.embeddings.with_raw_response.create(model=EMBEDDED_NAME, input=texts, encoding_format="base64")
    b64 = json.loads(raw.text)["data"][0]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(b64), dtype="<f4"), v[0].astype("<f4"))
    # Token ids are an input too.
    assert client.embeddings.create(model=EMBEDDED_NAME, input=[[2, 651, 4932]]).data[0].embedding
    for bad, param in ((["x" * 5000], "input"), ([""], "input"), ([], "input"), ([[999999999]], "input")):
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model=EMBEDDED_NAME, input=bad, encoding_format="float")
        assert e.value.body["param"] == param, (bad, e.value.body)  # type: ignore[index]


def test_anthropic_messages_text_and_stream(claude: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = dict(model=EMBEDDED_NAME, max_tokens=12, system="Answer in one word.",
                              messages=[{"role": "user", "content": "What colour is the sky?"}],
                              extra_body={"temperature": 0})
    msg = claude.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == EMBEDDED_NAME
    assert msg.content[0].type == "text" and msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens <= 12 and msg.usage.input_tokens > 0
    events = []
    with claude.messages.stream(**kw) as stream:
        for ev in stream:
            events.append(ev.type)
        final = stream.get_final_message()
    assert final.content[0].text == msg.content[0].text and final.stop_reason == msg.stop_reason
    assert events[0] == "message_start" and "content_block_start" in events and "content_block_stop" in events
    assert events[-2:] == ["message_delta", "message_stop"]
    # count_tokens: the prompt tokens the engine evaluates for that request (its input plus cached tokens).
    count = claude.messages.count_tokens(model=EMBEDDED_NAME, system=kw["system"], messages=kw["messages"])
    assert count.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)


def test_anthropic_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    tools = [{"name": "get_weather", "description": "The current weather of a city", "input_schema": WEATHER_SCHEMA}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg = claude.messages.create(model=EMBEDDED_NAME, max_tokens=80, messages=ask, tools=tools,
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                 extra_body={"temperature": 0})
    assert msg.stop_reason == "tool_use"
    use = [b for b in msg.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and use[0].id.startswith("toolu_")
    jsonschema.validate(use[0].input, WEATHER_SCHEMA)
    with claude.messages.stream(model=EMBEDDED_NAME, max_tokens=80, messages=ask, tools=tools,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body={"temperature": 0}) as stream:
        streamed = stream.get_final_message()
    s_use = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed.stop_reason == "tool_use" and s_use[0].input == use[0].input
    history = ask + [{"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                   "content": "Sunny and 21 degrees celsius."}]}]
    answer = claude.messages.create(model=EMBEDDED_NAME, max_tokens=12, messages=history, tools=tools,
                                    extra_body={"temperature": 0})
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    count = claude.messages.count_tokens(model=EMBEDDED_NAME, messages=history, tools=tools)
    assert count.input_tokens == answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)


def test_anthropic_errors_are_in_anthropics_shape(svc: ServiceProcess, claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as nf:
        claude.messages.create(model="claude-no-such-model", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert nf.value.body["type"] == "error" and nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as br:
        claude.messages.create(model=EMBEDDED_NAME, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert br.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    bad = anthropic.Anthropic(base_url=svc.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as au:
        bad.messages.create(model=EMBEDDED_NAME, max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert au.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    r = svc.client.post("/v1/messages", headers={"x-api-key": KEY}, json={"model": EMBEDDED_NAME, "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text


@pytest.fixture(scope="module")
def thinker(service_factory: Callable[..., ServiceProcess]) -> openai.OpenAI:
    template = ROOT / "tests" / "fixtures" / "thinking_template.jinja"
    s = service_factory(GGUF_CONFIRM_LOADS="false", GGUF_CONTEXT_LENGTH="2048", GGUF_EMBEDDINGS="off",
                        GGUF_CHAT_TEMPLATE_FILE=str(template))
    s.wait_ready()
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_thinking_is_split_from_the_answer_streamed_and_not(thinker: openai.OpenAI) -> None:
    assert Path(ROOT / "tests" / "fixtures" / "thinking_template.jinja").read_text().count("<think>") >= 2
    kw: dict[str, Any] = dict(model=EMBEDDED_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
                              max_tokens=24, temperature=0)
    msg = thinker.chat.completions.create(**kw).choices[0].message
    reasoning = (msg.model_extra or {}).get("reasoning_content")
    assert reasoning and reasoning.strip() and msg.content
    assert "think>" not in reasoning and not msg.content.lstrip().startswith("</think>")
    r_parts, c_parts = [], []
    for ev in thinker.chat.completions.create(stream=True, **kw):
        for ch in ev.choices:
            r_parts.append((ch.delta.model_extra or {}).get("reasoning_content") or "")
            c_parts.append(ch.delta.content or "")
    assert "".join(r_parts) == reasoning and "".join(c_parts) == msg.content
    # none: the text as generated (the template opened the thinking, the model closes it in the content);
    # inline: the thinking also stays in the content, with its tag.
    raw = thinker.chat.completions.create(extra_body={"reasoning_format": "none"}, **kw).choices[0].message
    assert (raw.model_extra or {}).get("reasoning_content") is None and "</think>" in raw.content
    assert raw.content == reasoning + "</think>" + raw.content.split("</think>", 1)[1]
    inline = thinker.chat.completions.create(extra_body={"reasoning_format": "inline"}, **kw).choices[0].message
    assert inline.content == raw.content and (inline.model_extra or {}).get("reasoning_content") == reasoning
