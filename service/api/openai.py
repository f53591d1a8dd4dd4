"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models.

Every check that can fail a request (model, n, schema, tools, context) runs before the
first byte, so a refused streamed request is a plain HTTP error; a failure
during generation ends a stream with the error event and ``[DONE]``.

Tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``, ``tool`` messages and
``tool_calls`` in the history) goes through the model's chat template and native call format
(``service.engine.chat_format``, ``service.api.tools``); thinking is split into
``reasoning_content`` (``service.api.reasoning``, ``GGUF_REASONING_FORMAT``); ``n`` choices share
the prompt's evaluation; ``logit_bias`` is a sampler. What is not built is refused, never silently
ignored: ``functions``/``function_call`` (deprecated by OpenAI), ``best_of``, ``suffix``, audio
output and image/audio/file content parts get a 400 naming the field.
A grammar (``response_format``, or the tools') is compiled off the engine thread, with a time limit
(``GGUF_GRAMMAR_TIMEOUT_S``), before the request is queued; a client that leaves stops waiting for it.

``_start`` is the one generation path: /v1/messages (``service.api.anthropic``) uses it too.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import re
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Iterator, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..engine.base import Cancel, Chunk, GenerationParams, TokenLogprob
from ..engine.chat_format import ChatFormat
from ..engine.grammar import check_schema_bounds, grammar_source
from ..engine.grammar_worker import compiler as grammar_compiler
from ..errors import BadRequest, ContextLengthExceeded, EngineFailure, ModelNotFound, ServiceError
from ..keepalive import parse_keep_alive
from ..manager import Lease, ModelManager
from ..runner import chunks
from .admission import LARGE_TEXT_CHARS, prompt_tokens
from .choices import Answer, Choices, Event, json_constraint, tool_calls_json, usage_last
from .deps import ManagerDep, MetricsDep
from .errors import service_error_body, sse
from .metrics import Metrics
from .reasoning import ReasoningFormat
from .tools import check_call_id, check_name, check_tools, tool_grammar
from .validation import KeepAlive, check_json_depth, reject_surrogates

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1")

MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**32 - 1
"""llama.cpp seeds are uint32 (``llama_sampler_init_dist``); -1 means random, as in llama-server."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for /v1/completions when max_tokens is absent or null."""


def _neutral(value: Any) -> bool:
    """A value that asks for nothing: what clients send for a feature they do not use."""
    return value is None or value == [] or value == {} or value == "" or value == "none"


UNSUPPORTED_FIELDS: dict[str, str] = {
    "functions": "the deprecated functions API is not supported; use tools",
    "function_call": "the deprecated functions API is not supported; use tool_choice",
}
"""Fields refused (400, param names the field) unless neutral (null, empty, "none")."""
MAX_LOGIT_BIAS = 1024
"""Most ``logit_bias`` entries (OpenAI allows 300 tokens of one tokenizer; a bound, not a target)."""
_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,8}")
"""A ``logit_bias`` key (``fullmatch``): a token id as canonical decimal, ASCII digits without a sign, a leading zero
or whitespace (``"5\\n"`` and ``"05"`` are not ids; ``$`` in a ``match`` would allow the trailing newline)."""


STRICT = ConfigDict(strict=True)
"""Request models take JSON's own types: ``"n": "2"``, ``"stream": "true"``, ``"max_tokens": 5.0`` or ``true`` for an
integer are 400s naming the field, as OpenAI answers them ("Invalid type for 'n': expected an integer, but got a
string instead"), where pydantic's lax mode would coerce them. Integers are still numbers (``"temperature": 1``)."""


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


def _float(default: float, **bounds: float) -> Any:
    return Field(default, allow_inf_nan=False, **bounds)  # type: ignore[arg-type]


