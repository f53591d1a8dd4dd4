"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Every check that can fail a request (model, n, schema, context) runs before the
first byte, so a refused streamed request is a plain HTTP error; a failure
during generation ends a stream with the error event and ``[DONE]``.

What is not built yet is refused, never silently ignored: tool calling (``tools``,
``tool_choice``, ``functions``, tool messages), ``logit_bias``, ``best_of``, ``suffix``,
audio output and image/audio/file content parts get a 400 naming the field.
A ``response_format`` grammar is compiled off the engine thread, with a time limit
(``GGUF_GRAMMAR_TIMEOUT_S``), before the request is queued; a client that leaves
stops waiting for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Iterator, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..engine.base import Cancel, Chunk, GenerationParams, TokenLogprob
from ..engine.grammar import check_schema_bounds, compile_grammar
from ..errors import BadRequest, ContextLengthExceeded, EngineFailure, ModelNotFound, ServiceError
from ..keepalive import parse_keep_alive
from ..manager import Lease, ModelManager
from ..runner import chunks
from ..settings import Settings
from .deps import ManagerDep, MetricsDep
from .errors import service_error_body, sse
from .metrics import Metrics
from .validation import KeepAlive, reject_surrogates

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
    "tools": "tool calling is not supported yet",
    "tool_choice": "tool calling is not supported yet",
    "functions": "function calling is not supported yet",
    "function_call": "function calling is not supported yet",
    "logit_bias": "logit_bias is not supported",
}
"""Fields refused (400, param names the field) unless neutral (null, empty, "none")."""


class StreamOptions(BaseModel):
    include_usage: bool = False


def _float(default: float, **bounds: float) -> Any:
    return Field(default, allow_inf_nan=False, **bounds)  # type: ignore[arg-type]


