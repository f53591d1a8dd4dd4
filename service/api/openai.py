"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..engine.base import Cancel, Chunk, GenerationParams
from ..errors import BadRequest, ContextLengthExceeded, ModelNotFound, NotReady, ServiceError
from ..runner import chunks
from .deps import ManagerDep
from .errors import service_error_body, sse

router = APIRouter(prefix="/v1")

MAX_STOP = 4


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return v

    def params(self) -> GenerationParams:
        if self.n != 1:
            raise BadRequest("only n=1 is supported", param="n")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return GenerationParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, stop=stop, seed=self.seed
        )


class CompletionRequest(_Common):
    prompt: str | list[str]

    def prompt_text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise BadRequest("exactly one prompt is supported", param="prompt")
            return self.prompt[0]
        return self.prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def params(self) -> GenerationParams:
        # Chat has no default limit in the OpenAI API: until the model stops or the context ends.
        p = super().params()
        limit = self.max_tokens if "max_tokens" in self.model_fields_set else self.max_completion_tokens
        return replace(p, max_tokens=limit)


def _served_name(manager: Any, requested: str | None) -> str:
    """The loaded model's name, or an error when the request names another model."""
    cur = manager.current
    if requested is not None and (cur is None or requested != cur.name):
        manager.registry.resolve(requested)  # 404 for an unknown name
        raise NotReady(f"model '{requested}' is not loaded; load it with POST /api/models/load", param="model")
    if cur is None or cur.state != "loaded":
        raise NotReady("the model is not loaded yet" if cur is None or cur.state == "loading" else f"the model is {cur.state}")
    return str(cur.name)


async def _check_context(manager: Any, n_prompt: int, max_tokens: int | None) -> None:
    n_ctx = manager.engine.n_ctx
    if n_prompt >= n_ctx:
        raise ContextLengthExceeded(
            f"the prompt has {n_prompt} tokens but the context holds {n_ctx}",
            param="messages" if max_tokens is None else "prompt",
            n_prompt_tokens=n_prompt, n_ctx=n_ctx,
        )
    if max_tokens is not None and n_prompt + max_tokens > n_ctx:
        raise ContextLengthExceeded(
            f"the prompt's {n_prompt} tokens plus max_tokens {max_tokens} exceed the context of {n_ctx} tokens",
            param="max_tokens", n_prompt_tokens=n_prompt, n_ctx=n_ctx,
        )


async def _collect(request: Request, agen: AsyncIterator[Chunk], cancel: Cancel) -> list[Chunk]:
    """All chunks of a non-streamed generation, cancelling it if the client disconnects."""
    out: list[Chunk] = []
    it = agen.__aiter__()
    while True:
        nxt = asyncio.ensure_future(it.__anext__())
        while not nxt.done():
            done, _ = await asyncio.wait({nxt}, timeout=0.25)
            if not done and await request.is_disconnected():
                cancel.set()
        try:
            out.append(nxt.result())
        except StopAsyncIteration:
            return out


def _usage(last: Chunk) -> dict[str, int]:
    return {
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "total_tokens": last.prompt_tokens + last.completion_tokens,
    }


async def _run(request: Request, manager: Any, body: _Common, kind: Literal["completion", "chat"]) -> Any:
    name = _served_name(manager, body.model)
    params = body.params()
    engine = manager.engine
    cancel = Cancel()
    if kind == "completion":
        assert isinstance(body, CompletionRequest)
        prompt = body.prompt_text()
        n_prompt = await manager.runner.call(lambda: engine.count_tokens(prompt))
        work = lambda: engine.complete(prompt, params, cancel)  # noqa: E731
    else:
        assert isinstance(body, ChatRequest)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        n_prompt = await manager.runner.call(lambda: engine.count_chat_tokens(messages))
        work = lambda: engine.chat(messages, params, cancel)  # noqa: E731
    await _check_context(manager, n_prompt, params.max_tokens)
    job = manager.runner.submit(work, cancel)
    rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        gen = _stream(request, chunks(job), cancel, kind, rid, created, name, include_usage)
        return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    got = await _collect(request, chunks(job), cancel)
    text = "".join(c.text for c in got)
    last = got[-1] if got else Chunk(finish_reason="stop")
    finish = last.finish_reason if last.finish_reason != "cancelled" else "stop"
    if kind == "completion":
        choice: dict[str, Any] = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion"
    return JSONResponse({"id": rid, "object": obj, "created": created, "model": name, "choices": [choice], "usage": _usage(last)})


async def _stream(
    request: Request, agen: AsyncIterator[Chunk], cancel: Cancel, kind: str, rid: str, created: int, model: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"

    def event(delta_text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if kind == "completion":
            choice: dict[str, Any] = {"text": delta_text or "", "index": 0, "logprobs": None, "finish_reason": finish}
        else:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if delta_text is not None:
                delta["content"] = delta_text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}

    try:
        if kind == "chat":
            yield sse(event("", None, role=True))
        last = Chunk()
        async for c in agen:
            if c.text:
                yield sse(event(c.text, None))
            if c.finish_reason is not None:
                last = c
        finish = last.finish_reason if last.finish_reason != "cancelled" else "stop"
        yield sse(event(None if kind == "chat" else "", finish))
        if include_usage:
            yield sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": _usage(last)})
    except ServiceError as exc:
        _, body = service_error_body(exc, request.url.path)
        yield sse(body)
    finally:
        cancel.set()
    yield sse("[DONE]")


@router.post("/completions")
async def completions(request: Request, body: CompletionRequest, manager: ManagerDep) -> Any:
    return await _run(request, manager, body, "completion")


@router.post("/chat/completions")
async def chat_completions(request: Request, body: ChatRequest, manager: ManagerDep) -> Any:
    return await _run(request, manager, body, "chat")


@router.get("/models")
async def list_models(manager: ManagerDep) -> dict[str, Any]:
    cur = manager.current
    data = []
    for entry in manager.registry.list():
        data.append({
            "id": entry.name,
            "object": "model",
            "created": 0,
            "owned_by": "local",
            "loaded": cur is not None and cur.name == entry.name and cur.state == "loaded",
        })
    return {"object": "list", "data": data}


@router.get("/models/{name}")
async def get_model(name: str, manager: ManagerDep) -> dict[str, Any]:
    for entry in manager.registry.list():
        if entry.name == name:
            return {"id": entry.name, "object": "model", "created": 0, "owned_by": "local"}
    raise ModelNotFound(f"The model '{name[:200]}' does not exist", param="model")