class JsonSchemaFormat(BaseModel):
    model_config = STRICT

    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = Field(None, max_length=256)
    max_tokens: int | None = Field(None, ge=1, description="Absent or null: 16 on /v1/completions (OpenAI's "
                                   "default), GGUF_MAX_TOKENS_DEFAULT on /v1/chat/completions.")
    temperature: float = _float(1.0, ge=0.0, le=2.0)
    top_p: float = _float(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1 << 20, description="llama.cpp server extension: keep the k most likely tokens (0: all).")
    frequency_penalty: float = _float(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = _float(0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-1, le=MAX_SEED, description="0 .. 2^32-1 (llama.cpp's uint32); -1: random.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128, description="Choices: at most the engine's slots (GGUF_PARALLEL), else 400; "
                   "the prompt is evaluated once and shared.")
    response_format: ResponseFormat | None = None
    user: str | None = Field(None, max_length=256)
    ignore_eos: bool = Field(False, description="llama.cpp server extension: generate past end-of-generation tokens.")
    functions: Any = Field(None, description="Not supported (deprecated): anything but null or [] is a 400.")
    function_call: Any = Field(None, description="Not supported (deprecated): anything but null or \"none\" is a 400.")
    logit_bias: dict[str, Any] | None = Field(None, description="Token id (a string) to a bias -100..100 added to "
                                               "its logit; -100 bans the token. Unknown ids: 400.")
    cache_prompt: bool = Field(True, description="llama.cpp server extension: reuse a slot's cached prefix of the prompt.")
    keep_alive: KeepAlive = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return v

    def logprobs_n(self) -> int | None:
        """None: no log probabilities; k: the sampled token's and k alternatives'."""
        return None

    def refuse_unsupported(self) -> None:
        """400 for a field whose feature is not built (see ``UNSUPPORTED_FIELDS``)."""
        for name, why in self.unsupported_fields().items():
            if not _neutral(getattr(self, name, None)):
                raise BadRequest(f"{name}: {why}", param=name)

    def unsupported_fields(self) -> dict[str, str]:
        return UNSUPPORTED_FIELDS

    def bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs; -100 is a ban (-inf), as OpenAI documents it."""
        if not self.logit_bias:
            return ()
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise BadRequest(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
        out = []
        for key, value in self.logit_bias.items():
            if not _TOKEN_ID.fullmatch(key):
                raise BadRequest(f"logit_bias: keys are token ids (decimal strings), not {key[:40]!r}", param="logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not -100 <= value <= 100:
                raise BadRequest(f"logit_bias[{key}]: a number from -100 to 100", param="logit_bias")
            out.append((int(key), float("-inf") if value <= -100 else float(value)))
        return tuple(out)

    def params(self, default_max_tokens: int = COMPLETIONS_DEFAULT_MAX_TOKENS) -> GenerationParams:
        self.refuse_unsupported()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        json_schema = None
        json_object = False
        rf = self.response_format
        if rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise BadRequest("response_format json_schema needs json_schema.schema", param="response_format")
            check_schema_bounds(rf.json_schema.schema_)  # before json.dumps: a deep schema must not recurse
            json_schema = json.dumps(rf.json_schema.schema_)
        elif rf is not None and rf.type == "json_object":
            json_object = True
        return GenerationParams(
            max_tokens=self.requested_max_tokens() or default_max_tokens, temperature=self.temperature,
            top_p=self.top_p, stop=stop, seed=None if self.seed == -1 else self.seed,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            logprobs=self.logprobs_n(), json_schema=json_schema, json_object=json_object, ignore_eos=self.ignore_eos,
            cache_prompt=self.cache_prompt, logit_bias=self.bias(), n=self.n, top_k=self.top_k,
        )

    def requested_max_tokens(self) -> int | None:
        """The client's own limit (None: it gave none and the server's default applies)."""
        return self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, description="Not supported: anything but null or 1 is a 400.")
    suffix: str | None = Field(None, description="Not supported: anything but null or \"\" is a 400.")

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.best_of not in (None, 1):
            raise BadRequest("best_of: only one completion per request is supported (best_of 1)", param="best_of")
        if self.suffix:
            raise BadRequest("suffix: inserting text before a suffix is not supported", param="suffix")

    def logprobs_n(self) -> int | None:
        return self.logprobs

    def prompt_text(self) -> str:
        if self.echo:
            raise BadRequest("echo is not supported", param="echo")
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise BadRequest("exactly one prompt is supported", param="prompt")
            return self.prompt[0]
        return self.prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def check(self, i: int) -> None:
        """400 for what this server cannot honour in a message (non-text parts, NUL characters), for tool turns
        that are not OpenAI's shape (a ``tool`` message names its call, an assistant's calls are functions), and
        for names and call ids beyond their safe characters (``tools.NAME``, ``tools.CALL_ID``: they reach the
        prompt, and OpenAI refuses the same)."""
        where = f"messages[{i}]"
        extra = self.model_extra or {}
        for name in ("function_call", "audio"):
            if not _neutral(extra.get(name)):
                raise BadRequest(f"{where}.{name}: not supported", param=f"{where}.{name}")
        if self.role == "tool" and not (isinstance(extra.get("tool_call_id"), str) and extra["tool_call_id"]):
            raise BadRequest(f"{where}.tool_call_id: a tool message names the call it answers", param=f"{where}.tool_call_id")
        if extra.get("tool_call_id") is not None:
            check_call_id(extra["tool_call_id"], f"{where}.tool_call_id")
        if extra.get("name") is not None:
            check_name(extra["name"], f"{where}.name")
        calls = extra.get("tool_calls")
        call_texts: list[tuple[str, str]] = []
        if not _neutral(calls):
            if self.role != "assistant" or not isinstance(calls, list):
                raise BadRequest(f"{where}.tool_calls: a list, on assistant messages only", param=f"{where}.tool_calls")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                        or not isinstance(fn.get("arguments", ""), str) or c.get("type", "function") != "function":
                    raise BadRequest(f"{where}.tool_calls[{j}]: {{\"id\", \"type\": \"function\", \"function\": "
                                     "{\"name\": string, \"arguments\": string}}", param=f"{where}.tool_calls[{j}]")
                if c.get("id") is not None:
                    check_call_id(c["id"], f"{where}.tool_calls[{j}].id")
                check_name(fn["name"], f"{where}.tool_calls[{j}].function.name")
                call_texts.append((f"{where}.tool_calls[{j}].function.arguments", fn.get("arguments", "")))
                # The chat format parses the arguments (json.loads) to give the template an object.
                check_json_depth(fn.get("arguments", ""), f"{where}.tool_calls[{j}].function.arguments")
        if isinstance(self.content, str):
            texts = [(f"{where}.content", self.content)]
        elif isinstance(self.content, list):
            texts = []
            for j, part in enumerate(self.content):
                kind = part.get("type")
                if kind != "text":
                    raise BadRequest(f"{where}.content[{j}].type: only text parts are supported, not {str(kind)[:40]!r}",
                                     param=f"{where}.content[{j}].type")
                if not isinstance(part.get("text"), str):
                    raise BadRequest(f"{where}.content[{j}].text: a text part needs a string",
                                     param=f"{where}.content[{j}].text")
                texts.append((f"{where}.content[{j}].text", part["text"]))
        else:
            texts = []
        for param, text in texts + call_texts:
            if "\x00" in text:
                # Chat templates are C strings in llama.cpp: a NUL would silently end the message there.
                raise BadRequest(f"{param}: contains a NUL character", param=param)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = Field(None, description="Functions the model may call (OpenAI's shape).")
    tool_choice: str | dict[str, Any] | None = Field(None, description="none, auto (default with tools), required, "
                                                     "or {\"type\": \"function\", \"function\": {\"name\"}}.")
    parallel_tool_calls: bool | None = Field(None, description="Several calls in one answer (default true).")
    reasoning_format: Literal["none", "separate", "inline"] | None = Field(
        None, description="llama.cpp server extension: how thinking is returned (default GGUF_REASONING_FORMAT).")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    audio: Any = Field(None, description="Not supported: audio output.")
    modalities: list[str] | None = Field(None, description="Only [\"text\"].")
    prediction: Any = Field(None, description="Not supported: predicted outputs.")

    def check_messages(self) -> None:
        """Each message (``ChatMessage.check``), then the conversation: a ``tool`` message answers a call that an
        earlier assistant message made (its ``tool_calls[].id``). OpenAI refuses a result for no call ("messages
        with role 'tool' must be a response to a preceding message with 'tool_calls'"); here it would reach the
        prompt as the result of a call the model never made."""
        called: set[str] = set()
        for i, m in enumerate(self.messages):
            m.check(i)
            extra = m.model_extra or {}
            if m.role == "assistant" and not _neutral(extra.get("tool_calls")):
                called.update(c["id"] for c in extra["tool_calls"] if c.get("id") is not None)
            elif m.role == "tool" and extra["tool_call_id"] not in called:
                param = f"messages[{i}].tool_call_id"
                raise BadRequest(f"{param}: no earlier assistant message made a tool call with id "
                                 f"{extra['tool_call_id'][:64]!r}", param=param)

    def logprobs_n(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if not _neutral(self.audio) or (self.modalities is not None and set(self.modalities) - {"text"}):
            raise BadRequest("audio output is not supported: modalities can only be [\"text\"]",
                             param="audio" if not _neutral(self.audio) else "modalities")
        if not _neutral(self.prediction):
            raise BadRequest("prediction: predicted outputs are not supported", param="prediction")

    def requested_max_tokens(self) -> int | None:
        # Chat has no default limit in the OpenAI API; the server's (GGUF_MAX_TOKENS_DEFAULT) applies.
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens


async def resolve_model(manager: ModelManager, body: Any) -> Lease:
    """The loaded model that answers this request: the one its ``model`` names (or an alias's model; none: the
    default), loaded first when ``GGUF_LOAD_ON_DEMAND`` is on. Unknown: 404; known but not loaded: 503. The lease
    keeps the model from being evicted until the generation ends, and carries the request's keep_alive."""
    keep_alive = parse_keep_alive(body.keep_alive) if getattr(body, "keep_alive", None) is not None else None
    lease = await manager.acquire(body.model)
    lease.keep_alive_s = keep_alive
    return lease


def _check_context(n_ctx: int, n_prompt: int, max_tokens: int | None, prompt_param: str) -> None:
    """400 when the prompt, or the prompt plus max_tokens, does not fit the context."""
    if n_prompt >= n_ctx:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {n_ctx} tokens; the prompt has {n_prompt} tokens",
            param=prompt_param, prompt_tokens=n_prompt, n_ctx=n_ctx,
        )
    if max_tokens is not None and n_prompt + max_tokens > n_ctx:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {n_ctx} tokens; the prompt's {n_prompt} tokens plus "
            f"max_tokens {max_tokens} exceed it",
            param="max_tokens", prompt_tokens=n_prompt, max_tokens=max_tokens, n_ctx=n_ctx,
        )


