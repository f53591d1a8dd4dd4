"""OpenAI's Responses API: ``POST /v1/responses``, ``POST /v1/responses/input_tokens``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

A request becomes the chat request /v1/chat/completions takes (``to_chat``) and runs through the same path
(``generation.start``: the same checks, grammar, queue, engine, limits and auth), its answer read through
``service.chat.choices`` and written as Responses output items:

- ``input``: a string, or items: ``message`` (roles user, assistant, system, developer; ``input_text`` and
  ``output_text`` parts), ``function_call`` and ``function_call_output`` (a call's result answers an earlier call of
  its ``call_id``), ``reasoning`` (earlier thinking, not shown to the model again); ``input_image`` parts of user
  messages (``service.api.images``); files, audio,
  ``item_reference`` and hosted tools' items are 400s naming the item. ``instructions`` is the system message.
- ``tools``: function tools (``name``, ``description``, ``parameters``, ``strict``), constrained as chat tools are;
  ``tool_choice`` ``auto``, ``none``, ``required``, ``{"type": "function", "name"}`` or ``allowed_tools``; hosted
  tools (web search, file search, computer, code interpreter, MCP...) are 400s.
- ``text.format``: ``text``, ``json_object`` or ``json_schema`` (the bounded grammar path of ``response_format``).
- output items in order: ``reasoning`` where the model thinks (its text as ``reasoning_text`` content, and as the
  summary when ``reasoning.summary`` asks for one: no model summarises its thinking here), ``message`` with
  ``output_text``, ``function_call`` per call; ``status`` ``incomplete`` (``max_output_tokens``) when cut.
- ``stream``: ``response.created``, ``response.in_progress``, per item ``response.output_item.added`` / its deltas
  (``response.output_text.delta``, ``response.function_call_arguments.delta``, ``response.reasoning_text.delta``,
  ``response.reasoning_summary_text.delta``) / their ``.done`` / ``response.output_item.done``, then
  ``response.completed`` or ``response.incomplete``; a failure during generation is an ``error`` event then
  ``response.failed``. Every event has its ``sequence_number``; no ``[DONE]`` (OpenAI sends none here).
- ``store`` (default true) keeps the response for ``previous_response_id`` and the GET routes, per API key, within
  ``GGUF_RESPONSES_STORE_MIB`` (``service.api.response_store``). A later turn continues the stored conversation; as at
  OpenAI, its ``instructions`` and ``tools`` are not carried over.
- usage: ``input_tokens`` (``cached_tokens`` those a slot or the prompt cache held), ``output_tokens``
  (``reasoning_tokens``: the thinking's text tokenized again).

Not built, refused by name: ``background``, ``conversation``, ``prompt`` (stored prompt templates), ``truncation``
``auto``. Accepted and without effect: ``max_tool_calls`` (it bounds hosted tools' calls), ``prompt_cache_key``,
``safety_identifier``, ``service_tier``, ``text.verbosity``, ``reasoning.effort`` (the template decides whether the
model thinks).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..chat.choices import Answer, Event
from ..chat.tools import check_call_id, check_name
from ..engine.base import TokenLogprob
from ..errors import BadRequest, EngineFailure, NotFound, PreviousResponseNotFound, ServiceError
from .deps import ManagerDep, MetricsDep
from .errors import code_of, param_of, service_error_body
from .generation import Started, chat_prompt_tokens, collect, start
from .openai_wire import MAX_TOP_LOGPROBS, ChatRequest
from .response_store import ResponseStore, StoredResponse, owner_of, size_of
from .security import presented_key
from .validation import KeepAlive

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1")

MAX_INPUT_ITEMS = 4096
"""Most input items of one request."""
MAX_METADATA = 16
"""OpenAI's bounds on ``metadata``: 16 pairs, keys of 64 characters, values of 512."""
LOGPROBS_INCLUDE = "message.output_text.logprobs"
HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "computer", "computer_use_preview",
                "code_interpreter", "image_generation", "mcp", "local_shell", "shell", "apply_patch", "custom")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = Field(None, max_length=4096)


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class InputTokensRequest(BaseModel):
    """What ``/v1/responses/input_tokens`` counts: the parts of a request that make its prompt."""

    model_config = ConfigDict(extra="ignore", strict=True)  # JSON's own types (``openai_wire.STRICT``)

    model: str | None = Field(None, max_length=256)
    input: str | list[dict[str, Any]] = Field("", description="A string (one user message) or input items.")
    instructions: str | None = Field(None, description="The system message (not carried over by "
                                     "previous_response_id).")
    tools: list[dict[str, Any]] | None = Field(None, description="Function tools only.")
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = Field(None, max_length=256)
    truncation: Literal["auto", "disabled"] | None = None
    conversation: Any = Field(None, description="Not supported (the Conversations API): a 400.")


