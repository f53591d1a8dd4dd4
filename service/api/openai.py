"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models.

Every check that can fail a request (model, n, schema, tools, context) runs before the
first byte, so a refused streamed request is a plain HTTP error; a failure
during generation ends a stream with the error event and ``[DONE]``.

Tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``, ``tool`` messages and
``tool_calls`` in the history) goes through the model's chat template and native call format
(``service.chat.format``, ``service.chat.tools``); thinking is split into
``reasoning_content`` (``service.chat.reasoning``, ``GGUF_REASONING_FORMAT``); ``n`` choices share
the prompt's evaluation; ``logit_bias`` is a sampler. What is not built is refused, never silently
ignored: ``functions``/``function_call`` (deprecated by OpenAI), ``best_of``, ``suffix``, audio
output and audio/file content parts get a 400 naming the field. ``image_url`` parts of user messages are decoded
at admission (``service.api.images``) for a model loaded with a vision projector.
A grammar (``response_format``, or the tools') is compiled off the engine thread, with a time limit
(``GGUF_GRAMMAR_TIMEOUT_S``), before the request is queued; a client that leaves stops waiting for it.

``start`` is the one generation path: /v1/messages (``service.api.anthropic``) uses it too.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from typing import Any, AsyncIterator, Iterator, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..chat.choices import Answer, Event, tool_calls_json, usage_last
from ..engine.base import Cancel, Chunk, TokenLogprob
from ..errors import BadRequest, ContextLengthExceeded, EngineFailure, ModelNotFound, ServiceError
from ..residency import Lease, ModelManager
from ..residency.fifo import chunks
from .admission import LARGE_TEXT_CHARS
from .deps import ManagerDep, MetricsDep
from .errors import code_of, service_error_body, sse
from .generation import Started, collect, resolve_model, start, watch_disconnect
from .metrics import Metrics
from .openai_wire import ChatRequest, CompletionRequest, GenerationRequest

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1")


def _usage(last: Chunk) -> dict[str, Any]:
    return {
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "total_tokens": last.prompt_tokens + last.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": last.cached_tokens},
        # Drafted tokens (self-speculation) as OpenAI's Predicted Outputs count a prediction's: those the answer
        # kept, and those it did not (still computed).
        "completion_tokens_details": {"accepted_prediction_tokens": last.accepted_tokens,
                                      "rejected_prediction_tokens": last.drafted_tokens - last.accepted_tokens},
    }


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


async def _run(request: Request, manager: Any, metrics: Metrics, body: GenerationRequest, kind: Literal["completion", "chat"]) -> Any:
    started = await start(request, manager, metrics, body, kind)
    if isinstance(started, JSONResponse):
        return started
    rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    want_lp = started.params.logprobs is not None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        gen = _stream(request, started, rid, created, include_usage, want_lp)
        return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    answers = await collect(request, metrics, started)
    out = []
    for i in sorted(answers):
        a = answers[i]
        if kind == "completion":
            out.append({"text": a.content, "index": i, "finish_reason": a.finish_reason,
                        "logprobs": _completion_logprobs(a.logprobs) if want_lp else None})
            if body.return_token_ids:  # vLLM puts a completion's prompt ids in each choice
                out[-1]["prompt_token_ids"] = list(started.prompt_ids)
        else:
            message: dict[str, Any] = {"role": "assistant", "content": a.content if a.content or not a.calls else None}
            if a.reasoning:
                message["reasoning_content"] = a.reasoning
            if a.calls:
                message["tool_calls"] = tool_calls_json(a.calls)
            out.append({"index": i, "message": message, "finish_reason": a.finish_reason,
                        "logprobs": _chat_logprobs(a.logprobs) if want_lp else None})
    obj = "text_completion" if kind == "completion" else "chat.completion"
    reply: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": started.name, "choices": out,
                             "usage": _usage(usage_last(answers))}
    if body.return_token_ids and kind == "chat":  # and a chat's beside its choices
        reply["prompt_token_ids"] = list(started.prompt_ids)
    return JSONResponse(reply)


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
                lps = _completion_logprobs(list(e.logprobs), offsets.get(i, 0)) if want_lp else None
                return wrap({"text": "", "index": i, "logprobs": lps, "finish_reason": None}) if want_lp else None
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
                timer.tick(len(c.tokens))
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
        timer.metrics.error(code_of(exc, request.url.path))
        yield sse(body)
    except Exception as exc:  # a server fault mid-stream: logged, and the stream still ends in order
        log.exception("stream failed")
        err = EngineFailure(f"the stream failed: {type(exc).__name__}")
        _, body = service_error_body(err, request.url.path)
        timer.metrics.error(code_of(err, request.url.path))
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
        are counted as they are tokenized, ``embed``)."""
        value = self.input
        if isinstance(value, str):
            value = [value]
        if not value:
            raise BadRequest("input: at least one input", param="input")
        if isinstance(value[0], int):
            value = [value]
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
        return value


def _too_many_tokens(n: int, max_tokens: int, *, more: bool = False) -> BadRequest:
    return BadRequest(f"input: {'more than ' if more else ''}{n} tokens in all; one request embeds at most "
                      f"{max_tokens} (GGUF_EMBEDDING_MAX_REQUEST_TOKENS)", param="input")


@router.post("/embeddings")
async def embeddings(request: Request, body: EmbeddingRequest, manager: ManagerDep, metrics: MetricsDep) -> Any:
    """Pooled, L2-normalised embeddings from the embedding context (``LlamaEngine.embed``), through the same queue."""
    max_tokens = manager.settings.embedding_max_request_tokens
    inputs = body.inputs(max_tokens)
    lease = await resolve_model(manager, body, request)
    try:
        return await embed(request, lease, metrics, body, inputs, max_tokens)
    finally:
        if not lease.queued:
            lease.release()


async def embed(request: Request, lease: Lease, metrics: Metrics, body: EmbeddingRequest,
                 inputs: list[str] | list[list[int]], max_tokens: int) -> Any:
    """Tokenize, count and embed ``inputs``: at most ``max_tokens`` tokens in all (``BadRequest`` naming ``input``
    before any batch runs), each within one embedding batch (``engine.embed``). Public: Ollama's /api/embed
    (``service.api.ollama``) takes the same path."""
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

    loop = asyncio.get_running_loop()
    limit_s = request.app.state.settings.embedding_max_s

    def expire() -> None:  # on the loop: the request ran past its engine time
        if "result" not in box:
            box["expired"] = True
            cancel.set()

    def work(tokens: list[list[int]]) -> Iterator[Chunk]:
        box["started"] = time.monotonic()
        loop.call_soon_threadsafe(lambda: box.__setitem__("timer", loop.call_later(limit_s, expire)))
        box["result"] = engine.embed(tokens, cancel)
        box["took_s"] = time.monotonic() - box["started"]
        return iter(())

    watcher = asyncio.ensure_future(watch_disconnect(request, cancel))
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
        check_embedding_time(lease, sum(len(t) for t in tokens), limit_s)
        job = lease.runner.submit(lambda: work(tokens), cancel, on_done=lease.release)
        lease.queued = True
        expired = BadRequest(f"input: the request ran past {limit_s:g} s of engine time (GGUF_EMBEDDING_MAX_S) "
                             "and was ended; send fewer inputs per request", param="input", limit_s=limit_s)
        try:
            async for _ in chunks(job):
                pass
        except ServiceError:
            if box.get("expired"):
                raise expired from None
            raise
        if box.get("expired") and box.get("result") is None:
            raise expired
    except ServiceError as exc:
        metrics.error(code_of(exc, request.url.path))
        raise
    finally:
        watcher.cancel()
        timer = box.get("timer")
        if timer is not None:
            timer.cancel()
    result = box.get("result")
    if result is not None and box.get("took_s", 0.0) >= RATE_MIN_S:
        measured = result.prompt_tokens / max(box["took_s"], 1e-3)
        st = lease.state
        st.embedding_tokens_per_s = measured if st.embedding_tokens_per_s is None \
            else 0.5 * (st.embedding_tokens_per_s + measured)
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


RATE_MIN_S = 0.5
"""An embeddings request updates its model's measured speed only when it took at least this long: a short one's time
is mostly the round trip to the runner (8 tokens in 0.3 s read as 26 tokens/s on a loaded host, and refused the
next 800-token request as 31 s long)."""


def check_embedding_time(lease: Lease, n_tokens: int, limit_s: float) -> None:
    """400 before anything is evaluated when ``n_tokens`` would take longer than ``limit_s`` (GGUF_EMBEDDING_MAX_S)
    at the model's measured embedding speed, or before any measurement at its plan's predicted prompt speed (llama.cpp
    evaluates an embedding batch as a prompt). A swap that waits for this model's memory then waits for at most
    that long on its embeddings; the runtime bound (``embed``'s timer) holds where the prediction was wrong."""
    st = lease.state
    rate = st.embedding_tokens_per_s
    source = "measured on this model"
    if rate is None and st.plan is not None and st.plan.predicted_prompt_tokens_per_s:
        rate, source = st.plan.predicted_prompt_tokens_per_s, "its plan's predicted prompt speed"
    if not rate or rate <= 0:
        return
    predicted_s = n_tokens / rate
    if predicted_s > limit_s:
        raise BadRequest(f"input: {n_tokens} tokens would take about {predicted_s:.0f} s of engine time at "
                         f"{rate:.0f} tokens/s ({source}); one request may take {limit_s:g} s (GGUF_EMBEDDING_MAX_S): "
                         f"send at most about {int(rate * limit_s)} tokens per request", param="input",
                         predicted_s=round(predicted_s, 1), limit_s=limit_s)


def _model_card(manager: ModelManager, name: str) -> dict[str, Any]:
    return {
        "id": name, "object": "model", "created": 0, "owned_by": "local",
        "loaded": manager.resident(name) is not None, "aliases": manager.registry.aliases_of(name),
    }


@router.get("/models")
async def list_models(manager: ManagerDep) -> dict[str, Any]:
    """Every model that can be served (its aliases beside it), loaded or not: the default model first
    (GGUF_DEFAULT_MODEL, where a request without a model goes), then the loaded ones, then the rest, each group in
    the registry's order. Clients and UIs that take the first entry (many do) then name a model that answers."""
    names = [e.name for e in manager.registry.list()]
    default = manager.registry.canonical(manager.settings.default_model) if manager.settings.default_model else None

    def rank(name: str) -> int:
        return 0 if name == default else 1 if manager.resident(name) is not None else 2

    return {"object": "list", "data": [_model_card(manager, n) for n in sorted(names, key=rank)]}


@router.get("/models/{name}")
async def get_model(name: str, manager: ManagerDep) -> dict[str, Any]:
    canonical = manager.registry.canonical(name)
    for entry in manager.registry.list():
        if entry.name == canonical:
            return _model_card(manager, entry.name)
    raise ModelNotFound(f"The model '{name[:200]}' does not exist", param="model")