async def _watch_disconnect(request: Request, cancel: Cancel) -> None:
    """Set ``cancel`` the moment the client goes away (the ASGI server reports ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel.set()
            return


class _Timer:
    """Time to first token and per-token latency, into the metrics."""

    def __init__(self, metrics: Metrics, t0: float, model: str) -> None:
        self.metrics = metrics
        self.model = model
        self.last = t0
        self.first = True

    def tick(self) -> None:
        now = time.perf_counter()
        if self.first:
            self.metrics.first_token(now - self.last, self.model)
            self.first = False
        else:
            self.metrics.token(now - self.last, self.model)
        self.last = now

    def generation(self, last: Chunk, index: int = 0) -> None:
        """A choice's usage into the metrics: the prompt counted with the first choice only (evaluated once)."""
        self.metrics.generation(last if index == 0 else replace(last, prompt_tokens=0, prompt_seconds=0.0), self.model)


def _usage(last: Chunk) -> dict[str, Any]:
    return {
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "total_tokens": last.prompt_tokens + last.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": last.cached_tokens},
    }


def _finish(last: Chunk) -> str:
    return "stop" if last.finish_reason in (None, "cancelled") else last.finish_reason


def _chat_logprobs(lps: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [
        {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes_),
         "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())} for s, v in t.top]}
        for t in lps
    ], "refusal": None}