class ResponsesRequest(InputTokensRequest):
    max_output_tokens: int | None = Field(None, ge=1, description="Absent: GGUF_MAX_TOKENS_DEFAULT.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0, le=1 << 20, description="llama.cpp extension: keep the k most likely "
                              "tokens.")
    seed: int | None = Field(None, ge=-1, le=2 ** 32 - 1, description="llama.cpp extension: sampling seed.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = Field(None, max_length=16, description=f"{LOGPROBS_INCLUDE!r} adds log "
                                      "probabilities; other values are accepted and add nothing.")
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, max_length=256)
    max_tool_calls: int | None = Field(None, ge=1)
    background: bool | None = Field(None, description="Not supported: true is a 400.")
    prompt: Any = Field(None, description="Not supported (stored prompt templates): a 400.")
    cache_salt: str | None = Field(None, max_length=256)
    keep_alive: KeepAlive = None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _store(request: Request) -> ResponseStore:
    store: ResponseStore = request.app.state.responses
    return store


def _owner(request: Request) -> str:
    """Whose stored responses the request sees: its API key's, when keys are configured."""
    if not getattr(request.app.state, "api_keys", ()):
        return ""
    return owner_of(presented_key(request.scope["headers"]))


def _text_parts(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """The text of a string or of text parts (``input_text``, ``output_text``...)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}: a string or a list of content parts", param=where)
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise BadRequest(f"{where}[{k}].type: {kind} parts are not supported here"
                             + (" (images go in user messages)" if kind == "input_image" else " (text only)"),
                             param=f"{where}[{k}].type")
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
            continue
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}[{k}]: a text part {{\"type\": {' | '.join(repr(x) for x in kinds)}, \"text\": "
                             "string}", param=f"{where}[{k}]")
        out.append(part["text"])
    return "".join(out)


def _user_parts(content: list[Any], where: str) -> list[dict[str, Any]]:
    """A user message's ``input_text`` and ``input_image`` parts as chat content parts (an image's ``image_url``:
    a data: URL, or one of a host GGUF_IMAGE_URL_HOSTS names; decoded at admission, ``service.api.images``)."""
    out: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise BadRequest(f"{where}[{k}].image_url: a data: or http(s) URL (file_id is not supported)",
                                 param=f"{where}[{k}].image_url")
            out.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise BadRequest(f"{where}[{k}]: an input_text or input_image part", param=f"{where}[{k}]")
    return out


def _messages(items: str | list[dict[str, Any]], called: set[str]) -> tuple[list[dict[str, Any]], list[str],
                                                                           list[dict[str, Any]]]:
    """Input items as chat messages, the param each message came from, and the items as stored (each with an id).

    ``called``: the call ids earlier turns made; a ``function_call_output`` answers one of them or a
    ``function_call`` before it (OpenAI: "No tool call found for function call output with call_id ..."); ids and
    names reach the prompt, so they are checked as chat's are."""
    if items == "":
        return [], [], []
    if isinstance(items, str):
        return ([{"role": "user", "content": items}], ["input"],
                [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items}],
                  "id": _new_id("msg")}])
    if len(items) > MAX_INPUT_ITEMS:
        raise BadRequest(f"input: at most {MAX_INPUT_ITEMS} items", param="input")
    out: list[dict[str, Any]] = []
    origin: list[str] = []
    stored: list[dict[str, Any]] = []
    for j, item in enumerate(items):
        where = f"input[{j}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where}: an input item (an object)", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(f"{where}.role: user, assistant, system or developer", param=f"{where}.role")
            kinds = ("output_text", "input_text") if role == "assistant" else ("input_text",)
            content = item.get("content")
            if role == "user" and isinstance(content, list) and any(
                    isinstance(p, dict) and p.get("type") == "input_image" for p in content):
                out.append({"role": role, "content": _user_parts(content, f"{where}.content")})
            else:
                out.append({"role": role, "content": _text_parts(content, f"{where}.content", kinds)})
            origin.append(where)
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments", "")
            call_id = check_call_id(item.get("call_id"), f"{where}.call_id")
            check_name(name, f"{where}.name")
            if not isinstance(arguments, str):
                raise BadRequest(f"{where}.arguments: a string (the call's JSON)", param=f"{where}.arguments")
            if call_id in called:
                raise BadRequest(f"{where}.call_id: the call id {call_id[:64]!r} is used twice", param=f"{where}.call_id")
            called.add(call_id)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and origin[-1] != "previous_response_id":
                last.setdefault("tool_calls", []).append(call)  # one turn's calls are one assistant message
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origin.append(where)
        elif kind == "function_call_output":
            call_id = check_call_id(item.get("call_id"), f"{where}.call_id")
            if call_id not in called:
                raise BadRequest(f"{where}.call_id: no function_call before it has the call_id {call_id[:64]!r}",
                                 param=f"{where}.call_id")
            text = _text_parts(item.get("output"), f"{where}.output", ("input_text", "output_text"))
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            origin.append(where)
        elif kind == "reasoning":
            pass  # earlier thinking is not shown to the model again
        elif kind == "item_reference":
            raise BadRequest(f"{where}: item_reference is not supported: send the item itself, or continue a stored "
                             "response with previous_response_id", param=f"{where}.type")
        else:
            raise BadRequest(f"{where}.type: {str(kind)[:40]!r} items are not supported (messages, function calls "
                             "and their outputs)", param=f"{where}.type")
        if kind != "reasoning":
            kept = dict(item)
            kept["type"] = kind
            if not isinstance(kept.get("id"), str):
                kept["id"] = _new_id({"message": "msg", "function_call": "fc"}.get(kind, "fco"))
            stored.append(kept)
    return out, origin, stored


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools as chat tools."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            hosted = kind in HOSTED_TOOLS or (isinstance(kind, str) and kind.startswith("web_search"))
            raise BadRequest(f"tools[{i}].type: only function tools are supported"
                             + (f" ({kind} is a tool OpenAI runs)" if hosted else ""), param=f"tools[{i}].type")
        fn: dict[str, Any] = {"name": t.get("name")}
        for key in ("description", "parameters", "strict"):
            if t.get(key) is not None:
                fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    return out


