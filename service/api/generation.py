"""The one generation path every API family takes: a request's model, its checks, its grammar, its tokens, its place
in the queue; then its chunks, collected whole or streamed by the family's own renderer.

``start`` checks, compiles the grammar (off the engine thread, in a process it can stop:
``service.grammar.worker``), tokenizes (``service.api.admission``), queues and waits for admission: a refusal
is raised before any byte is sent (a plain HTTP error, even for a stream); a client that leaves meanwhile gets a
bare 499. ``collect`` reads every choice whole. The model's lease is released when the generation ends (the
runner), or here when the request ends before it was queued.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Iterator, Literal

from fastapi import Request
from fastapi.responses import JSONResponse

from ..chat.choices import Answer, Choices, json_constraint
from ..chat.format import ChatFormat
from ..chat.reasoning import ReasoningFormat
from ..chat.tools import check_tools, tool_grammar
from ..engine.base import Cancel, Chunk, GenerationParams, scope_of
from ..errors import ContextLengthExceeded, ServiceError
from ..grammar.schema import grammar_source
from ..grammar.worker import compiler as grammar_compiler
from ..keepalive import granted_keep_alive, parse_keep_alive
from ..residency import Lease, ModelManager
from ..residency.fifo import chunks
from .admission import prompt_tokens
from .errors import code_of
from .images import ImageFetches, ImageLimits, decode_images, image_parts, takes_no_images
from .metrics import Metrics
from .openai_wire import COMPLETIONS_DEFAULT_MAX_TOKENS, ChatRequest, CompletionRequest, GenerationRequest
from .security import is_admin, presented_key


async def resolve_model(manager: ModelManager, body: Any, request: Request) -> Lease:
    """The loaded model that answers this request: the one its ``model`` names (or an alias's model; none: the
    default), loaded first when ``GGUF_LOAD_ON_DEMAND`` is on. Unknown: 404; known but not loaded: 503. The lease
    keeps the model from being evicted until the generation ends, and carries the request's keep_alive as the
    policy grants it (``keepalive.granted_keep_alive``: an ordinary key may only lengthen it)."""
    keep_alive = parse_keep_alive(body.keep_alive) if getattr(body, "keep_alive", None) is not None else None
    lease = await manager.acquire(body.model)
    lease.keep_alive_s = granted_keep_alive(keep_alive, lease.state.keep_alive_s,
                                            may_shorten=may_shorten_keep_alive(request, manager.settings))
    return lease


def may_shorten_keep_alive(request: Request, settings: Any) -> bool:
    """Whether this request's keep_alive may shorten its model's stay or unload it: an admin's, or anyone's under
    ``GGUF_KEEP_ALIVE_POLICY=ollama``."""
    return settings.keep_alive_policy == "ollama" or is_admin(request)


def check_context(n_ctx: int, n_prompt: int, max_tokens: int | None, prompt_param: str) -> None:
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


async def watch_disconnect(request: Request, cancel: Cancel) -> None:
    """Set ``cancel`` the moment the client goes away (the ASGI server reports ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel.set()
            return


class Timer:
    """Time to first token and per-token latency, into the metrics."""

    def __init__(self, metrics: Metrics, t0: float, model: str) -> None:
        self.metrics = metrics
        self.model = model
        self.last = t0
        self.first = True

    def tick(self, tokens: int = 1) -> None:
        """A chunk of ``tokens`` tokens came (a drafted step's together): the first waited since the last, the
        others none."""
        now = time.perf_counter()
        if self.first:
            self.metrics.first_token(now - self.last, self.model)
            self.first = False
        else:
            self.metrics.token(now - self.last, self.model)
        for _ in range(tokens - 1):
            self.metrics.token(0.0, self.model)
        self.last = now

    def generation(self, last: Chunk, index: int = 0) -> None:
        """A choice's usage into the metrics: the prompt counted with the first choice only (evaluated once)."""
        self.metrics.generation(last if index == 0 else replace(last, prompt_tokens=0, prompt_seconds=0.0), self.model)


async def compile_response_format(params: GenerationParams, settings: Any, gone: "asyncio.Future[None]") -> bool:
    """Compile the request's grammar (response_format, or the tools') in a worker process, within
    ``settings.grammar_timeout_s`` and ``grammar_memory_mb``; False when the client left first.

    ``BadRequest`` when it cannot be used, did not compile in time or needed more memory: then it never reaches
    the engine. The work stops with the answer, or when the client leaves: the process is killed
    (``service.grammar.worker``); trivial schemas never wait behind hostile ones (its fast lane). The engine
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
    timer: "Timer"
    tools: bool
    prompt_ids: tuple[int, ...] = ()
    """The token ids the prompt was evaluated as (vLLM's ``return_token_ids`` answers them)."""


def chat_setup(body: "ChatRequest", engine: Any, settings: Any,
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
    named = isinstance(choice, dict)
    forced = named or choice == "required"
    asked = body.parallel_tool_calls
    parallel = (asked if asked is not None else settings.parallel_tool_calls) and not named
    kind = json_constraint(params)
    if kind is not None and forced:
        params = replace(params, json_schema=None, json_object=False)  # a forced call is the answer: nothing to format
    elif kind is not None:
        # Calls, or an answer of the format (an agent's output type beside its tools): one grammar of both.
        answer = json.loads(params.json_schema) if params.json_schema is not None else {"type": "object"}
        lark = tool_grammar(fmt, allowed, required=False, parallel=parallel, answer=answer)
        return (replace(params, lark=lark, json_schema=None, json_object=False),
                Choices(fmt, reasoning=mode, tools=True, json_kind=kind, biased=biased), shown)
    lark = tool_grammar(fmt, allowed, required=forced, parallel=parallel)
    return replace(params, lark=lark), Choices(fmt, reasoning=mode, tools=True, forced=forced, biased=biased), shown


async def chat_prompt_tokens(request: Request, manager: ModelManager, chat: "ChatRequest", param: str) -> int:
    """The prompt tokens a chat request evaluates (its rendering, tools included), counted off the engine's queue
    (``service.api.admission``) and nothing generated: Anthropic's count_tokens and the Responses API's
    input_tokens."""
    chat.check_messages()
    params = chat.params(manager.settings.max_tokens_default)
    lease = await resolve_model(manager, chat, request)
    try:
        engine = lease.engine
        _, _, tools = chat_setup(chat, engine, manager.settings, params)
        messages = await chat_messages(request, chat, engine, manager.settings)
        return len(await prompt_tokens(request.app.state.admission, lease.name, engine, param=param,
                                       messages=messages, tools=tools))
    finally:
        lease.release()


async def chat_messages(request: Request, chat: "ChatRequest", engine: Any, settings: Any) -> list[dict[str, Any]]:
    """A chat's messages as the engine takes them: its images decoded (``service.api.images``: off the event loop,
    fetches on threads of their own within their limits). An image to a model without a vision projector is
    refused first, before any image is fetched or decoded."""
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    parts = image_parts(messages)
    if not parts:
        return messages
    if not engine.limits.images:
        raise takes_no_images(parts[0])
    return await decode_images(messages, parts, ImageLimits.of(settings), image_fetches(request, settings),
                               image_client(request))


def image_fetches(request: Request, settings: Any) -> ImageFetches:
    """The app's image fetches (``GGUF_IMAGE_FETCHES``, ``GGUF_IMAGE_FETCHES_PER_CLIENT``), made at the first."""
    fetches = getattr(request.app.state, "image_fetches", None)
    if fetches is None:
        fetches = request.app.state.image_fetches = ImageFetches(settings.image_fetches,
                                                                 settings.image_fetches_per_client)
    return fetches


def image_client(request: Request) -> str:
    """Who a request's image fetches count against: its API key's digest where keys are set (the key itself is
    kept nowhere), else the address it came from."""
    if getattr(request.app.state, "api_keys", ()):
        raw = presented_key(request.scope["headers"])
        if raw:
            return "key:" + hashlib.sha256(raw).hexdigest()
    return "address:" + (request.client.host if request.client else "")


def cache_scope(request: Request, settings: Any, salt: str | None) -> str:
    """Whose cached prompts the request may reuse: with API keys configured, its key's (unless
    ``GGUF_PROMPT_CACHE_PER_KEY`` is off), and its ``cache_salt`` (``service.engine.prompt_cache.scope_of``)."""
    key = None
    if settings.prompt_cache_per_key and getattr(request.app.state, "api_keys", ()):
        raw = presented_key(request.scope["headers"])
        key = raw.decode("latin-1") if raw else None
    return scope_of(key, salt)


async def start(request: Request, manager: ModelManager, metrics: Metrics, body: GenerationRequest,
                 kind: Literal["completion", "chat"], *, n_ctx: int | None = None,
                 default_max_tokens: int | None = None) -> Started | JSONResponse:
    """Check, compile, queue and wait for admission: a refusal is raised (a plain HTTP error, never a stream);
    the client leaving meanwhile is a bare 499. The model's lease is released when the generation ends (the
    runner), or here when the request ends before it was queued.

    ``n_ctx``: a per-request ceiling below the model's context (Ollama's ``num_ctx``, which never reloads a model
    here): the prompt plus the client's limit must fit it, and the generation stops there. ``default_max_tokens``:
    the limit when the client gives none, a cap only (as for chats), instead of the family's default."""
    t0 = time.perf_counter()
    settings = manager.settings
    default = default_max_tokens or (COMPLETIONS_DEFAULT_MAX_TOKENS if kind == "completion"
                                     else settings.max_tokens_default)
    params = body.params(default)
    params = replace(params, cache_scope=cache_scope(request, settings, body.cache_salt))
    lease = await resolve_model(manager, body, request)
    try:
        return await admit(request, lease, settings, metrics, body, kind, params, t0, n_ctx=n_ctx,
                           cap_only=default_max_tokens is not None)
    finally:
        if not lease.queued:
            lease.release()  # the request ended before its generation was queued


async def admit(request: Request, lease: Lease, settings: Any, metrics: Metrics, body: GenerationRequest,
                 kind: Literal["completion", "chat"], params: GenerationParams, t0: float, *,
                 n_ctx: int | None = None, cap_only: bool = False,
                 prompt_ids: list[int] | None = None) -> Started | JSONResponse:
    """The checks, queueing and admission of ``start`` for a resolved model. ``prompt_ids``: a prompt the route
    tokenized itself (llama-server's /infill builds its FIM layout from token ids), taken as it is, checked
    against the context like any other (a completion's body then gives only the parameters)."""
    name = lease.name
    # The context check applies to the client's own limit; the server's default is only a cap.
    asked = body.requested_max_tokens() if kind == "chat" or cap_only else params.max_tokens
    engine = lease.engine
    ceiling = min(engine.n_ctx, n_ctx) if n_ctx else engine.n_ctx
    cancel = Cancel()
    choices = Choices(json_kind=json_constraint(params), biased=bool(params.logit_bias))
    source = Source()
    if prompt_ids is None:  # else the route tokenized its prompt: the body gives only parameters
        source = await prompt_source(request, body, kind, engine, settings, params)
        params = source.params or params
        choices = source.choices or choices
    tools, prompt, messages, prompt_param = source.tools, source.prompt, source.messages, source.param
    run = params
    tokens: list[int] = []

    def work() -> Iterator[Chunk]:
        # On the engine's worker, in FIFO order: the checks that need the engine (grammar, logit_bias, n), then
        # one empty "admitted" chunk, then the generation from the tokens admission made. The HTTP layer waits
        # for that first item, so a refusal is a plain HTTP error even for a streamed request.
        engine.check(run)
        yield Chunk(prompt_tokens=len(tokens))
        yield from engine.generate(tokens, run, cancel)

    watcher = asyncio.ensure_future(watch_disconnect(request, cancel))
    try:
        if not await compile_response_format(params, settings, watcher):
            return JSONResponse({}, status_code=499)  # the client left while its grammar compiled
        # Tokenized off the engine's queue, bounded, refused unread if it cannot fit (service/api/admission.py).
        tokens = list(prompt_ids) if prompt_ids is not None else await prompt_tokens(
            request.app.state.admission, name, engine, param=prompt_param, prompt=prompt, messages=messages,
            tools=tools)
        if cancel.cancelled:
            return JSONResponse({}, status_code=499)  # the client left while its prompt was tokenized
        n_prompt = len(tokens)
        check_context(ceiling, n_prompt, asked, prompt_param)
        if ceiling < engine.n_ctx and run.max_tokens is not None:
            run = replace(run, max_tokens=min(run.max_tokens, ceiling - n_prompt))  # the generation stops there
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
            metrics.error(code_of(exc, request.url.path))
            raise
    finally:
        watcher.cancel()  # Starlette's StreamingResponse listens for the disconnect from here on
    return Started(results=results, cancel=cancel, name=name, kind=kind, choices=choices, params=params,
                   timer=Timer(metrics, t0, name), tools=choices.tools, prompt_ids=tuple(tokens))


@dataclass(frozen=True)
class Source:
    """What a request's prompt is made of, as the engine tokenizes it (``prompt_tokens``): a completion's text or a
    chat's messages and tools, and the parameters a chat's tools and images change."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    param: str = "prompt"
    params: GenerationParams | None = None
    choices: Choices | None = None


async def prompt_source(request: Request, body: GenerationRequest, kind: Literal["completion", "chat"], engine: Any,
                        settings: Any, params: GenerationParams) -> Source:
    """The prompt of a completion or chat request as generation evaluates it, and by the same code the render
    routes answer with (``service.api.render``): their token ids are the ones a generation would evaluate."""
    if kind == "completion":
        assert isinstance(body, CompletionRequest)
        return Source(prompt=body.prompt_text())
    assert isinstance(body, ChatRequest)
    body.check_messages()
    params, choices, tools = chat_setup(body, engine, settings, params)
    messages = await chat_messages(request, body, engine, settings)
    images = tuple(p["image"] for m in messages if isinstance(m.get("content"), list)
                   for p in m["content"] if isinstance(p, dict) and p.get("type") == "image")
    if images:  # carried to the engine with the prompt's tokens (it prepares any it dropped meanwhile)
        params = replace(params, images=images)
    return Source(messages=messages, tools=tools, param="messages", params=params, choices=choices)


async def collect(request: Request, metrics: Metrics, started: Started) -> dict[int, Answer]:
    """Every choice whole (a non-streamed reply); disconnects are watched meanwhile."""
    watcher = asyncio.ensure_future(watch_disconnect(request, started.cancel))
    answers: dict[int, Answer] = {}
    try:
        async for c in started.results:
            if c.text or c.logprobs:
                started.timer.tick(len(c.tokens))
            for e in started.choices.feed(c):
                answers.setdefault(e.index, Answer()).add(e)
    except ServiceError as exc:
        metrics.error(code_of(exc, request.url.path))
        raise
    finally:
        watcher.cancel()
    for i in range(started.params.n):
        answers.setdefault(i, Answer())
    for i, a in answers.items():
        started.timer.generation(a.last, i)
    return answers