def _completion_logprobs(lps: list[TokenLogprob], offset0: int = 0) -> dict[str, Any]:
    offsets, pos = [], offset0
    for t in lps:
        offsets.append(pos)
        pos += len(t.token)
    return {
        "tokens": [t.token for t in lps],
        "token_logprobs": [t.logprob for t in lps],
        "top_logprobs": [dict(t.top) for t in lps],
        "text_offset": offsets,
    }


async def _compile_response_format(params: GenerationParams, settings: Any, gone: "asyncio.Future[None]") -> bool:
    """Compile the request's grammar (response_format, or the tools') in a worker process, within
    ``settings.grammar_timeout_s`` and ``grammar_memory_mb``; False when the client left first.

    ``BadRequest`` when it cannot be used, did not compile in time or needed more memory: then it never reaches
    the engine. The work stops with the answer, or when the client leaves: the process is killed
    (``service.engine.grammar_worker``); trivial schemas never wait behind hostile ones (its fast lane). The engine
    compiles the grammar again at admission, the same work under the same limits, which this proved bounded.
    """
    source = grammar_source(params)
    if source is None:
        return True
    compiler = grammar_compiler(settings.grammar_workers, settings.grammar_memory_mb)
    return await compiler.compile(*source, timeout_s=settings.grammar_timeout_s, gone=gone)