def _choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None) -> tuple[Any, Any]:
    """(chat's tool_choice, the tools it leaves) for a Responses ``tool_choice``."""
    if choice is None or isinstance(choice, str):
        return choice, tools
    kind = choice.get("type")
    if kind == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, tools
    if kind == "allowed_tools" and choice.get("mode") in ("auto", "required") and isinstance(choice.get("tools"), list):
        names = {t.get("name") for t in choice["tools"] if isinstance(t, dict) and t.get("type") == "function"}
        kept = [t for t in tools or [] if t["function"].get("name") in names]
        if len(names) != len(choice["tools"]) or len(kept) != len(names):
            raise BadRequest("tool_choice.tools: function tools among the request's tools", param="tool_choice.tools")
        return choice["mode"], kept
    raise BadRequest("tool_choice: 'none', 'auto', 'required', {\"type\": \"function\", \"name\": ...} or "
                     "{\"type\": \"allowed_tools\", \"mode\", \"tools\"} (hosted tools are not supported)",
                     param="tool_choice")


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise BadRequest("text.format.schema: a json_schema format needs its schema", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                   "strict": fmt.strict}}


def _refuse_unsupported(body: InputTokensRequest) -> None:
    if body.conversation is not None:
        raise BadRequest("conversation: the Conversations API is not supported; continue a stored response with "
                         "previous_response_id", param="conversation")
    if body.truncation == "auto":
        raise BadRequest("truncation: only 'disabled' is supported (a conversation beyond the context is a 400, "
                         "never silently cut)", param="truncation")
    if isinstance(body, ResponsesRequest):
        if body.background:
            raise BadRequest("background: background responses are not supported", param="background")
        if body.prompt is not None:
            raise BadRequest("prompt: stored prompt templates are not supported", param="prompt")
        meta = body.metadata or {}
        if len(meta) > MAX_METADATA or any(len(k) > 64 or len(v) > 512 for k, v in meta.items()):
            raise BadRequest(f"metadata: at most {MAX_METADATA} pairs, keys of 64 characters and values of 512",
                             param="metadata")


