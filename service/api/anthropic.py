"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request becomes the chat request the OpenAI route takes (``to_chat``) and runs through the same path
(``generation.start``: the same checks, queue, engine, limits and auth; ``x-api-key`` is accepted by
``security.presented_key``), its choice read through ``service.chat.choices``, answered in Anthropic's shape:

- ``system`` (a string or text blocks), ``messages`` of text blocks, ``tool_use`` blocks (an assistant's calls)
  and ``tool_result`` blocks (their results, ``is_error`` included); ``image`` blocks in user turns (base64, or a
  URL of a host GGUF_IMAGE_URL_HOSTS names: ``service.api.images``); document blocks: 400; ids and
  names reach the prompt, so a ``tool_use`` ``id`` / ``tool_result`` ``tool_use_id`` beyond ``[A-Za-z0-9_.:-]``
  and a name beyond ``[A-Za-z0-9_.-]`` are 400 naming the field (Anthropic's own rule is ``^[a-zA-Z0-9_-]+$``);
- ``tools`` (``name``, ``description``, ``input_schema``) and ``tool_choice`` (``auto``, ``any``, ``tool``,
  ``none``, ``disable_parallel_tool_use``) as OpenAI tools, constrained the same way;
- the answer's blocks in order: ``thinking`` (when the model thinks), ``text``, ``tool_use`` (``input`` parsed);
  ``stop_reason`` ``end_turn``, ``max_tokens``, ``stop_sequence`` (with ``stop_sequence``) or ``tool_use``;
- ``stream``: ``message_start``, ``ping``, per block ``content_block_start`` / ``content_block_delta``
  (``text_delta``, ``thinking_delta``, ``input_json_delta``) / ``content_block_stop``, ``message_delta``
  (stop reason, output tokens), ``message_stop``; a failure during generation is an ``error`` event;
- errors in Anthropic's shape (``service.api.errors.error_body``: every route under /v1/messages);
- usage: ``input_tokens`` are the prompt tokens evaluated, ``cache_read_input_tokens`` those a slot's cache
  held; their sum is what ``count_tokens`` answers for the same request.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import BadRequest, EngineFailure, ServiceError
from ..chat.choices import Answer, Event
from .deps import ManagerDep, MetricsDep
from .errors import code_of, param_of, service_error_body
from .generation import Started, chat_prompt_tokens, collect, start
from .openai_wire import ChatRequest
from ..chat.tools import check_call_id, check_name

router = APIRouter(prefix="/v1")

MAX_STOP_SEQUENCES = 4


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # JSON's own types (``openai.STRICT``)

    model: str = Field(max_length=256)
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    temperature: float = Field(1.0, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0, le=1 << 20)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    mcp_servers: Any = Field(None, description="Not supported: anything but null or [] is a 400.")
    output_config: dict[str, Any] | None = Field(None, description="A structured-output format is not supported (400); "
                                                 "other keys are ignored.")


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(max_length=256)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


def _text_of(blocks: Any, where: str) -> str:
    """The text of a string or of text blocks (``system``, a ``tool_result``'s content)."""
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    out = []
    for j, b in enumerate(blocks if isinstance(blocks, list) else [blocks]):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise BadRequest(f"{where}[{j}]: only text blocks are supported here", param=f"{where}[{j}]")
        out.append(b["text"])
    return "\n".join(out)


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom") or not isinstance(t.get("name"), str):
            raise BadRequest(f"tools[{i}]: a client tool {{\"name\", \"description\", \"input_schema\"}} "
                             "(server tools are not supported)", param=f"tools[{i}]")
        check_name(t["name"], f"tools[{i}].name")
        fn: dict[str, Any] = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise BadRequest("tool_choice: {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", \"name\": ...}",
                     param="tool_choice")


def _messages(system: Any, messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """Anthropic turns as OpenAI messages: tool results become ``tool`` messages, tool uses ``tool_calls``.

    A ``tool_use`` id is used once in a conversation, and a ``tool_result`` answers an earlier ``tool_use`` of its id:
    Anthropic refuses the others ("tool_use ids must be unique"; "Each tool_result block must have a corresponding
    tool_use block"), and here they would reach the prompt as calls the model never made."""
    out: list[dict[str, Any]] = []
    used: set[str] = set()
    if system:
        out.append({"role": "system", "content": _text_of(system, "system")})
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        images: list[tuple[int, str]] = []
        """(how many texts came before it, the image's URL): where each image block stands among the texts."""
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(m.content):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "image" and m.role == "user":
                images.append((len(texts), _image_url(b.get("source"), f"{where}[{j}].source")))
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) \
                        or not isinstance(b.get("input", {}), dict):
                    raise BadRequest(f"{where}[{j}]: a tool_use block has an id, a name and an input object",
                                     param=f"{where}[{j}]")
                check_call_id(b["id"], f"{where}[{j}].id")  # ids and names reach the prompt: safe characters only
                check_name(b["name"], f"{where}[{j}].name")
                if b["id"] in used:
                    raise BadRequest(f"{where}[{j}].id: the tool_use id {b['id'][:64]!r} is used twice; tool_use ids "
                                     "are unique", param=f"{where}[{j}].id")
                used.add(b["id"])
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "tool_result" and m.role == "user":
                if not isinstance(b.get("tool_use_id"), str) or not b["tool_use_id"]:
                    raise BadRequest(f"{where}[{j}].tool_use_id: the tool_use block it answers", param=f"{where}[{j}]")
                check_call_id(b["tool_use_id"], f"{where}[{j}].tool_use_id")
                if b["tool_use_id"] not in used:
                    raise BadRequest(f"{where}[{j}].tool_use_id: no earlier tool_use block has the id "
                                     f"{b['tool_use_id'][:64]!r}", param=f"{where}[{j}].tool_use_id")
                text = _text_of(b.get("content"), f"{where}[{j}].content")
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": ("Error: " + text) if b.get("is_error") else text})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier thinking is not shown to the model again (as Anthropic's API drops it)
            else:
                raise BadRequest(f"{where}[{j}].type: {str(kind)[:40]!r} blocks are not supported"
                                 + (" (documents)" if kind == "document" else
                                    " in assistant turns" if kind == "image" else ""),
                                 param=f"{where}[{j}].type")
        if m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif images:  # the texts and images in their order, as OpenAI content parts (service.api.images)
            parts: list[dict[str, Any]] = []
            for k, text in enumerate(texts):
                parts += [{"type": "image_url", "image_url": {"url": url}} for at, url in images if at == k]
                parts.append({"type": "text", "text": text})
            parts += [{"type": "image_url", "image_url": {"url": url}} for at, url in images if at == len(texts)]
            out.append({"role": "user", "content": parts})
        elif texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
"""The media types of Anthropic's base64 image source."""


def _image_url(source: Any, param: str) -> str:
    """An image block's source as a URL: ``{"type": "base64", "media_type", "data"}`` as a data: URL, ``{"type":
    "url", "url"}`` as it is (fetched only from the hosts GGUF_IMAGE_URL_HOSTS names); decoded at admission."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if media not in IMAGE_MEDIA_TYPES:
            raise BadRequest(f"{param}.media_type: one of {', '.join(IMAGE_MEDIA_TYPES)}", param=f"{param}.media_type")
        if not isinstance(data, str) or not data:
            raise BadRequest(f"{param}.data: the image, base64", param=f"{param}.data")
        return f"data:{media};base64,{data}"
    if kind == "url" and isinstance(source.get("url"), str) and source["url"]:
        return str(source["url"])
    raise BadRequest(f"{param}: {{\"type\": \"base64\", \"media_type\", \"data\"}} or {{\"type\": \"url\", "
                     "\"url\"}", param=param)


def to_chat(body: MessagesRequest | CountTokensRequest, settings: Any) -> ChatRequest:
    """The OpenAI chat request for an Anthropic one (validation errors as 400s naming the field)."""
    choice, parallel = _choice(body.tool_choice)
    data: dict[str, Any] = {"model": body.model, "messages": _messages(body.system, body.messages),
                            "tools": _tools(body.tools), "tool_choice": choice, "parallel_tool_calls": parallel,
                            "reasoning_format": "none" if settings.reasoning_format == "none" else "separate"}
    if isinstance(body, MessagesRequest):
        if body.mcp_servers:
            raise BadRequest("mcp_servers: not supported", param="mcp_servers")
        if body.output_config and body.output_config.get("format"):
            raise BadRequest("output_config.format: structured output is not supported on /v1/messages; use "
                             "/v1/chat/completions with response_format", param="output_config.format")
        data.update({"max_tokens": body.max_tokens, "temperature": body.temperature, "stream": body.stream,
                     "stop": body.stop_sequences})
        if body.top_p is not None:
            data["top_p"] = body.top_p
        if body.top_k is not None:
            data["top_k"] = body.top_k
    if data["tools"] is None and choice in (None, "auto", "none"):
        data.pop("tool_choice")  # a choice that needs tools is checked (and refused) with them
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = param_of(tuple(first.get("loc", ())))
        raise BadRequest(f"{param}: {first.get('msg', 'invalid value')}", param=param) from None


def _stop_reason(a: Answer) -> tuple[str, str | None]:
    if a.finish_reason == "tool_calls":
        return "tool_use", None
    if a.finish_reason == "length":
        return "max_tokens", None
    if a.last.stop_sequence is not None:
        return "stop_sequence", a.last.stop_sequence
    return "end_turn", None


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> Any:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}  # cut short by max_tokens
    return value if isinstance(value, dict) else {}


def _usage(a: Answer) -> dict[str, int]:
    last = a.last
    return {"input_tokens": last.prompt_tokens - last.cached_tokens, "output_tokens": last.completion_tokens,
            "cache_read_input_tokens": last.cached_tokens, "cache_creation_input_tokens": 0}


@router.post("/messages")
async def messages(request: Request, body: MessagesRequest, manager: ManagerDep, metrics: MetricsDep) -> Any:
    chat = to_chat(body, manager.settings)
    started = await start(request, manager, metrics, chat, "chat")
    if isinstance(started, JSONResponse):
        return started
    mid = "msg_" + uuid.uuid4().hex[:24]
    if body.stream:
        return StreamingResponse(_stream(request, started, mid), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    answers = await collect(request, metrics, started)
    a = answers[0]
    content: list[dict[str, Any]] = []
    if a.reasoning:
        content.append({"type": "thinking", "thinking": a.reasoning, "signature": ""})
    if a.content or not a.calls:
        content.append({"type": "text", "text": a.content})
    for c in a.calls:
        content.append({"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": _input(c.arguments)})
    reason, stop = _stop_reason(a)
    return {"id": mid, "type": "message", "role": "assistant", "model": started.name, "content": content,
            "stop_reason": reason, "stop_sequence": stop, "usage": _usage(a)}


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode("utf-8")


async def _stream(request: Request, started: Started, mid: str) -> AsyncIterator[bytes]:
    timer = started.timer
    answer = Answer()
    block = -1
    open_kind: str | None = None

    def start_block(kind: str, extra: dict[str, Any]) -> list[bytes]:
        nonlocal block, open_kind
        out = close_block()
        block += 1
        open_kind = kind
        out.append(_event("content_block_start", {"type": "content_block_start", "index": block,
                                                  "content_block": {"type": kind, **extra}}))
        return out

    def close_block() -> list[bytes]:
        nonlocal open_kind
        if open_kind is None:
            return []
        open_kind = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": block})]

    def delta(d: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": block, "delta": d})

    def on(e: Event) -> list[bytes]:
        out: list[bytes] = []
        if e.kind == "reasoning":
            if open_kind != "thinking":
                out += start_block("thinking", {"thinking": "", "signature": ""})
            out.append(delta({"type": "thinking_delta", "thinking": e.text}))
        elif e.kind == "content":
            if open_kind != "text":
                out += start_block("text", {"text": ""})
            out.append(delta({"type": "text_delta", "text": e.text}))
        elif e.kind == "tool" and e.tool is not None:
            if e.tool.id is not None:
                out += start_block("tool_use", {"id": _tool_id(e.tool.id), "name": e.tool.name, "input": {}})
            elif open_kind == "tool_use" and e.tool.arguments:
                out.append(delta({"type": "input_json_delta", "partial_json": e.tool.arguments}))
        return out

    try:
        yield _event("message_start", {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": started.name, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0}}})
        yield _event("ping", {"type": "ping"})
        async for c in started.results:
            if c.text or c.logprobs:
                timer.tick(len(c.tokens))
            for e in started.choices.feed(c):
                answer.add(e)
                for data in on(e):
                    yield data
        for data in close_block():
            yield data
        timer.generation(answer.last)
        reason, stop = _stop_reason(answer)
        yield _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop},
                                       "usage": _usage(answer)})
        yield _event("message_stop", {"type": "message_stop"})
    except ServiceError as exc:
        _, body = service_error_body(exc, request.url.path)
        timer.metrics.error(code_of(exc, request.url.path))
        yield _event("error", body)
    except Exception:  # a server fault mid-stream: the stream still ends with an error event
        err = EngineFailure("the stream failed")
        _, body = service_error_body(err, request.url.path)
        timer.metrics.error(code_of(err, request.url.path))
        yield _event("error", body)
    finally:
        started.cancel.set()


@router.post("/messages/count_tokens")
async def count_tokens(request: Request, body: CountTokensRequest, manager: ManagerDep) -> dict[str, int]:
    """The prompt tokens a /v1/messages request with these messages, system and tools evaluates (its
    ``input_tokens`` plus ``cache_read_input_tokens``): the same rendering and tokens, counted off the engine's
    queue (``service.api.admission``)."""
    n = await chat_prompt_tokens(request, manager, to_chat(body, manager.settings), "messages")
    return {"input_tokens": n}