@dataclass
class Started:
    """A generation admitted by the engine: its events to read, and what the reply needs to name it."""

    results: AsyncIterator[Chunk]
    cancel: Cancel
    name: str
    kind: Literal["completion", "chat"]
    choices: Choices
    params: GenerationParams
    timer: "_Timer"
    tools: bool


def _chat_setup(body: "ChatRequest", engine: Any, settings: Any,
                params: GenerationParams) -> tuple[GenerationParams, Choices, list[dict[str, Any]] | None]:
    """Tools and thinking for a chat: the grammar that constrains calls, the parser state, the tools the template
    renders."""
    fmt: ChatFormat = engine.chat_format()
    mode: ReasoningFormat = body.reasoning_format or settings.reasoning_format
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else None)
    allowed = check_tools(body.tools, choice)
    shown = body.tools if body.tools and choice != "none" else None
    biased = bool(params.logit_bias)
    if not allowed:
        return params, Choices(fmt, reasoning=mode, json_kind=json_constraint(params), biased=biased), shown
    if params.json_schema is not None or params.json_object:
        raise BadRequest("response_format and tools cannot constrain one answer together", param="response_format")
    named = isinstance(choice, dict)
    forced = named or choice == "required"
    parallel = body.parallel_tool_calls is not False and not named
    lark = tool_grammar(fmt, allowed, required=forced, parallel=parallel)
    return replace(params, lark=lark), Choices(fmt, reasoning=mode, tools=True, forced=forced, biased=biased), shown


async def _start(request: Request, manager: ModelManager, metrics: Metrics, body: _Common,
                 kind: Literal["completion", "chat"]) -> Started | JSONResponse:
    """Check, compile, queue and wait for admission: a refusal is raised (a plain HTTP error, never a stream);
    the client leaving meanwhile is a bare 499. The model's lease is released when the generation ends (the
    runner), or here when the request ends before it was queued."""
    t0 = time.perf_counter()
    reject_surrogates(body.model_dump(by_alias=True, exclude_none=True))
    settings = manager.settings
    params = body.params(COMPLETIONS_DEFAULT_MAX_TOKENS if kind == "completion" else settings.max_tokens_default)
    lease = await resolve_model(manager, body)
    try:
        return await _admit(request, lease, settings, metrics, body, kind, params, t0)
    finally:
        if not lease.queued:
            lease.release()  # the request ended before its generation was queued


async def _admit(request: Request, lease: Lease, settings: Any, metrics: Metrics, body: _Common,
                 kind: Literal["completion", "chat"], params: GenerationParams, t0: float) -> Started | JSONResponse:
    name = lease.name
    # The context check applies to the client's own limit; the server's default is only a cap.
    asked = body.requested_max_tokens() if kind == "chat" else params.max_tokens
    engine = lease.engine
    cancel = Cancel()
    choices = Choices(json_kind=json_constraint(params), biased=bool(params.logit_bias))
    tools: list[dict[str, Any]] | None = None
    if kind == "completion":
        assert isinstance(body, CompletionRequest)
        prompt: str | None = body.prompt_text()
        messages: list[dict[str, Any]] | None = None
        prompt_param = "prompt"
    else:
        assert isinstance(body, ChatRequest)
        body.check_messages()
        params, choices, tools = _chat_setup(body, engine, settings, params)
        prompt = None
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        prompt_param = "messages"
    run = params
    tokens: list[int] = []

    def work() -> Iterator[Chunk]:
        # On the engine's worker, in FIFO order: the checks that need the engine (grammar, logit_bias, n), then
        # one empty "admitted" chunk, then the generation from the tokens admission made. The HTTP layer waits
        # for that first item, so a refusal is a plain HTTP error even for a streamed request.
        engine.check(run)
        yield Chunk(prompt_tokens=len(tokens))
        yield from engine.generate(tokens, run, cancel)

    watcher = asyncio.ensure_future(_watch_disconnect(request, cancel))
    try:
        if not await _compile_response_format(params, settings, watcher):
            return JSONResponse({}, status_code=499)  # the client left while its grammar compiled
        # Tokenized off the engine's queue, bounded, refused unread if it cannot fit (service/api/admission.py).
        tokens = await prompt_tokens(request.app.state.admission, name, engine, param=prompt_param, prompt=prompt,
                                     messages=messages, tools=tools)
        if cancel.cancelled:
            return JSONResponse({}, status_code=499)  # the client left while its prompt was tokenized
        n_prompt = len(tokens)
        _check_context(engine.n_ctx, n_prompt, asked, prompt_param)
        if asked is not None and run.n > 1 and n_prompt + run.n * asked > engine.n_ctx:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {engine.n_ctx} tokens; the prompt's {n_prompt} tokens plus "
                f"{run.n} choices of max_tokens {asked} exceed it (the choices share the cache)",
                param="n", prompt_tokens=n_prompt, max_tokens=asked, n_ctx=engine.n_ctx)
        job = lease.runner.submit(work, cancel, on_done=lease.release)  # 429 beyond the queue's bound
        lease.queued = True  # from here the runner releases the lease when the generation ends
        results = chunks(job)
        try:
            await results.__anext__()  # admitted: the checks passed
        except StopAsyncIteration:  # cancelled while queued: the client is gone
            return JSONResponse({}, status_code=499)
        except ServiceError as exc:
            metrics.error(exc.code_for(request.url.path))
            raise
    finally:
        watcher.cancel()  # Starlette's StreamingResponse listens for the disconnect from here on
    return Started(results=results, cancel=cancel, name=name, kind=kind, choices=choices, params=params,
                   timer=_Timer(metrics, t0, name), tools=choices.tools)