class Conversation:
    """A request's conversation: the stored turns it continues, its own input items, as chat messages."""

    def __init__(self, request: Request, body: InputTokensRequest) -> None:
        _refuse_unsupported(body)
        self.owner = _owner(request)
        earlier: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            prev = _store(request).get(self.owner, body.previous_response_id)
            if prev is None:
                raise PreviousResponseNotFound(f"Previous response with id '{body.previous_response_id[:64]}' not "
                                               "found.", param="previous_response_id")
            earlier = prev.messages
        called = {c["id"] for m in earlier for c in m.get("tool_calls") or ()}
        own, origin, self.items = _messages(body.input, called)
        self.earlier = earlier
        self.own = own
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        self.messages = system + earlier + own
        self.origin = ["instructions"] * len(system) + ["previous_response_id"] * len(earlier) + origin
        if not own:
            raise BadRequest("input: at least one message or function_call_output", param="input")

    def chat(self, body: InputTokensRequest, settings: Any) -> ChatRequest:
        """The chat request for this conversation (validation errors as 400s naming the Responses field)."""
        tools = _tools(body.tools)
        choice, tools = _choice(body.tool_choice, tools)
        data: dict[str, Any] = {"model": body.model, "messages": self.messages, "tools": tools,
                                "parallel_tool_calls": (body.parallel_tool_calls if body.parallel_tool_calls is not None
                                                        else settings.parallel_tool_calls),
                                "response_format": _response_format(body.text),
                                "reasoning_format": "none" if settings.reasoning_format == "none" else "separate"}
        if choice is not None and (tools or choice not in ("auto", "none")):
            data["tool_choice"] = choice
        if isinstance(body, ResponsesRequest):
            data.update({"max_tokens": body.max_output_tokens, "cache_salt": body.cache_salt,
                         "keep_alive": body.keep_alive})
            for key in ("temperature", "top_p", "top_k", "seed"):
                if getattr(body, key) is not None:
                    data[key] = getattr(body, key)
            if LOGPROBS_INCLUDE in (body.include or ()):
                data.update({"logprobs": True, "top_logprobs": body.top_logprobs or 0})
        try:
            chat = ChatRequest.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = self._param(param_of(tuple(first.get("loc", ()))))
            raise BadRequest(f"{param}: {first.get('msg', 'invalid value')}", param=param) from None
        try:
            chat.check_messages()
        except BadRequest as exc:
            param = self._param(exc.param)
            raise BadRequest(exc.message.replace(exc.param or "", param or ""), param=param) from None
        return chat

    def _param(self, param: str | None) -> str | None:
        """Chat's ``messages[i]...`` as the field of the Responses request it came from."""
        if param is None or not param.startswith("messages["):
            return {"max_tokens": "max_output_tokens", "response_format": "text.format"}.get(param or "", param)
        index, _, rest = param[len("messages["):].partition("]")
        try:
            return self.origin[int(index)] + rest
        except (ValueError, IndexError):
            return param


