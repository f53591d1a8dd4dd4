"""Structured output through the frameworks apps use, unchanged and with their defaults, on the embedded model over
real HTTP (issue 25): langchain-openai's ``with_structured_output`` (``json_schema`` and ``function_calling``) and
instructor (``Mode.JSON_SCHEMA`` and ``Mode.TOOLS``) each return a valid object within 128 tokens.

The embedded model is a base model without a chat template: left to itself it filled an ``integer`` field with
digits until max_tokens (``"population": 1000000000000...``, finish ``length``), then, numbers bounded, a float's
fraction (``105.4000000000...``) and keys pydantic's open objects allowed (``"population_density": 100, ...``);
the frameworks failed to parse every one of those (``service.grammar.schema.bounded_schema``). Each test reads the raw completion off the wire (an event hook on the client's own transport: what the
server answered, not what the framework made of it) and checks its usage and finish reason too."""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator

import httpx2
import instructor
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.conftest import EMBEDDED_NAME, ServiceProcess

pytestmark = pytest.mark.slow

KEY = "frameworks-test-key"
MAX_TOKENS = 128
ASK = "Paris is the capital of France, home to about 2.1 million people on 105.4 square kilometres."


class City(BaseModel):
    """A city, as the issue's report had it."""

    name: str
    country: str
    population: int
    area_km2: float


@pytest.fixture(scope="module")
def svc(service_factory: Callable[..., ServiceProcess]) -> ServiceProcess:
    # One compute thread: on 2 cores shared with other work, llama.cpp's two OpenMP threads wait on each other at
    # every graph barrier (measured here beside another test run: 64 tokens in 70 s with two threads, 2.4 s with one).
    s = service_factory(GGUF_CONFIRM_LOADS="false", GGUF_CONTEXT_LENGTH="2048", GGUF_API_KEYS=KEY, GGUF_N_THREADS="1")
    s.wait_ready()
    return s


class Wire:
    """The chat completions the server sent back, read off the client's transport."""

    def __init__(self) -> None:
        self.completions: list[dict[str, Any]] = []

    def hook(self, response: httpx2.Response) -> None:
        if response.request.url.path.endswith("/chat/completions"):
            response.read()
            self.completions.append(json.loads(response.content))

    def last(self) -> dict[str, Any]:
        """The one completion of the test: within max_tokens, ended by the model or its grammar, not by the limit."""
        assert len(self.completions) == 1, self.completions
        c = self.completions[0]
        assert c["usage"]["completion_tokens"] <= MAX_TOKENS, c
        assert c["choices"][0]["finish_reason"] in ("stop", "tool_calls"), c
        return c


@pytest.fixture
def wire() -> Wire:
    return Wire()


@pytest.fixture
def http(wire: Wire) -> Iterator[httpx2.Client]:
    with httpx2.Client(timeout=300, event_hooks={"response": [wire.hook]}) as c:
        yield c


def _check(city: Any) -> None:
    assert isinstance(city, City), city
    City.model_validate(city.model_dump())  # every field present and of its type
    assert city.name and city.country


# langchain-openai: ChatOpenAI as documented for an OpenAI-compatible server, its default structured-output calls.

@pytest.fixture
def chat(svc: ServiceProcess, http: httpx2.Client) -> ChatOpenAI:
    return ChatOpenAI(base_url=svc.url + "/v1", api_key=KEY, model=EMBEDDED_NAME, max_tokens=MAX_TOKENS,
                      temperature=0, max_retries=0, http_client=http)


def test_langchain_json_schema(chat: ChatOpenAI, wire: Wire) -> None:
    city = chat.with_structured_output(City, method="json_schema").invoke(ASK)
    _check(city)
    c = wire.last()
    assert c["choices"][0]["finish_reason"] == "stop"
    assert City.model_validate_json(c["choices"][0]["message"]["content"]) == city


def test_langchain_function_calling(chat: ChatOpenAI, wire: Wire) -> None:
    city = chat.with_structured_output(City, method="function_calling").invoke(ASK)
    _check(city)
    (call,) = wire.last()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "City"
    assert City.model_validate_json(call["function"]["arguments"]) == city


# instructor: from_openai over the official client, each mode's request as instructor writes it.

@pytest.fixture
def oai(svc: ServiceProcess, http: httpx2.Client) -> openai.OpenAI:
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=KEY, max_retries=0, http_client=http)


def test_instructor_json_schema(oai: openai.OpenAI, wire: Wire) -> None:
    client = instructor.from_openai(oai, mode=instructor.Mode.JSON_SCHEMA)
    city = client.chat.completions.create(model=EMBEDDED_NAME, response_model=City, max_tokens=MAX_TOKENS,
                                          max_retries=0, temperature=0,
                                          messages=[{"role": "user", "content": ASK}])
    _check(city)
    assert wire.last()["choices"][0]["finish_reason"] == "stop"


def test_instructor_tools(oai: openai.OpenAI, wire: Wire) -> None:
    client = instructor.from_openai(oai, mode=instructor.Mode.TOOLS)
    city = client.chat.completions.create(model=EMBEDDED_NAME, response_model=City, max_tokens=MAX_TOKENS,
                                          max_retries=0, temperature=0,
                                          messages=[{"role": "user", "content": ASK}])
    _check(city)
    (call,) = wire.last()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "City"