async def _collect(request: Request, metrics: Metrics, started: Started) -> dict[int, Answer]:
    """Every choice whole (a non-streamed reply); disconnects are watched meanwhile."""
    watcher = asyncio.ensure_future(_watch_disconnect(request, started.cancel))
    answers: dict[int, Answer] = {}
    try:
        async for c in started.results:
            if c.text or c.logprobs:
                started.timer.tick()
            for e in started.choices.feed(c):
                answers.setdefault(e.index, Answer()).add(e)
    except ServiceError as exc:
        metrics.error(exc.code_for(request.url.path))
        raise
    finally:
        watcher.cancel()
    for i in range(started.params.n):
        answers.setdefault(i, Answer())
    for i, a in answers.items():
        started.timer.generation(a.last, i)
    return answers


async def _run(request: Request, manager: Any, metrics: Metrics, body: _Common, kind: Literal["completion", "chat"]) -> Any:
    started = await _start(request, manager, metrics, body, kind)
    if isinstance(started, JSONResponse):
        return started
    rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    want_lp = started.params.logprobs is not None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        gen = _stream(request, started, rid, created, include_usage, want_lp)
        return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    answers = await _collect(request, metrics, started)
    out = []
    for i in sorted(answers):
        a = answers[i]
        if kind == "completion":
            out.append({"text": a.content, "index": i, "finish_reason": a.finish_reason,
                        "logprobs": _completion_logprobs(a.logprobs) if want_lp else None})
        else:
            message: dict[str, Any] = {"role": "assistant", "content": a.content if a.content or not a.calls else None}
            if a.reasoning:
                message["reasoning_content"] = a.reasoning
            if a.calls:
                message["tool_calls"] = tool_calls_json(a.calls)
            out.append({"index": i, "message": message, "finish_reason": a.finish_reason,
                        "logprobs": _chat_logprobs(a.logprobs) if want_lp else None})
    obj = "text_completion" if kind == "completion" else "chat.completion"
    return JSONResponse({"id": rid, "object": obj, "created": created, "model": started.name, "choices": out,
                         "usage": _usage(usage_last(answers))})