def _logprobs(lps: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [{"token": t.token, "bytes": list(t.bytes_), "logprob": t.logprob,
             "top_logprobs": [{"token": s, "bytes": list(s.encode()), "logprob": v} for s, v in t.top]} for t in lps]


class Output:
    """The response being written: its output items in order, and the object that carries them."""

    def __init__(self, body: ResponsesRequest, chat: ChatRequest, model: str) -> None:
        self.id = _new_id("resp")
        self.created = int(time.time())
        self.body = body
        self.chat = chat
        self.model = model
        self.items: list[dict[str, Any]] = []
        self.summary = (body.reasoning.summary or body.reasoning.generate_summary) is not None \
            if body.reasoning is not None else False

    def reasoning(self, text: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": _new_id("rs"), "status": "completed",
                "summary": [{"type": "summary_text", "text": text}] if self.summary and text else [],
                "content": [{"type": "reasoning_text", "text": text}] if text else []}

    def message(self, text: str, logprobs: list[TokenLogprob], status: str) -> dict[str, Any]:
        return {"type": "message", "id": _new_id("msg"), "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": _logprobs(logprobs)}]}

    @staticmethod
    def call(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id,
                "name": name, "arguments": arguments, "status": status}

    def whole(self, a: Answer) -> None:
        """The output items of an answer read whole."""
        status = "incomplete" if a.finish_reason == "length" else "completed"
        if a.reasoning:
            self.items.append(self.reasoning(a.reasoning))
        if a.content or not a.calls:
            self.items.append(self.message(a.content, a.logprobs, status))
        for c in a.calls:
            self.items.append(self.call(c.id, c.name, c.arguments, status))

    def object(self, status: str, usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        body, chat = self.body, self.chat
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format \
            else {"type": "text"}
        tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"].get("description"),
                  "parameters": t["function"].get("parameters"), "strict": t["function"].get("strict")}
                 for t in chat.tools or ()]
        choice = body.tool_choice if body.tool_choice is not None else "auto"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "model": self.model, "output": self.items,
            "parallel_tool_calls": bool(chat.parallel_tool_calls),
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                          "summary": (body.reasoning.summary or body.reasoning.generate_summary)
                          if body.reasoning else None},
            "service_tier": "default", "store": body.store, "temperature": chat.temperature,
            "text": {"format": fmt, "verbosity": (body.text.verbosity if body.text else None) or "medium"},
            "tool_choice": choice, "tools": tools, "top_logprobs": body.top_logprobs or 0, "top_p": chat.top_p,
            "truncation": "disabled", "usage": usage, "user": body.user, "metadata": body.metadata or {},
        }


async def _usage(request: Request, started: Started, a: Answer) -> dict[str, Any]:
    last = a.last
    reasoning = 0
    if a.reasoning:
        # The thinking's tokens, counted again from its text (the engine counts a generation's tokens whole), by the
        # model while it is resident: never a load for a count.
        state = request.app.state.manager.resident(started.name)
        engine = state.engine if state is not None and state.serving else None
        if engine is not None:
            try:
                reasoning = len(await request.app.state.admission.run(
                    started.name, len(a.reasoning), lambda: engine.tokenize_text(a.reasoning, False, False)))
            except Exception:  # unloaded meanwhile: the count is what is lost, not the answer
                log.debug("reasoning tokens not counted: %s is gone", started.name)
        reasoning = min(reasoning, last.completion_tokens)
    return {"input_tokens": last.prompt_tokens, "input_tokens_details": {"cached_tokens": last.cached_tokens},
            "output_tokens": last.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": last.prompt_tokens + last.completion_tokens}


def _keep(request: Request, conv: Conversation, out: Output, response: dict[str, Any], a: Answer) -> None:
    """Store the response (``store``), with the conversation a later turn continues."""
    if not out.body.store:
        return
    turn: dict[str, Any] = {"role": "assistant", "content": a.content or None}
    if a.calls:
        turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                              for c in a.calls]
    messages = conv.earlier + conv.own + [turn]
    stored = StoredResponse(response=response, input_items=conv.items, messages=messages,
                            nbytes=size_of(response, conv.items, messages))
    if not _store(request).put(conv.owner, out.id, stored):
        log.warning("response %s not stored: %d bytes, beyond GGUF_RESPONSES_STORE_MIB", out.id, stored.nbytes)


