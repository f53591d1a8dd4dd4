"""Bad input is a 4xx, always (issue 28): the three kinds a hostile-input run still turned into a 5xx.

- JSON nested 100,000 deep, in a body (any route that parses one) or in a JSON string the service parses itself
  (a past tool call's ``arguments``): Python's parser raised ``RecursionError``, a 500.
- Dry-run URLs with malformed host names: ``IDNAError`` / ``UnicodeError`` from inside httpx or the resolver, a 500.
- URLs a request cannot be made to (two ports, an IPvFuture literal, an unclosed bracket, a port out of range):
  httpx's ``InvalidURL`` taken for the upstream's failure, a 502.

Each is sent over real HTTP to the real app (the fake engine: no model is needed to refuse it); the answer is a 400
naming the field where one can be named, and the same server then still serves. No URL here reaches the network:
a connection attempt fails the test.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator

import httpx
import pytest

from service.api.validation import MAX_JSON_DEPTH
from tests.conftest import EMBEDDED_NAME, ServiceProcess

from .conftest import FakeService

DEEP = "[" * 100_000 + "]" * 100_000
"""The hostile-input run's reproduction: 100,000 nested arrays."""


def _nested(levels: int) -> str:
    """``levels`` nested arrays, as JSON text."""
    return "[" * levels + "]" * levels


def _alive(svc: FakeService) -> None:
    r = svc.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}],
                                                      "max_tokens": 3})
    assert r.status_code == 200, r.text


def _openai_400(r: httpx.Response, param: str | None) -> dict[str, Any]:
    assert r.status_code == 400, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert isinstance(err["code"], str) and err["message"] and err["type"] == "invalid_request_error", err
    assert err["param"] == param, err
    return err  # type: ignore[no-any-return]


BODY_ROUTES: list[tuple[str, str]] = [
    # (route, a body whose one field holds the nesting: the middleware refuses it before any route's model)
    ("/v1/chat/completions", '{"model": "%s", "messages": %s}'),
    ("/v1/completions", '{"model": "%s", "prompt": %s}'),
    ("/v1/embeddings", '{"model": "%s", "input": %s}'),
    ("/v1/messages", '{"model": "%s", "max_tokens": 8, "messages": %s}'),
    ("/v1/messages/count_tokens", '{"model": "%s", "messages": %s}'),
    ("/api/dry-run", '{"model": "%s", "tensor_split": %s}'),
    ("/api/models/load", '{"model": "%s", "tensor_split": %s}'),
    ("/api/models/unload", '{"model": "%s", "force": %s}'),
    ("/api/models/pull", '{"repo_id": "%s", "filename": %s}'),
    ("/api/hf/files", '{"repo_id": "%s", "revision": %s}'),
]


@pytest.mark.timeout(120)
def test_deep_nesting_in_any_body_is_a_400(fake: FakeService) -> None:
    for route, template in BODY_ROUTES:
        for nesting in (DEEP, _nested(MAX_JSON_DEPTH)):  # 256 arrays in the field: 257 levels with the body's object
            raw = (template % (EMBEDDED_NAME, nesting)).encode()
            r = fake.client.post(route, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (route, r.status_code, r.text[:300])
            if route.startswith("/v1/messages"):  # Anthropic's error shape on its routes
                got = r.json()
                assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error", got
                assert "deeper than" in got["error"]["message"], got
            else:
                assert "deeper than 256 levels" in _openai_400(r, None)["message"]
    # Chunked (no Content-Length): the body is checked once whole, before the route parses it.
    chunks = [b'{"messages": '] + [b"[" * 10_000] * 10 + [b"]" * 10_000] * 10 + [b"}"]
    r = fake.client.post("/v1/chat/completions", content=iter(chunks), headers={"content-type": "application/json"})
    _openai_400(r, None)
    # An Anthropic tool_use input is an object in the body: bounded the same way.
    r = fake.client.post("/v1/messages", content=json.dumps({
        "model": EMBEDDED_NAME, "max_tokens": 8, "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 0}}]},
        ]}).replace('{"x": 0}', '{"x": ' + DEEP + "}").encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text[:300]
    _alive(fake)


@pytest.mark.timeout(120)
def test_legitimate_bodies_are_not_refused(fake: FakeService) -> None:
    # Brackets inside strings are text, however many: a message of 100,000 of them is served.
    for content in ("[" * 100_000, DEEP, '"\\' * 1000 + "{" * 1000):
        r = fake.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                           "max_tokens": 2})
        assert r.status_code == 200, r.text[:300]
    # Nesting up to the bound is not the middleware's business: a message's extra field 256 levels deep in all.
    body = {"messages": [{"role": "user", "content": "a", "x": json.loads(_nested(MAX_JSON_DEPTH - 3))}],
            "max_tokens": 2}
    r = fake.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text[:300]
    # Past arguments nested up to the bound are parsed and served.
    r = fake.client.post("/v1/chat/completions", json=_with_past_call(_nested(MAX_JSON_DEPTH)))
    assert r.status_code == 200, r.text[:300]


