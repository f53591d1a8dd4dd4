"""OpenAI's Responses API through the official ``openai`` client and openai-agents' default model
(``OpenAIResponsesModel``), on the embedded model over real HTTP.

The service renders with tests/fixtures/thinking_template.jinja (the embedded base model thinks first, as the
worked turns show it), so answers carry reasoning items; the base model rarely ends free text by itself, so the
answers that must complete are structured (a JSON schema, or a forced call): those end with their grammar."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.conftest import EMBEDDED_NAME, ROOT, ServiceProcess

pytestmark = pytest.mark.slow

KEY, OTHER = "responses-key-a", "responses-key-b"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
           "required": ["city"], "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "The current weather of a city",
                     "parameters": WEATHER}]
ANSWER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "sky": {"type": "string", "maxLength": 24}},
          "required": ["city", "sky"], "additionalProperties": False}
FORMAT: Any = {"format": {"type": "json_schema", "name": "Weather", "schema": ANSWER, "strict": True}}


class City(BaseModel):
    name: str = Field(max_length=32)
    country: str = Field(max_length=32)
    population: int


@pytest.fixture(scope="module")
def svc(service_factory: Callable[..., ServiceProcess]) -> ServiceProcess:
    s = service_factory(GGUF_CONFIRM_LOADS="false", GGUF_CONTEXT_LENGTH="4096", GGUF_EMBEDDINGS="off",
                        GGUF_API_KEYS=f"{KEY},{OTHER}",
                        GGUF_CHAT_TEMPLATE_FILE=str(ROOT / "tests" / "fixtures" / "thinking_template.jinja"))
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def client(svc: ServiceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def other(svc: ServiceProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=OTHER, max_retries=0, timeout=300)


def _texts(output: list[Any]) -> tuple[str, str]:
    reasoning = "".join(c.text for o in output if o.type == "reasoning" for c in (o.content or []))
    text = "".join(c.text for o in output if o.type == "message" for c in o.content)
    return reasoning, text


def test_text_streamed_reassembles_to_the_plain_response(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=EMBEDDED_NAME, input="What is the capital of France?", max_output_tokens=24,
                              temperature=0)
    plain = client.responses.create(**kw)
    reasoning, text = _texts(plain.output)
    assert plain.object == "response" and plain.status in ("completed", "incomplete")
    assert reasoning.strip() and "think>" not in reasoning and plain.output_text == text
    assert plain.usage is not None and plain.usage.output_tokens <= 24
    assert 0 < plain.usage.output_tokens_details.reasoning_tokens <= plain.usage.output_tokens
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == f"response.{plain.status}"
    final = events[-1].response
    assert _texts(final.output) == (reasoning, text)  # greedy: the same answer, streamed
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [e.item.id for e in events if e.type == "response.output_item.done"] == [o.id for o in final.output]


def test_a_structured_answer_parses_within_128_tokens(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model=EMBEDDED_NAME, input="Describe Paris.", text_format=City,
                                    max_output_tokens=128, temperature=0)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)
    assert parsed.usage is not None and parsed.usage.output_tokens <= 128
    assert abs(parsed.output_parsed.population) < 2 ** 53  # bounded digits


def test_a_tool_loop_continues_from_the_stored_response(client: openai.OpenAI) -> None:
    first = client.responses.create(model=EMBEDDED_NAME, input="What is the weather in Paris?", tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=128,
                                    temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    follow: dict[str, Any] = dict(model=EMBEDDED_NAME, previous_response_id=first.id, tools=TOOLS,
                                  input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": "sunny, 21 C"}])
    second = client.responses.create(tool_choice="none", text=FORMAT, max_output_tokens=128, temperature=0, **follow)
    assert second.status == "completed" and second.previous_response_id == first.id
    jsonschema.validate(json.loads(second.output_text), ANSWER)
    # The stored turns are the prompt: counted the same way, and as many tokens as the whole conversation sent.
    counted = client.responses.input_tokens.count(tool_choice="none", text=FORMAT, **follow)
    whole = client.responses.input_tokens.count(
        model=EMBEDDED_NAME, tools=TOOLS, tool_choice="none", text=FORMAT,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments}, *follow["input"]])
    assert second.usage is not None
    assert counted.input_tokens == second.usage.input_tokens == whole.input_tokens
    # A result for a call nobody made is refused, naming the item.
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=EMBEDDED_NAME, previous_response_id=first.id, max_output_tokens=8,
                                input=[{"type": "function_call_output", "call_id": "call_nobody", "output": "x"}])
    assert exc.value.body["param"] == "input[0].call_id"  # type: ignore[index]


def test_tools_beside_a_format_answer_with_a_call_or_the_format(client: openai.OpenAI) -> None:
    r = client.responses.create(model=EMBEDDED_NAME, input="What is the weather in Rome?", tools=TOOLS, text=FORMAT,
                                parallel_tool_calls=False, max_output_tokens=128, temperature=0)
    assert r.status == "completed"
    calls = [o for o in r.output if o.type == "function_call"]
    if calls:
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    else:
        jsonschema.validate(json.loads(r.output_text), ANSWER)


def test_streamed_call_arguments_reassemble(client: openai.OpenAI) -> None:
    with client.responses.stream(model=EMBEDDED_NAME, input="What is the weather in Oslo?", tools=TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=128,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    call = [o for o in final.output if o.type == "function_call"][0]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"][0]
    assert deltas == done.arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_stored_responses_belong_to_their_key(client: openai.OpenAI, other: openai.OpenAI) -> None:
    r = client.responses.parse(model=EMBEDDED_NAME, input="Describe Oslo.", text_format=City, max_output_tokens=128,
                               temperature=0, metadata={"run": "store-test"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"run": "store-test"}
    items = client.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"]
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)  # another key's responses do not exist for it
    with pytest.raises(openai.BadRequestError) as exc:
        other.responses.create(model=EMBEDDED_NAME, previous_response_id=r.id, input="And Bergen?",
                               max_output_tokens=8)
    assert exc.value.code == "previous_response_not_found"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model=EMBEDDED_NAME, input="Hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_openai_agents_default_model(svc: ServiceProcess) -> None:
    agents = pytest.importorskip("agents")

    class Weather(BaseModel):
        city: str = Field(max_length=24)
        sky: str = Field(max_length=24)

    called: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        called.append(city)
        return f"sunny in {city}"

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=svc.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        agents.set_tracing_disabled(True)
        model = agents.OpenAIResponsesModel(EMBEDDED_NAME, client)  # the SDK's default model class
        settings = agents.ModelSettings(max_tokens=128, temperature=0)
        # A structured answer (the output type is text.format), then a turn continuing it by previous_response_id.
        writer = agents.Agent(name="writer", instructions="Answer with the weather.", model=model,
                              output_type=Weather, model_settings=settings)
        result = await agents.Runner.run(writer, "The weather in Paris is sunny.")
        assert isinstance(result.final_output, Weather) and result.last_response_id
        again = await agents.Runner.run(writer, "And in Rome it rains.", previous_response_id=result.last_response_id)
        assert isinstance(again.final_output, Weather)
        # Streamed: the raw Responses events, then the parsed output.
        streamed = agents.Runner.run_streamed(writer, "The weather in Oslo is cloudy.")
        kinds = [e.data.type async for e in streamed.stream_events() if e.type == "raw_response_event"]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert "response.output_text.delta" in kinds and isinstance(streamed.final_output, Weather)
        # A tool loop: the model calls, the SDK runs the tool, its result is the run's output.
        caller = agents.Agent(name="caller", instructions="Use the tool.", model=model, tools=[get_weather],
                              tool_use_behavior="stop_on_first_tool",
                              model_settings=agents.ModelSettings(max_tokens=128, temperature=0, tool_choice="required",
                                                                  parallel_tool_calls=False))
        looped = await agents.Runner.run(caller, "What is the weather in Paris?")
        assert called and looped.final_output == f"sunny in {called[0]}"
        await client.close()

    asyncio.run(run())


HOSTILE: list[dict[str, Any]] = [
    {"input": 123},
    {"input": [1, 2]},
    {"input": [{"type": "message", "role": "wizard", "content": "x"}]},
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
    {"input": [{"role": "user", "content": "a\x00b"}]},
    {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "nobody called"}]},
    {"input": [{"type": "function_call", "call_id": "bad id!", "name": "f", "arguments": "{}"}]},
    {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "[" * 5000 + "]" * 5000}]},
    {"input": [{"type": "item_reference", "id": "msg_1"}]},
    {"input": [{"type": "web_search_call", "id": "ws_1"}]},
    {"input": "x", "tools": [{"type": "web_search"}]},
    {"input": "x", "tools": [{"type": "function", "name": "no spaces allowed"}]},
    {"input": "x", "tool_choice": {"type": "file_search"}},
    {"input": "x", "tool_choice": "required"},
    {"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}},
    {"input": "x", "text": {"format": {"type": "xml"}}},
    {"input": "x", "background": True},
    {"input": "x", "conversation": "conv_1"},
    {"input": "x", "truncation": "auto"},
    {"input": "x", "previous_response_id": "resp_nothing"},
    {"input": "x", "metadata": {"k" * 65: "v"}},
    {"input": "x", "max_output_tokens": 0},
    {"input": "x", "temperature": "hot"},
    {"input": "x", "stream": "yes"},
    {"input": ""},
    {"input": "x" * 10, "instructions": ["not", "a", "string"]},
]


def test_malformed_and_hostile_bodies_are_4xx(svc: ServiceProcess) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=svc.url, headers=headers, timeout=120) as http:
        for body in HOSTILE:
            for path in ("/v1/responses", "/v1/responses/input_tokens"):
                r = http.post(path, json={"model": EMBEDDED_NAME, **body})
                if path.endswith("input_tokens") and r.status_code == 200:
                    assert set(body) & {"max_output_tokens", "temperature", "stream", "background", "metadata"}, body
                    continue  # fields a count does not take
                assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
                assert isinstance(r.json()["error"]["message"], str)
        for path in ("/v1/responses/resp_nothing", "/v1/responses/resp_nothing/input_items"):
            assert http.get(path).status_code == 404
        assert http.delete("/v1/responses/resp_nothing").status_code == 404
        assert http.get("/v1/responses/resp_x/input_items", params={"limit": 0}).status_code in (400, 422)
        assert http.get("/health").status_code == 200  # the same process serves on