@router.post("/responses")
async def create(request: Request, body: ResponsesRequest, manager: ManagerDep, metrics: MetricsDep) -> Any:
    conv = Conversation(request, body)
    chat = conv.chat(body, manager.settings)
    started = await start(request, manager, metrics, chat, "chat")
    if isinstance(started, JSONResponse):
        return started
    out = Output(body, chat, started.name)
    if body.stream:
        return StreamingResponse(_stream(request, started, conv, out), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    a = (await collect(request, metrics, started))[0]
    out.whole(a)
    response = out.object("incomplete" if a.finish_reason == "length" else "completed",
                          await _usage(request, started, a))
    _keep(request, conv, out, response, a)
    return response


class _Events:
    """A stream's events, numbered, and the output item open now."""

    def __init__(self, out: Output) -> None:
        self.out = out
        self.seq = 0
        self.open: dict[str, Any] | None = None
        self.text = ""
        self.logprobs: list[TokenLogprob] = []

    def event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()

    def _index(self) -> int:
        return len(self.out.items)

    def begin(self, item: dict[str, Any]) -> list[bytes]:
        out = self.close("completed")
        self.open, self.text, self.logprobs = item, "", []
        where = {"item_id": item["id"], "output_index": self._index()}
        out.append(self.event("response.output_item.added", output_index=self._index(), item=item))
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", **where, content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        elif item["type"] == "reasoning" and self.out.summary:
            out.append(self.event("response.reasoning_summary_part.added", **where, summary_index=0,
                                  part={"type": "summary_text", "text": ""}))
        return out

    def delta(self, kind: str, text: str) -> list[bytes]:
        """``text`` into an item of ``kind`` (opened when another is open)."""
        out: list[bytes] = []
        if self.open is None or self.open["type"] != kind:
            out += self.begin({"type": "message", "id": _new_id("msg"), "status": "in_progress", "role": "assistant",
                               "content": []} if kind == "message" else
                              {"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": []})
        assert self.open is not None
        self.text += text
        where = {"item_id": self.open["id"], "output_index": self._index()}
        if kind == "message":
            out.append(self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]))
        else:
            out.append(self.event("response.reasoning_text.delta", **where, content_index=0, delta=text))
            if self.out.summary:
                out.append(self.event("response.reasoning_summary_text.delta", **where, summary_index=0, delta=text))
        return out

    def call(self, call_id: str, name: str) -> list[bytes]:
        return self.begin(self.out.call(call_id, name, "", "in_progress"))

    def arguments(self, text: str) -> list[bytes]:
        if self.open is None or self.open["type"] != "function_call" or not text:
            return []
        self.text += text
        return [self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                           output_index=self._index(), delta=text)]

    def close(self, status: str) -> list[bytes]:
        """The open item's ``.done`` events; the item joins the output."""
        item, out = self.open, list[bytes]()
        if item is None:
            return out
        self.open = None
        where = {"item_id": item["id"], "output_index": self._index()}
        if item["type"] == "message":
            done = self.out.message(self.text, self.logprobs, status)
            done["id"] = item["id"]
            part = done["content"][0]
            out.append(self.event("response.output_text.done", **where, content_index=0, text=self.text,
                                  logprobs=part["logprobs"]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        elif item["type"] == "reasoning":
            done = self.out.reasoning(self.text)
            done["id"] = item["id"]
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=self.text))
            if self.out.summary:
                out.append(self.event("response.reasoning_summary_text.done", **where, summary_index=0, text=self.text))
                out.append(self.event("response.reasoning_summary_part.done", **where, summary_index=0,
                                      part={"type": "summary_text", "text": self.text}))
        else:
            done = self.out.call(item["call_id"], item["name"], self.text, status)
            out.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=self.text))
        out.append(self.event("response.output_item.done", output_index=self._index(), item=done))
        self.out.items.append(done)
        return out

    def on(self, e: Event) -> list[bytes]:
        if e.kind == "content":
            return self.delta("message", e.text)
        if e.kind == "reasoning":
            return self.delta("reasoning", e.text)
        if e.kind == "tool" and e.tool is not None:
            return self.call(e.tool.id, e.tool.name or "") if e.tool.id is not None else self.arguments(e.tool.arguments)
        if e.kind == "logprobs" and self.open is not None and self.open["type"] == "message":
            self.logprobs += list(e.logprobs)
        return []