async def _stream(request: Request, started: Started, rid: str, created: int, include_usage: bool,
                  want_lp: bool) -> AsyncIterator[bytes]:
    kind, model, timer = started.kind, started.name, started.timer
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    offsets: dict[int, int] = {}
    answers: dict[int, Answer] = {}

    def wrap(choice: dict[str, Any]) -> bytes:
        return sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]})

    def event(e: Event) -> bytes | None:
        i = e.index
        if kind == "completion":
            if e.kind == "finish":
                return wrap({"text": "", "index": i, "logprobs": None, "finish_reason": e.finish_reason})
            if e.kind == "logprobs":
                lp = _completion_logprobs(list(e.logprobs), offsets.get(i, 0)) if want_lp else None
                return wrap({"text": "", "index": i, "logprobs": lp, "finish_reason": None}) if want_lp else None
            offsets[i] = offsets.get(i, 0) + len(e.text)
            return wrap({"text": e.text, "index": i, "logprobs": None, "finish_reason": None})
        delta: dict[str, Any] = {}
        lp: Any = None
        finish = None
        if e.kind == "content":
            delta["content"] = e.text
        elif e.kind == "reasoning":
            delta["reasoning_content"] = e.text
        elif e.kind == "tool" and e.tool is not None:
            d = e.tool
            call: dict[str, Any] = {"index": d.index}
            if d.id is not None:
                call.update({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
            else:
                call["function"] = {"arguments": d.arguments}
            delta["tool_calls"] = [call]
        elif e.kind == "logprobs":
            if not want_lp:
                return None
            lp = _chat_logprobs(list(e.logprobs))
        else:
            finish = e.finish_reason
        return wrap({"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish})

    try:
        if kind == "chat":
            for i in range(started.params.n):
                yield wrap({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})
        async for c in started.results:
            if c.text or c.logprobs:
                timer.tick()
            for e in started.choices.feed(c):
                answers.setdefault(e.index, Answer()).add(e)
                data = event(e)
                if data is not None:
                    yield data
        for i, a in answers.items():
            timer.generation(a.last, i)
        if include_usage:
            yield sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                       "usage": _usage(usage_last(answers) if answers else Chunk())})
    except ServiceError as exc:
        _, body = service_error_body(exc, request.url.path)
        timer.metrics.error(exc.code_for(request.url.path))
        yield sse(body)
    except Exception as exc:  # a server fault mid-stream: logged, and the stream still ends in order
        log.exception("stream failed")
        err = EngineFailure(f"the stream failed: {type(exc).__name__}")
        _, body = service_error_body(err, request.url.path)
        timer.metrics.error(err.code)
        yield sse(body)
    finally:
        started.cancel.set()
    yield sse("[DONE]")


@router.post("/completions")
async def completions(request: Request, body: CompletionRequest, manager: ManagerDep, metrics: MetricsDep) -> Any:
    return await _run(request, manager, metrics, body, "completion")


@router.post("/chat/completions")
async def chat_completions(request: Request, body: ChatRequest, manager: ManagerDep, metrics: MetricsDep) -> Any:
    return await _run(request, manager, metrics, body, "chat")


MAX_EMBEDDING_INPUTS = 2048
"""Most inputs of one /v1/embeddings request (OpenAI's limit)."""


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="A string, strings, token ids, or lists of token ids; each within GGUF_EMBEDDING_TOKENS. "
        "Token ids are integers: true/false are not ids (strict types), as OpenAI refuses them.")
    model: str | None = Field(None, max_length=256)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="Only the model's n_embd (no truncation).")
    user: str | None = Field(None, max_length=256)

    def inputs(self, max_tokens: int) -> list[str] | list[list[int]]:
        """The inputs, each a string or token ids; token ids beyond ``max_tokens`` in all are refused here (strings
        are counted as they are tokenized, ``_embed``)."""
        value = self.input
        if isinstance(value, str):
            value = [value]
        if not value:
            raise BadRequest("input: at least one input", param="input")
        if isinstance(value[0], int):
            value = [value]  # type: ignore[list-item]
        elif len(value) > MAX_EMBEDDING_INPUTS:
            raise BadRequest(f"input: at most {MAX_EMBEDDING_INPUTS} inputs", param="input")
        for i, v in enumerate(value):
            if isinstance(v, str):
                if not v:
                    raise BadRequest(f"input[{i}]: an empty string has no embedding", param="input")
                if "\x00" in v:
                    raise BadRequest(f"input[{i}]: contains a NUL character", param="input")
        ids = sum(len(v) for v in value if not isinstance(v, str))
        if ids > max_tokens:
            raise _too_many_tokens(ids, max_tokens)
        return value  # type: ignore[return-value]


def _too_many_tokens(n: int, max_tokens: int, *, more: bool = False) -> BadRequest:
    return BadRequest(f"input: {'more than ' if more else ''}{n} tokens in all; one request embeds at most "
                      f"{max_tokens} (GGUF_EMBEDDING_MAX_REQUEST_TOKENS)", param="input")


@router.post("/embeddings")
async def embeddings(request: Request, body: EmbeddingRequest, manager: ManagerDep, metrics: MetricsDep) -> Any:
    """Pooled, L2-normalised embeddings from the embedding context (``LlamaEngine.embed``), through the same queue."""
    reject_surrogates(body.model_dump(exclude_none=True))
    max_tokens = manager.settings.embedding_max_request_tokens
    inputs = body.inputs(max_tokens)
    lease = await resolve_model(manager, body)
    try:
        return await _embed(request, lease, metrics, body, inputs, max_tokens)
    finally:
        if not lease.queued:
            lease.release()