def _with_past_call(arguments: str) -> dict[str, Any]:
    return {"max_tokens": 2, "messages": [
        {"role": "user", "content": "What is the weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]}


@pytest.mark.timeout(120)
def test_deep_past_tool_call_arguments_are_a_400_naming_them(fake: FakeService) -> None:
    """The hostile run's reproduction: the arguments string is parsed by the chat format (json.loads) for the
    template; 100,000 levels raised RecursionError there (a 500)."""
    param = "messages[1].tool_calls[0].function.arguments"
    for arguments in (DEEP, _nested(MAX_JSON_DEPTH + 1), '{"a": ' * 300 + "1" + "}" * 300):
        for stream in (False, True):
            r = fake.client.post("/v1/chat/completions", json={**_with_past_call(arguments), "stream": stream})
            assert "deeper than 256 levels" in _openai_400(r, param)["message"]
    _alive(fake)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_on_the_real_engine_deep_arguments_and_bodies_are_a_400(served: ServiceProcess) -> None:
    """Where the 500 was: llama.cpp's engine renders past calls through the chat format, which parses them."""
    pid = served.proc.pid
    param = "messages[1].tool_calls[0].function.arguments"
    for stream in (False, True):
        r = served.client.post("/v1/chat/completions", json={**_with_past_call(DEEP), "stream": stream})
        _openai_400(r, param)
    r = served.client.post("/v1/chat/completions", json=_with_past_call('{"city": "Paris"}'))
    assert r.status_code == 200, r.text[:300]
    r = served.client.post("/v1/chat/completions", content=('{"messages": ' + DEEP + "}").encode(),
                           headers={"content-type": "application/json"})
    _openai_400(r, None)
    assert served.proc.poll() is None and served.proc.pid == pid, served.log()
    r = served.client.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


def test_the_chat_format_would_have_failed_on_them() -> None:
    """Why the check stands before the engine: the chat formats parse past arguments without a bound."""
    from service.chat.format import ChatFormat, prepare

    messages = _with_past_call(DEEP)["messages"]
    for fmt in (ChatFormat(), ChatFormat(tools="hermes", native_tools=True, arguments_as_object=True)):
        with pytest.raises(RecursionError):
            prepare(messages, None, fmt)


# -- URLs ---------------------------------------------------------------------------------------------------

MALFORMED_URLS = [
    # the hostile run's IDNA 500s
    "http://xn--a.com/x.gguf", "http://a..b/x.gguf", "http://" + "a" * 70 + ".com/x.gguf",
    "http://xn--zz-zzzz.com/x.gguf", "http://.a.com/x.gguf", "http://ex\u200bample.com/x.gguf",
    # the hostile run's InvalidURL 502s, and their kin
    "http://127.0.0.1:8109:80/x", "http://[v1.x]/x", "http://[::1/x", "http://a.com:99999/x", "http://a.com:0/x",
    "http://a.com:abc/x", "http:///x", "http://:80/x", "http://user@:80/x", "http://-a.com/x", "http://%41.com/x",
    "http://999.1.1.1/x",
]


@pytest.fixture
def no_connections(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every request, name resolution or connection a remote probe attempts (the app runs in this process, in a
    thread); each fails. Loopback names still resolve: the test's own client and server use them."""
    import socket

    from sizing.probe import remote

    attempts: list[str] = []
    real_getaddrinfo = socket.getaddrinfo

    def resolve(host: Any, *a: Any, **k: Any) -> Any:
        if host in ("127.0.0.1", "localhost", b"127.0.0.1", b"localhost"):
            return real_getaddrinfo(host, *a, **k)
        attempts.append(f"getaddrinfo {host!r}")
        raise OSError("no network in this test")

    def connect(self: Any, host: str, port: int, *a: Any, **k: Any) -> Any:
        attempts.append(f"connect {host!r}:{port}")
        raise OSError("no network in this test")

    def request(r: httpx.Request) -> httpx.Response:
        attempts.append(f"request {r.url}")
        raise httpx.ConnectError("no network in this test", request=r)

    real_client = remote.probe_client

    def client(*a: Any, **k: Any) -> httpx.Client:
        real_client(*a, **k).close()  # built as the probe builds it, then replaced by one that sends nothing
        return httpx.Client(transport=httpx.MockTransport(request))

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(remote._GuardedBackend, "connect_tcp", connect)
    monkeypatch.setattr(remote, "probe_client", client)
    yield attempts


@pytest.mark.timeout(120)
def test_malformed_dry_run_urls_are_a_400_naming_url(fake_factory: Callable[..., FakeService],
                                                     no_connections: list[str]) -> None:
    # Allowed hosts or not, the URL is checked first: even a host the operator allows cannot take a malformed URL.
    for svc in (fake_factory(), fake_factory(remote_allow_hosts="127.0.0.1,a.com,::1")):
        for url in MALFORMED_URLS:
            r = svc.client.post("/api/dry-run", json={"url": url})
            err = _openai_400(r, "url")
            assert err["code"] == "invalid_request", (url, err)
        _alive(svc)
    assert no_connections == [], no_connections


@pytest.mark.timeout(120)
def test_malformed_hugging_face_names_are_a_400(fake_factory: Callable[..., FakeService], no_connections: list[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    svc = fake_factory()
    # The body's pattern lets these through; the hub's own rules do not ("--", "..", more than 96 characters).
    for repo_id in ("a--b/c", "a/b..c", "acme/" + "r" * 100):
        r = svc.client.post("/api/dry-run", json={"repo_id": repo_id, "filename": "x.gguf"})
        assert "not a Hugging Face repo id" in _openai_400(r, "url")["message"], r.text
    monkeypatch.setenv("HF_ENDPOINT", "http://[v1.x]")  # an operator's typo: refused before any request too
    r = svc.client.post("/api/dry-run", json={"repo_id": "acme/tiny", "filename": "x.gguf"})
    _openai_400(r, "url")
    _alive(svc)
    assert no_connections == [], no_connections