async def _stream(request: Request, started: Started, conv: Conversation, out: Output) -> AsyncIterator[bytes]:
    timer = started.timer
    events = _Events(out)
    answer = Answer()
    try:
        yield events.event("response.created", response=out.object("in_progress"))
        yield events.event("response.in_progress", response=out.object("in_progress"))
        async for c in started.results:
            if c.text or c.logprobs:
                timer.tick(len(c.tokens))
            for e in started.choices.feed(c):
                answer.add(e)
                for data in events.on(e):
                    yield data
        status = "incomplete" if answer.finish_reason == "length" else "completed"
        if events.open is None and not out.items:
            for data in events.begin(out.message("", [], "in_progress")):
                yield data
        for data in events.close(status):
            yield data
        timer.generation(answer.last)
        response = out.object(status, await _usage(request, started, answer))
        _keep(request, conv, out, response, answer)
        yield events.event(f"response.{status}", response=response)
    except Exception as exc:  # a failure during generation: an error event, then the failed response
        if not isinstance(exc, ServiceError):
            log.exception("stream failed")
            exc = EngineFailure(f"the stream failed: {type(exc).__name__}")
        _, body = service_error_body(exc, request.url.path)
        timer.metrics.error(code_of(exc, request.url.path))
        err = body.get("error", {})
        yield events.event("error", code=err.get("code"), message=err.get("message", exc.message),
                           param=err.get("param"))
        yield events.event("response.failed", response=out.object(
            "failed", error={"code": err.get("code") or "server_error", "message": err.get("message", exc.message)}))
    finally:
        started.cancel.set()


@router.post("/responses/input_tokens")
async def input_tokens(request: Request, body: InputTokensRequest, manager: ManagerDep) -> dict[str, Any]:
    """The prompt tokens a /v1/responses request with this input, instructions, tools and previous response
    evaluates (its ``usage.input_tokens``): the same rendering and tokens, counted off the engine's queue."""
    chat = Conversation(request, body).chat(body, manager.settings)
    n = await chat_prompt_tokens(request, manager, chat, "input")
    return {"object": "response.input_tokens", "input_tokens": n}


def _stored(request: Request, response_id: str) -> StoredResponse:
    entry = _store(request).get(_owner(request), response_id)
    if entry is None:
        raise NotFound(f"Response with id '{response_id[:64]}' not found.", param="response_id")
    return entry


@router.get("/responses/{response_id}")
async def retrieve(request: Request, response_id: str) -> dict[str, Any]:
    """A stored response, as it was answered."""
    return _stored(request, response_id).response


@router.delete("/responses/{response_id}")
async def delete(request: Request, response_id: str) -> dict[str, Any]:
    if not _store(request).delete(_owner(request), response_id):
        raise NotFound(f"Response with id '{response_id[:64]}' not found.", param="response_id")
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/responses/{response_id}/input_items")
async def input_items(request: Request, response_id: str, limit: int = Query(20, ge=1, le=100),
                      order: Literal["asc", "desc"] = "desc", after: str | None = Query(None, max_length=256)
                      ) -> dict[str, Any]:
    """A stored response's own input items (``order`` desc by default, as OpenAI lists them), ``limit`` after the
    item ``after``."""
    items = list(_stored(request, response_id).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise BadRequest(f"after: no input item {after[:64]!r} in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


__all__ = ["InputTokensRequest", "ResponsesRequest", "router"]
