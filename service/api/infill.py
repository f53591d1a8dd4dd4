"""llama-server's code infilling: ``POST /infill``, fill-in-the-middle in its request and answer shapes.

The body is llama-server's (tools/server/server-context.cpp, the infill route of the llama.cpp that
llama-cpp-python 0.3.36 vendors): ``input_prefix`` and ``input_suffix`` (required), ``input_extra`` (other files
as ``{filename, text}``), ``prompt`` (text after the prefix), and /completion's sampling fields (``n_predict`` or
``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``stream``...). The prompt is the FIM
layout llama-server builds (``service.text.tasks``: repo-level FIM_REP/FIM_SEP context, then FIM_PRE
prefix prompt FIM_SUF suffix FIM_MID, truncated as it truncates), made from token ids and generated through the
one generation path (``service.api.generation.admit``, a completion). The answer is /completion's:
``{content, stop, tokens_predicted, tokens_evaluated, tokens_cached, stop_type, stopping_word, timings, ...}``;
streamed, one ``data: {content, stop: false}`` event per piece and a last one with ``stop: true`` and the
figures (no ``[DONE]``: llama-server's own API sends none).

A model whose vocabulary lacks a FIM prefix, suffix or middle token (``tokenizer.ggml.fim_pre_token_id`` ...)
gets a 400 naming ``model`` and the missing tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..chat.choices import Answer
from ..engine.base import Chunk
from ..errors import BadRequest, EngineFailure, ServiceError
from .admission import LARGE_TEXT_CHARS, refuse_unfit
from .deps import ManagerDep, MetricsDep
from .errors import code_of, service_error_body, sse
from .generation import Started, admit, cache_scope, collect, resolve_model
from .openai_wire import GenerationRequest

log = logging.getLogger(__name__)

router = APIRouter()

MAX_EXTRA_CHUNKS = 1024
"""Most ``input_extra`` chunks of one request (the body's size bounds their text)."""


class InfillChunk(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    filename: str = Field("tmp", max_length=4096, description="The file's name (llama-server's default: tmp).")
    text: str


class InfillRequest(GenerationRequest):
    input_prefix: str = Field(description="The text before the cursor.")
    input_suffix: str = Field(description="The text after the cursor.")
    input_extra: list[InfillChunk] = Field(default_factory=list, max_length=MAX_EXTRA_CHUNKS,
                                           description="Other files of the project, before the FIM prefix.")
    prompt: str = Field("", description="Text after the prefix the answer continues (control tokens parsed).")
    n_predict: int | None = Field(None, ge=-1, le=1 << 20, description="llama-server's name for max_tokens; -1: "
                                  "no limit of the client's (GGUF_MAX_TOKENS_DEFAULT caps it).")

    def requested_max_tokens(self) -> int | None:
        if self.n_predict is not None:
            return None if self.n_predict == -1 else self.n_predict
        return self.max_tokens


def _stop_type(last: Chunk) -> str:
    """llama-server's ``stop_type``: a stop word, an end-of-generation token, or the limit."""
    if last.finish_reason == "length":
        return "limit"
    if last.stop_sequence is not None:
        return "word"
    return "eos" if last.finish_reason == "stop" else "none"


def _final(name: str, last: Chunk, content: str) -> dict[str, Any]:
    prompt_ms, predicted_ms = last.prompt_seconds * 1e3, last.decode_seconds * 1e3
    evaluated = last.prompt_tokens - last.cached_tokens
    predicted = max(0, last.completion_tokens - 1)  # the first token's time is in the prompt's (Chunk.decode_seconds)
    return {
        "index": 0, "content": content, "stop": True, "model": name, "tokens_predicted": last.completion_tokens,
        "tokens_evaluated": last.prompt_tokens, "tokens_cached": last.cached_tokens, "truncated": False,
        "stop_type": _stop_type(last), "stopping_word": last.stop_sequence or "",
        "timings": {
            "prompt_n": evaluated, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / evaluated if evaluated else 0.0,
            "prompt_per_second": evaluated / last.prompt_seconds if last.prompt_seconds else 0.0,
            "predicted_n": last.completion_tokens, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / predicted if predicted else 0.0,
            "predicted_per_second": predicted / last.decode_seconds if last.decode_seconds else 0.0,
            # llama-server's names for the drafted tokens and those kept, there when a draft was verified.
            **({"draft_n": last.drafted_tokens, "draft_n_accepted": last.accepted_tokens}
               if last.drafted_tokens else {}),
        },
    }


@router.post("/infill")
async def infill(request: Request, body: InfillRequest, manager: ManagerDep, metrics: MetricsDep) -> Any:
    """Fill in the middle between ``input_prefix`` and ``input_suffix`` (llama-server's /infill)."""
    t0 = time.perf_counter()
    settings = manager.settings
    params = body.params(settings.max_tokens_default)
    if params.n != 1:
        raise BadRequest("n: /infill answers one completion", param="n")
    params = replace(params, cache_scope=cache_scope(request, settings, body.cache_salt))
    lease = await resolve_model(manager, body, request)
    try:
        missing = lease.engine.fim_tokens().missing()
        if missing:
            raise BadRequest(f"model '{lease.name}' cannot infill: its vocabulary has no " + ", ".join(missing),
                             param="model")
        extra = [(c.filename, c.text) for c in body.input_extra]
        chars = len(body.input_prefix) + len(body.input_suffix) + len(body.prompt) + sum(len(t) for _, t in extra)
        engine = lease.engine
        # The client's limit leaves room in the context for the answer (format_prompt_infill's 2 x n_predict).
        n_predict = body.requested_max_tokens() or 0
        try:
            if len(body.prompt) >= LARGE_TEXT_CHARS:  # kept whole in the layout: refused unread if it cannot fit
                per_token = int(await request.app.state.admission.run(lease.name, 0, engine.max_token_chars))
                refuse_unfit(len(body.prompt), engine.n_ctx, per_token, "prompt")
            ids: list[int] = await request.app.state.admission.run(
                lease.name, chars, lambda: engine.infill_tokens(body.input_prefix, body.input_suffix, extra,
                                                                body.prompt, n_predict))
        except ServiceError as exc:
            metrics.error(code_of(exc, request.url.path))
            raise
        started = await admit(request, lease, settings, metrics, body, "completion", params, t0, cap_only=True,
                              prompt_ids=ids)
    finally:
        if not lease.queued:
            lease.release()  # the request ended before its generation was queued
    if isinstance(started, JSONResponse):
        return started
    if body.stream:
        return StreamingResponse(_stream(request, started), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    answers = await collect(request, metrics, started)
    a = answers.get(0) or Answer()
    return _final(started.name, a.last, a.content)


async def _stream(request: Request, started: Started) -> AsyncIterator[bytes]:
    answer = Answer()
    try:
        async for c in started.results:
            if c.text:
                started.timer.tick(len(c.tokens))
            for e in started.choices.feed(c):
                answer.add(e)
                if e.kind == "content" and e.text:
                    yield sse({"index": 0, "content": e.text, "stop": False})
        started.timer.generation(answer.last)
        yield sse(_final(started.name, answer.last, ""))
    except ServiceError as exc:
        _, body = service_error_body(exc, request.url.path)
        started.timer.metrics.error(code_of(exc, request.url.path))
        yield sse(body)
    except Exception as exc:  # a server fault mid-stream: logged, and the stream still ends with an error event
        log.exception("infill stream failed")
        err = EngineFailure(f"the stream failed: {type(exc).__name__}")
        _, body = service_error_body(err, request.url.path)
        started.timer.metrics.error(code_of(err, request.url.path))
        yield sse(body)
    finally:
        started.cancel.set()


__all__ = ["InfillChunk", "InfillRequest", "router"]