class JsonSchemaFormat(BaseModel):
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, max_length=256)
    max_tokens: int | None = Field(None, ge=1, description="Absent or null: 16 on /v1/completions (OpenAI's "
                                   "default), GGUF_MAX_TOKENS_DEFAULT on /v1/chat/completions.")
    temperature: float = _float(1.0, ge=0.0, le=2.0)
    top_p: float = _float(1.0, gt=0.0, le=1.0)
    frequency_penalty: float = _float(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = _float(0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-1, le=MAX_SEED, description="0 .. 2^32-1 (llama.cpp's uint32); -1: random.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128)
    response_format: ResponseFormat | None = None
    user: str | None = Field(None, max_length=256)
    ignore_eos: bool = Field(False, description="llama.cpp server extension: generate past end-of-generation tokens.")
    tools: Any = Field(None, description="Not supported yet: anything but null or [] is a 400.")
    tool_choice: Any = Field(None, description="Not supported yet: anything but null or \"none\" is a 400.")
    functions: Any = Field(None, description="Not supported yet: anything but null or [] is a 400.")
    function_call: Any = Field(None, description="Not supported yet: anything but null or \"none\" is a 400.")
    logit_bias: Any = Field(None, description="Not supported: anything but null or {} is a 400.")
    parallel_tool_calls: bool | None = None
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

    def params(self, default_max_tokens: int = COMPLETIONS_DEFAULT_MAX_TOKENS) -> GenerationParams:
        if self.n != 1:
            raise BadRequest("only n=1 is supported: one choice per request", param="n")
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
            cache_prompt=self.cache_prompt,
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
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def check(self, i: int) -> None:
        """400 for what this server cannot honour in a message: tool turns, non-text parts, NUL characters."""
        where = f"messages[{i}]"
        if self.role == "tool":
            raise BadRequest(f"{where}.role: tool messages need tool calling, which is not supported yet",
                             param=f"{where}.role")
        for extra in ("tool_calls", "function_call", "audio"):
            if not _neutral((self.model_extra or {}).get(extra)):
                raise BadRequest(f"{where}.{extra}: not supported yet", param=f"{where}.{extra}")
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
        name = (self.model_extra or {}).get("name")
        if name is not None:
            texts.append((f"{where}.name", name if isinstance(name, str) else ""))
        for param, text in texts:
            if "\x00" in text:
                # Chat templates are C strings in llama.cpp: a NUL would silently end the message there.
                raise BadRequest(f"{param}: contains a NUL character", param=param)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    audio: Any = Field(None, description="Not supported: audio output.")
    modalities: list[str] | None = Field(None, description="Only [\"text\"].")
    prediction: Any = Field(None, description="Not supported: predicted outputs.")

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
        for i, m in enumerate(self.messages):
            m.check(i)

    def requested_max_tokens(self) -> int | None:
        # Chat has no default limit in the OpenAI API; the server's (GGUF_MAX_TOKENS_DEFAULT) applies.
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens


async def resolve_model(manager: ModelManager, body: "_Common") -> Lease:
    """The loaded model that answers this request: the one its ``model`` names (or an alias's model; none: the
    default), loaded first when ``GGUF_LOAD_ON_DEMAND`` is on. Unknown: 404; known but not loaded: 503. The lease
    keeps the model from being evicted until the generation ends, and carries the request's keep_alive."""
    keep_alive = parse_keep_alive(body.keep_alive) if body.keep_alive is not None else None
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


async def _compile_response_format(params: GenerationParams, timeout_s: float, gone: "asyncio.Future[None]") -> bool:
    """Compile the request's grammar off the engine thread, within ``timeout_s``; False when the client left first.

    The engines compile it again at admission and find it in the compiler's cache.
    """
    if params.json_schema is None and not params.json_object and not params.grammar:
        return True
    task = asyncio.ensure_future(asyncio.to_thread(compile_grammar, params))
    done, _ = await asyncio.wait({task, gone}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()  # BadRequest for a schema that cannot be used
        return True
    # Left running, the compilation stops at llguidance's own limits (fuel, Earley items, grammar size).
    task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
    if gone in done:
        return False
    raise BadRequest(f"response_format: the grammar did not compile within {timeout_s:g} s", param="response_format")


async def _run(request: Request, manager: ModelManager, metrics: Metrics, body: _Common,
               kind: Literal["completion", "chat"]) -> Any:
    t0 = time.perf_counter()
    reject_surrogates(body.model_dump(by_alias=True, exclude_none=True))
    settings = manager.settings
    params = body.params(COMPLETIONS_DEFAULT_MAX_TOKENS if kind == "completion" else settings.max_tokens_default)
    lease = await resolve_model(manager, body)
    try:
        return await _serve(request, lease, settings, metrics, body, kind, params, t0)
    finally:
        if not lease.queued:
            lease.release()  # the request ended before its generation was queued


async def _serve(request: Request, lease: Lease, settings: Settings, metrics: Metrics, body: _Common,
                 kind: Literal["completion", "chat"], params: GenerationParams, t0: float) -> Any:
    name = lease.name
    # The context check applies to the client's own limit; the server's default is only a cap.
    asked = body.requested_max_tokens() if kind == "chat" else params.max_tokens
    engine = lease.engine
    cancel = Cancel()
    if kind == "completion":
        assert isinstance(body, CompletionRequest)
        prompt = body.prompt_text()
        count: Callable[[], int] = lambda: int(engine.count_tokens(prompt))  # noqa: E731
        generate: Callable[[], Iterator[Chunk]] = lambda: engine.complete(prompt, params, cancel)  # noqa: E731
        prompt_param = "prompt"
    else:
        assert isinstance(body, ChatRequest)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        count = lambda: int(engine.count_chat_tokens(messages))  # noqa: E731
        generate = lambda: engine.chat(messages, params, cancel)  # noqa: E731
        prompt_param = "messages"

    def work() -> Iterator[Chunk]:
        # On the engine thread, in FIFO order: every check that can refuse the request, then one
        # empty "admitted" chunk, then the generation. The HTTP layer waits for that first item,
        # so a refusal is a plain HTTP error even for a streamed request.
        engine.check(params)
        n_prompt = count()
        _check_context(engine.n_ctx, n_prompt, asked, prompt_param)
        yield Chunk(prompt_tokens=n_prompt)
        yield from generate()

    watcher = asyncio.ensure_future(_watch_disconnect(request, cancel))
    try:
        if not await _compile_response_format(params, settings.grammar_timeout_s, watcher):
            return JSONResponse({}, status_code=499)  # the client left while its grammar compiled
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
        rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        timer = _Timer(metrics, t0, name)
        want_lp = params.logprobs is not None
        if body.stream:
            watcher.cancel()  # Starlette's StreamingResponse listens for the disconnect from here on
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            gen = _stream(request, results, cancel, kind, rid, created, name, include_usage, timer, want_lp)
            return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        got: list[Chunk] = []
        try:
            async for c in results:
                if c.text or c.logprobs:
                    timer.tick()
                got.append(c)
        except ServiceError as exc:
            metrics.error(exc.code_for(request.url.path))
            raise
    finally:
        watcher.cancel()
    text = "".join(c.text for c in got)
    lps = [t for c in got for t in c.logprobs]
    last = got[-1] if got else Chunk(finish_reason="stop")
    metrics.generation(last, name)
    if kind == "completion":
        choice: dict[str, Any] = {"text": text, "index": 0, "finish_reason": _finish(last),
                                  "logprobs": _completion_logprobs(lps) if want_lp else None}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": _finish(last),
                  "logprobs": _chat_logprobs(lps) if want_lp else None}
        obj = "chat.completion"
    return JSONResponse({"id": rid, "object": obj, "created": created, "model": name, "choices": [choice], "usage": _usage(last)})


async def _stream(
    request: Request, agen: AsyncIterator[Chunk], cancel: Cancel, kind: str, rid: str, created: int, model: str,
    include_usage: bool, timer: _Timer, want_lp: bool,
) -> AsyncIterator[bytes]:
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    offset = 0

    def event(c: Chunk | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        nonlocal offset
        lp: Any = None
        if want_lp and c is not None:
            lp = _completion_logprobs(list(c.logprobs), offset) if kind == "completion" else _chat_logprobs(list(c.logprobs))
        if kind == "completion":
            choice: dict[str, Any] = {"text": c.text if c else "", "index": 0, "logprobs": lp, "finish_reason": finish}
            offset += len(c.text) if c else 0
        else:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
                delta["content"] = ""
            elif c is not None:
                delta["content"] = c.text
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}

    try:
        if kind == "chat":
            yield sse(event(None, None, role=True))
        last = Chunk()
        async for c in agen:
            if c.text or c.logprobs:
                timer.tick()
                yield sse(event(c, None))
            if c.finish_reason is not None:
                last = c
        timer.metrics.generation(last, model)
        yield sse(event(None, _finish(last)))
        if include_usage:
            yield sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": _usage(last)})
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
        cancel.set()
    yield sse("[DONE]")


@router.post("/completions")
async def completions(request: Request, body: CompletionRequest, manager: ManagerDep, metrics: MetricsDep) -> Any:
    return await _run(request, manager, metrics, body, "completion")


@router.post("/chat/completions")
async def chat_completions(request: Request, body: ChatRequest, manager: ManagerDep, metrics: MetricsDep) -> Any:
    return await _run(request, manager, metrics, body, "chat")


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