async def _embed(request: Request, lease: Lease, metrics: Metrics, body: EmbeddingRequest,
                 inputs: list[str] | list[list[int]], max_tokens: int) -> Any:
    """Tokenize, count and embed ``inputs``: at most ``max_tokens`` tokens in all (``BadRequest`` naming ``input``
    before any batch runs), each within one embedding batch (``engine.embed``)."""
    name, engine = lease.name, lease.engine
    n_embd, limit = engine.embedding_limits()
    if not limit:
        raise BadRequest("embeddings are off for this model (GGUF_EMBEDDINGS: off, or auto with layers on a GPU)", param="input")
    if body.dimensions is not None and body.dimensions != n_embd:
        raise BadRequest(f"dimensions: this model's embeddings have {n_embd} dimensions (no truncation)",
                         param="dimensions")
    admission = request.app.state.admission
    chars = sum(len(t) for t in inputs if isinstance(t, str))
    cancel = Cancel()
    box: dict[str, Any] = {}

    def tokenize() -> list[list[int]]:
        tokens: list[list[int]] = []
        total = 0
        for t in inputs:  # the exact count, stopped at the limit: no more tokenizing than it allows
            tokens.append(engine.tokenize(t) if isinstance(t, str) else list(t))
            total += len(tokens[-1])
            if total > max_tokens:
                raise _too_many_tokens(total, max_tokens, more=len(tokens) < len(inputs))
        return tokens

    def work(tokens: list[list[int]]) -> Iterator[Chunk]:
        box["result"] = engine.embed(tokens, cancel)
        return iter(())

    watcher = asyncio.ensure_future(_watch_disconnect(request, cancel))
    try:
        if chars >= LARGE_TEXT_CHARS:
            # More than n x max_token_chars characters hold more than n tokens however they are tokenized: refused
            # unread, before the tokenizer spends seconds on megabytes (as prompts are, service/api/admission.py).
            per_token = int(await admission.run(name, 0, engine.max_token_chars))
            if per_token > 0 and chars > max_tokens * per_token:
                raise _too_many_tokens(max_tokens, max_tokens, more=True)
            for i, t in enumerate(inputs):
                if per_token > 0 and isinstance(t, str) and len(t) > limit * per_token:
                    raise ContextLengthExceeded(
                        f"input[{i}] holds {len(t)} characters; a token of this model spells at most {per_token}, "
                        f"so it takes more than the {limit} tokens an embedding holds (GGUF_EMBEDDING_TOKENS)",
                        param="input", n_ctx=limit)
        # Tokenized off the engine's queue, in the admission pool's lanes (a long text in the bounded one).
        tokens = await admission.run(name, chars, tokenize) if chars else tokenize()
        if cancel.cancelled:
            return JSONResponse({}, status_code=499)  # the client left while its inputs were tokenized
        job = lease.runner.submit(lambda: work(tokens), cancel, on_done=lease.release)
        lease.queued = True
        async for _ in chunks(job):
            pass
    except ServiceError as exc:
        metrics.error(exc.code_for(request.url.path))
        raise
    finally:
        watcher.cancel()
    result = box.get("result")
    if result is None:
        return JSONResponse({}, status_code=499)  # the client left before its turn
    import numpy as np

    data = []
    for i, vec in enumerate(result.vectors):
        f32 = np.asarray(vec, dtype="<f4")  # OpenAI's precision: base64 is these bytes, floats these values
        emb: Any = base64.b64encode(f32.tobytes()).decode("ascii") if body.encoding_format == "base64" else f32.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {"object": "list", "data": data, "model": name,
            "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}}


def _model_card(manager: ModelManager, name: str) -> dict[str, Any]:
    return {
        "id": name, "object": "model", "created": 0, "owned_by": "local",
        "loaded": manager.resident(name) is not None, "aliases": manager.registry.aliases_of(name),
    }


@router.get("/models")
async def list_models(manager: ManagerDep) -> dict[str, Any]:
    """Every model that can be served (its aliases beside it), loaded or not."""
    return {"object": "list", "data": [_model_card(manager, e.name) for e in manager.registry.list()]}


@router.get("/models/{name}")
async def get_model(name: str, manager: ManagerDep) -> dict[str, Any]:
    canonical = manager.registry.canonical(name)
    for entry in manager.registry.list():
        if entry.name == canonical:
            return _model_card(manager, entry.name)
    raise ModelNotFound(f"The model '{name[:200]}' does not exist", param="model")
