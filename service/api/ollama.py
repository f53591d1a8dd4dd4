"""Ollama's native API on the same models, plans and engines: what the official ``ollama`` clients call.

A chat or a generation becomes the chat (or, ``raw``, the completion) request the OpenAI routes take
(``to_chat``, ``to_generate``) and runs through the same path (``generation.start``: the same checks, queue, engine,
limits and auth), its choice read through ``service.chat.choices``, answered in Ollama's shape:

- ``POST /api/chat``, ``POST /api/generate``: NDJSON streamed unless ``stream`` is false (Ollama's default is to
  stream); ``options`` mapped (``num_predict`` max_tokens, ``temperature``, ``top_p``, ``top_k``, ``seed``,
  ``stop``, ``frequency_penalty``, ``presence_penalty``; others ignored, as Ollama ignores options a runner does not
  use), ``num_ctx`` a per-request ceiling (never a reload: larger than the model's context, it is ignored),
  ``format`` (``"json"`` or a JSON schema: the grammar path of ``response_format``), ``tools`` (OpenAI's shape)
  answered with ``message.tool_calls`` whose ``arguments`` are objects, ``think`` (thinking goes to
  ``thinking``; a loaded model that does not think: 400), ``keep_alive``; the last object has ``done``, ``done_reason`` and the timings in nanoseconds from
  the engine's own measures (``Chunk.prompt_seconds``, ``decode_seconds``). An empty prompt (or no messages)
  loads the model (``done_reason`` ``load``), with ``keep_alive`` 0 unloads it (``unload``), as Ollama does.
- ``GET /api/tags``, ``GET /api/ps``, ``POST /api/show``, ``GET /api/version``: the registry's models, the loaded
  ones with their plan's memory, one model's GGUF metadata (the probe's) and capabilities.
- ``POST /api/embed``, ``POST /api/embeddings``: the embedding path of /v1/embeddings (``openai.embed``).
- ``DELETE /api/delete``: a model file of the models directory, unloaded first; ``POST /api/pull``: a Hugging Face
  download (``service.catalog.downloads``; ``hf.co/OWNER/REPO:QUANT`` finds the file) with its progress as NDJSON.

Errors are Ollama's ``{"error": "..."}`` (``errors.OLLAMA_PATHS``) with the management API's statuses; a failure
during a stream is one ``{"error": ...}`` line. ``images`` (base64) go before their message's text (``service.api.
images``). Not supported (400 naming the field): ``suffix``,
``context``, ``template``; ``logprobs`` are not returned.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..catalog.models import ModelEntry
from ..chat.choices import Answer, Event
from ..chat.format import detect
from ..engine.base import Chunk
from ..errors import BadRequest, EngineFailure, Forbidden, ModelNotFound, ServiceError
from ..keepalive import parse_keep_alive
from ..options import merged
from ..residency import ModelManager
from .deps import DownloadsDep, ManagerDep, MetricsDep
from .errors import code_of, param_of, service_error_body
from .generation import Started, collect, may_shorten_keep_alive, resolve_model, start
from .management import PullBody as HfPull
from .openai import EmbeddingRequest, embed
from .openai_wire import ChatRequest, CompletionRequest
from .validation import KeepAlive

router = APIRouter(prefix="/api")

OLLAMA_VERSION = "0.9.0"
"""What ``/api/version`` answers: the Ollama release whose API this one follows (``think`` came in 0.9; tools and
schema ``format`` earlier). Numeric, since clients compare it (VS Code's Copilot refuses a server without one)."""

NDJSON = "application/x-ndjson"

SPEC_CACHE_FILES = 256
"""Probed headers kept for the listings (one per file identity: path, size, modification time)."""

DEFAULTS = {"temperature": 0.8, "top_p": 0.9, "top_k": 40}
"""Ollama's sampling defaults (its ``api.DefaultOptions``), used where a request's ``options`` leave them out: an
Ollama client expects these, not OpenAI's (temperature 1, no top-k)."""

FOREVER = "2318-01-01T00:00:00Z"
"""``expires_at`` of a model that never expires (pinned, keep_alive -1): Ollama writes a far-future time too."""


class Options(BaseModel):
    """The ``options`` the service maps; any other key (``num_gpu``, ``mirostat``, ``repeat_penalty``...) is
    ignored, as Ollama ignores options its runner does not use."""

    model_config = ConfigDict(extra="ignore", strict=True)

    num_predict: int | None = None
    num_ctx: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class _Generation(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1, max_length=256)
    stream: bool = True
    options: Options | None = None
    format: str | dict[str, Any] | None = None
    keep_alive: KeepAlive = None
    think: bool | Literal["low", "medium", "high"] | None = None


class ChatBody(_Generation):
    messages: list[OllamaMessage] | None = None
    tools: list[dict[str, Any]] | None = None


class GenerateBody(_Generation):
    prompt: str | None = None
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    images: list[str] | None = None
    context: list[int] | None = None
    template: str | None = None


@dataclass(frozen=True)
class _Named:
    """What ``resolve_model`` reads of a request: the model and its keep_alive."""

    model: str | None
    keep_alive: Any = None


def model_name(name: str, manager: ModelManager) -> str:
    """The service's name for an Ollama model name: Ollama's clients add the tag ``:latest`` to untagged names;
    an alias that is written with it stays as it is."""
    if name.endswith(":latest") and name not in manager.registry.aliases:
        return name[: -len(":latest")]
    return name


def _format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise BadRequest("format: \"json\" or a JSON schema", param="format")


def _sampling(body: _Generation, manager: ModelManager) -> tuple[dict[str, Any], int | None]:
    """The request's options as OpenAI fields, and its ``num_ctx`` ceiling (None: the model's context stands)."""
    o = body.options or Options.model_validate({})
    data: dict[str, Any] = {"model": model_name(body.model, manager), "stream": body.stream,
                            "keep_alive": body.keep_alive, "response_format": _format(body.format)}
    for key, default in DEFAULTS.items():
        value = getattr(o, key)
        data[key] = default if value is None else value
    if o.num_predict is not None and o.num_predict > 0:  # -1 (no limit) and -2 (fill the context): the default
        data["max_tokens"] = o.num_predict
    if o.seed is not None:
        data["seed"] = o.seed if o.seed >= 0 else -1
    for key in ("stop", "frequency_penalty", "presence_penalty"):
        if getattr(o, key) is not None:
            data[key] = getattr(o, key)
    return data, o.num_ctx


def _validated(model: type[ChatRequest] | type[CompletionRequest], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = param_of(tuple(first.get("loc", ())))
        # OpenAI's names back to Ollama's, so the message names the field the client sent.
        param = {"max_tokens": "options.num_predict", "response_format": "format"}.get(param or "", param)
        if param in ("temperature", "top_p", "top_k", "seed", "stop", "frequency_penalty", "presence_penalty"):
            param = f"options.{param}"
        raise BadRequest(f"{param}: {first.get('msg', 'invalid value')}", param=param) from None


def _arguments(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise BadRequest(f"{where}: an object", param=where)
    return json.dumps(value)


def _messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Ollama turns as OpenAI messages. Ollama's calls have no ids, and a tool result names its tool
    (``tool_name``) or nothing: ids are made for the calls, and each result answers the earliest unanswered call of
    its tool (or, unnamed, the earliest unanswered), so the prompt pairs them as the model made them."""
    out: list[dict[str, Any]] = []
    open_calls: list[tuple[str, str]] = []  # (id, name) of calls not answered yet, in order
    n = 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.images and m.role != "user":
            raise BadRequest(f"{where}.images: images are the user's (a user message)", param=f"{where}.images")
        if m.role == "tool":
            match = next((c for c in open_calls if m.tool_call_id is not None and c[0] == m.tool_call_id), None) \
                or next((c for c in open_calls if m.tool_name is not None and c[1] == m.tool_name), None) \
                or (open_calls[0] if open_calls and m.tool_name is None and m.tool_call_id is None else None)
            if match is None:
                raise BadRequest(f"{where}: a tool message answers an earlier assistant message's tool call"
                                 + (f" (none of {m.tool_name[:64]!r} is unanswered)" if m.tool_name else ""),
                                 param=f"{where}.tool_name")
            open_calls.remove(match)
            out.append({"role": "tool", "tool_call_id": match[0], "content": m.content or ""})
            continue
        msg: dict[str, Any] = {"role": m.role, "content": _with_images(m.content or "", m.images, f"{where}.images")}
        if m.tool_calls:
            if m.role != "assistant":
                raise BadRequest(f"{where}.tool_calls: on assistant messages only", param=f"{where}.tool_calls")
            calls = []
            for j, c in enumerate(m.tool_calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise BadRequest(f"{where}.tool_calls[{j}]: {{\"function\": {{\"name\", \"arguments\"}}}}",
                                     param=f"{where}.tool_calls[{j}]")
                cid: str = c["id"] if isinstance(c.get("id"), str) and c["id"] else f"call_{n}"
                n += 1
                calls.append({"id": cid, "type": "function", "function": {
                    "name": fn["name"],
                    "arguments": _arguments(fn.get("arguments", {}), f"{where}.tool_calls[{j}].function.arguments")}})
                open_calls.append((cid, fn["name"]))
            msg["tool_calls"] = calls
            msg["content"] = m.content or None
        out.append(msg)
    return out


def _with_images(text: str, images: list[str] | None, where: str) -> str | list[dict[str, Any]]:
    """A message's text with its ``images`` (base64, any format: read from the bytes) before it, as OpenAI parts
    (decoded at admission: ``service.api.images``), as Ollama places a message's images before its text."""
    if not images:
        return text
    parts: list[dict[str, Any]] = []
    for k, data in enumerate(images):
        if not isinstance(data, str) or not data:
            raise BadRequest(f"{where}[{k}]: an image, base64", param=f"{where}[{k}]")
        parts.append({"type": "image_url", "image_url": {"url": "data:image/*;base64," + data}})
    return [*parts, {"type": "text", "text": text}]


def _reasoning(manager: ModelManager) -> str:
    return "none" if manager.settings.reasoning_format == "none" else "separate"


def to_chat(body: ChatBody, manager: ModelManager) -> tuple[ChatRequest, int | None]:
    data, n_ctx = _sampling(body, manager)
    data.update({"messages": _messages(body.messages or []), "reasoning_format": _reasoning(manager)})
    if body.tools:
        data["tools"] = body.tools
    return _validated(ChatRequest, data), n_ctx


def to_generate(body: GenerateBody, manager: ModelManager) -> tuple[ChatRequest | CompletionRequest, int | None]:
    """The prompt as a user turn through the model's template, with ``system`` before it (Ollama's own rendering);
    ``raw``: the prompt as it is, a completion."""
    for name in ("suffix", "context", "template"):
        if getattr(body, name):
            raise BadRequest(f"{name}: not supported on /api/generate", param=name)
    data, n_ctx = _sampling(body, manager)
    if body.raw:
        if body.images:
            raise BadRequest("images: a raw prompt has no place for them (the template places images)",
                             param="images")
        data["prompt"] = body.prompt or ""
        return _validated(CompletionRequest, data), n_ctx
    messages = ([{"role": "system", "content": body.system}] if body.system else []) \
        + [{"role": "user", "content": _with_images(body.prompt or "", body.images, "images")}]
    data.update({"messages": messages, "reasoning_format": _reasoning(manager)})
    return _validated(ChatRequest, data), n_ctx


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _timings(last: Chunk, t0: float, load_s: float) -> dict[str, Any]:
    """The final object's figures: counts from the usage, durations from the engine's own measures (prompt: its
    uncached tokens and the first sampled token; eval: the tokens after the first), total from the request's
    arrival."""
    return {"total_duration": _ns(time.perf_counter() - t0), "load_duration": _ns(load_s),
            "prompt_eval_count": last.prompt_tokens, "prompt_eval_duration": _ns(last.prompt_seconds),
            "eval_count": last.completion_tokens, "eval_duration": _ns(last.decode_seconds)}


def _done_reason(a: Answer) -> str:
    return "length" if a.finish_reason == "length" else "stop"


def tool_calls(a: Answer) -> list[dict[str, Any]]:
    """The answer's calls in Ollama's shape: ``arguments`` an object (``{}`` while cut short by num_predict)."""
    out = []
    for i, c in enumerate(a.calls):
        try:
            args = json.loads(c.arguments) if c.arguments else {}
        except ValueError:
            args = {}  # cut short by num_predict
        out.append({"id": c.id, "function": {"index": i, "name": c.name,
                                             "arguments": args if isinstance(args, dict) else {}}})
    return out


def _load_s(manager: ModelManager, name: str, since: float) -> float:
    """The load this request waited for (0: the model was loaded before it came)."""
    st = manager.models.get(name)
    return st.load_s if st is not None and st.since >= since else 0.0


async def _preload(request: Request, manager: ModelManager, name: str, keep_alive: Any) -> str:
    """An empty request: load the model (``load``), or with keep_alive 0 unload it (``unload``), as Ollama does.
    The unload is an admin's (or anyone's under ``GGUF_KEEP_ALIVE_POLICY=ollama``): 403 for an ordinary key."""
    if keep_alive is not None and parse_keep_alive(keep_alive) == 0:
        if not may_shorten_keep_alive(request, manager.settings):
            raise Forbidden("unloading a model (keep_alive 0) needs an admin key (GGUF_ADMIN_KEYS); this key may "
                            "only lengthen a model's keep_alive")
        await manager.unload(name)
        return "unload"
    lease = await resolve_model(manager, _Named(name, keep_alive), request)
    lease.release()
    return "load"


def _shape(kind: Literal["chat", "generate"], text: str, thinking: str,
           calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    if kind == "generate":
        out: dict[str, Any] = {"response": text}
        if thinking:
            out["thinking"] = thinking
        return out
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = calls
    return {"message": message}


async def _answer(request: Request, manager: ModelManager, metrics: Any, kind: Literal["chat", "generate"],
                  body: _Generation, req: ChatRequest | CompletionRequest, n_ctx: int | None) -> Any:
    t0 = time.perf_counter()
    wall0 = time.time()
    think = body.think is not False  # false: the thinking is not shown (the template cannot be told not to think)
    st = manager.resident(req.model or "")
    if body.think not in (None, False) and st is not None and st.engine is not None \
            and st.engine.chat_format().think is None:
        # Ollama's answer too: a client that asks for thinking learns the model has none, instead of an answer
        # without it. (A model loaded on demand by this request is not checked: its format is read at load.)
        raise BadRequest(f"\"{st.name}\" does not support thinking", param="think")
    started = await start(request, manager, metrics, req, "chat" if isinstance(req, ChatRequest) else "completion",
                          n_ctx=n_ctx, default_max_tokens=manager.settings.max_tokens_default)
    if isinstance(started, JSONResponse):
        return started
    if body.stream:
        return StreamingResponse(_stream(request, manager, started, kind, think, t0, wall0), media_type=NDJSON)
    a = (await collect(request, metrics, started))[0]
    out = {"model": started.name, "created_at": _now(),
           **_shape(kind, a.content, a.reasoning if think else "", tool_calls(a)),
           "done": True, "done_reason": _done_reason(a),
           **_timings(a.last, t0, _load_s(manager, started.name, wall0))}
    return out


def _line(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


async def _stream(request: Request, manager: ModelManager, started: Started, kind: Literal["chat", "generate"],
                  think: bool, t0: float, wall0: float) -> AsyncIterator[bytes]:
    """One object per piece of text or thinking; the tool calls whole, once parsed (Ollama sends a call in one
    object, never its arguments in parts); then the final object with the reason and the timings."""
    timer = started.timer
    answer = Answer()

    def piece(e: Event) -> bytes | None:
        if e.kind == "content":
            return _line({"model": started.name, "created_at": _now(), **_shape(kind, e.text, ""), "done": False})
        if e.kind == "reasoning" and think:
            return _line({"model": started.name, "created_at": _now(), **_shape(kind, "", e.text), "done": False})
        return None

    try:
        async for c in started.results:
            if c.text or c.logprobs:
                timer.tick(len(c.tokens))
            for e in started.choices.feed(c):
                answer.add(e)
                data = piece(e)
                if data is not None:
                    yield data
        timer.generation(answer.last)
        if answer.calls:
            yield _line({"model": started.name, "created_at": _now(), **_shape(kind, "", "", tool_calls(answer)),
                         "done": False})
        yield _line({"model": started.name, "created_at": _now(), **_shape(kind, "", ""), "done": True,
                     "done_reason": _done_reason(answer),
                     **_timings(answer.last, t0, _load_s(manager, started.name, wall0))})
    except ServiceError as exc:
        _, body = service_error_body(exc, request.url.path)
        timer.metrics.error(code_of(exc, request.url.path))
        yield _line(body)
    except Exception:  # a server fault mid-stream: the stream still ends with an error line
        err = EngineFailure("the stream failed")
        _, body = service_error_body(err, request.url.path)
        timer.metrics.error(code_of(err, request.url.path))
        yield _line(body)
    finally:
        started.cancel.set()


def _loaded_reply(kind: Literal["chat", "generate"], name: str, reason: str) -> dict[str, Any]:
    return {"model": name, "created_at": _now(), **_shape(kind, "", ""), "done": True, "done_reason": reason}


@router.post("/chat")
async def chat(request: Request, body: ChatBody, manager: ManagerDep, metrics: MetricsDep) -> Any:
    if not body.messages:
        name = model_name(body.model, manager)
        return _loaded_reply("chat", name, await _preload(request, manager, name, body.keep_alive))
    req, n_ctx = to_chat(body, manager)
    return await _answer(request, manager, metrics, "chat", body, req, n_ctx)


@router.post("/generate")
async def generate(request: Request, body: GenerateBody, manager: ManagerDep, metrics: MetricsDep) -> Any:
    if not body.prompt:
        name = model_name(body.model, manager)
        return _loaded_reply("generate", name, await _preload(request, manager, name, body.keep_alive))
    req, n_ctx = to_generate(body, manager)
    return await _answer(request, manager, metrics, "generate", body, req, n_ctx)


# -- models: what the registry lists and the probe reads


def _size_label(n_params: int) -> str:
    """Ollama's ``parameter_size``: ``268.10M``, ``8.0B``."""
    return f"{n_params / 1e9:.1f}B" if n_params >= 1e9 else f"{n_params / 1e6:.2f}M"


def _file_of(entry: ModelEntry, manager: ModelManager) -> str:
    return entry.path or manager.registry.resolve(entry.name).path  # the embedded model's path once assembled


async def _spec(request: Request, manager: ModelManager, entry: ModelEntry) -> tuple[Any, str, os.stat_result]:
    """The model's probed header (``sizing.probe.probe_path``: what planning reads), its file and the file's stat;
    probes are kept per file identity on the app (a listing must not read every header again)."""
    st = manager.models.get(entry.name)
    path = await asyncio.to_thread(_file_of, entry, manager)
    stat = await asyncio.to_thread(os.stat, path)
    if st is not None and st.plan is not None and st.path == path:
        return st.plan.model, path, stat
    cache: dict[tuple[str, int, int], Any] | None = getattr(request.app.state, "ollama_specs", None)
    if cache is None:
        cache = request.app.state.ollama_specs = {}
    key = (path, stat.st_size, stat.st_mtime_ns)
    spec = cache.get(key)
    if spec is None:
        from sizing.probe import probe_path

        spec = await asyncio.to_thread(probe_path, path)
        if len(cache) >= SPEC_CACHE_FILES:
            cache.clear()  # files replaced again and again: their old identities go
        cache[key] = spec
    return spec, path, stat


def _digest(path: str, stat: os.stat_result) -> str:
    """A stable identity of the file (its path, size and modification time), not a hash of its bytes: hashing
    gigabytes for a listing would take seconds per model."""
    return hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()


def _details(spec: Any) -> dict[str, Any]:
    return {"parent_model": "", "format": "gguf", "family": spec.architecture, "families": [spec.architecture],
            "parameter_size": _size_label(spec.n_params), "quantization_level": spec.file_type_name or "unknown"}


async def _card(request: Request, manager: ModelManager, entry: ModelEntry) -> dict[str, Any]:
    spec, path, stat = await _spec(request, manager, entry)
    return {"name": entry.name, "model": entry.name, "modified_at": _iso(stat.st_mtime), "size": stat.st_size,
            "digest": _digest(path, stat), "details": _details(spec)}


@router.get("/tags")
async def tags(request: Request, manager: ManagerDep) -> dict[str, Any]:
    """Every model the registry can serve, loaded or not (a file that cannot be probed is left out)."""
    out = []
    for entry in manager.registry.list():
        try:
            out.append(await _card(request, manager, entry))
        except (ServiceError, OSError, ValueError):
            continue
    return {"models": out}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_VERSION}


@router.get("/ps")
async def ps(request: Request, manager: ManagerDep) -> dict[str, Any]:
    """The loaded models: ``size`` the plan's bytes on every device, ``size_vram`` those on GPUs, ``expires_at``
    when keep_alive unloads it (far ahead when it never does; now-ish while busy, as its timer starts when idle)."""
    out = []
    for st in manager.loaded():
        est = st.plan.estimate if st.plan is not None else None
        card = await _card(request, manager, st.entry) if st.entry is not None else {"name": st.name}
        if st.expires_at is not None:
            expires = _iso(st.expires_at)
        elif st.pinned or math.isinf(st.keep_alive_s):
            expires = FOREVER
        else:  # busy: its keep_alive starts when the last generation ends
            expires = _iso(time.time() + st.keep_alive_s)
        out.append({**card, "expires_at": expires,
                    "size": est.total_bytes if est is not None else card.get("size", 0),
                    "size_vram": sum(g.total_bytes for g in est.gpus) if est is not None else 0,
                    "context_length": st.report.n_ctx if st.report is not None else None})
    return {"models": out}


class ModelBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = Field(None, min_length=1, max_length=256)
    name: str | None = Field(None, min_length=1, max_length=256, description="The older name of ``model``.")
    verbose: bool = False

    def named(self, manager: ModelManager) -> str:
        name = self.model or self.name
        if not name:
            raise BadRequest("model: which model", param="model")
        return model_name(name, manager)


def _model_info(spec: Any, verbose: bool) -> dict[str, Any]:
    """The GGUF metadata the probe read; long arrays (the vocabulary) are summarised there, and shown as null
    unless ``verbose`` (as Ollama leaves them out)."""
    out: dict[str, Any] = {}
    for k, v in spec.metadata.items():
        if k == "tokenizer.chat_template":
            continue
        out[k] = (v if verbose else None) if isinstance(v, dict) else v
    out["general.parameter_count"] = spec.n_params
    return out


async def _sees(manager: ModelManager, entry: Any, spec: Any, st: Any) -> bool:
    """Whether the model takes images: loaded, its plan's projector; else the projector its options would find
    (``service.catalog.projectors``: ``mmproj``, a file beside the model)."""
    if st is not None and st.plan is not None and st.plan.estimate is not None:
        return st.plan.estimate.projector is not None
    value = merged(manager.settings, entry.config.options).mmproj  # the models file's, else GGUF_MMPROJ
    path = await asyncio.to_thread(manager.planner.projectors.resolve, value, entry.path or None, spec)
    return path is not None and os.path.isfile(path)


@router.post("/show")
async def show(request: Request, body: ModelBody, manager: ManagerDep) -> dict[str, Any]:
    """One model's details, GGUF metadata, template and capabilities: ``completion``; ``tools`` (every model
    calls tools here: a template that does not render them gets them described in a system message,
    ``service.chat.format``); ``thinking`` where the template writes thinking tags; ``embedding`` when the
    embedding context is on; ``vision`` where the model has a projector (``mmproj``)."""
    name = body.named(manager)
    entry = await asyncio.to_thread(manager.registry.resolve, name)
    spec, _, stat = await _spec(request, manager, entry)
    try:
        override = manager.settings.chat_template()
    except ValueError:
        override = None
    source = override or spec.metadata.get("tokenizer.chat_template") or ""
    st = manager.resident(entry.name)
    fmt = st.engine.chat_format() if st is not None and st.engine is not None else detect(source or None)
    caps = ["completion", "tools"]
    if fmt.think is not None:
        caps.append("thinking")
    embeds = st.engine.embedding_limits()[1] > 0 if st is not None and st.engine is not None \
        else manager.settings.embeddings != "off"
    if embeds:
        caps.append("embedding")
    if await _sees(manager, entry, spec, st):
        caps.append("vision")
    params = "\n".join(f"{k} {v}" for k, v in DEFAULTS.items())
    # modelfile names the model, not its file: a path on the server is not the client's business.
    return {"modified_at": _iso(stat.st_mtime), "template": source,
            "license": str(spec.metadata.get("general.license", "")), "modelfile": f"FROM {entry.name}\n",
            "parameters": params, "details": _details(spec), "model_info": _model_info(spec, body.verbose),
            "capabilities": caps}


# -- embeddings


class EmbedBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1, max_length=256)
    input: str | list[str] | None = None
    prompt: str | None = Field(None, description="/api/embeddings (the older route): one text.")
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)
    keep_alive: KeepAlive = None
    options: dict[str, Any] | None = None


async def _embeddings(request: Request, manager: ModelManager, metrics: Any, body: EmbedBody,
                      inputs: list[str]) -> tuple[Any, float, int]:
    t0 = time.perf_counter()
    max_tokens = manager.settings.embedding_max_request_tokens
    req = EmbeddingRequest.model_validate({"input": inputs, "model": model_name(body.model, manager),
                                           "dimensions": body.dimensions})
    checked = req.inputs(max_tokens)
    lease = await resolve_model(manager, _Named(req.model, body.keep_alive), request)
    try:
        result = await embed(request, lease, metrics, req, checked, max_tokens)
    finally:
        if not lease.queued:
            lease.release()
    return result, t0, 0 if isinstance(result, JSONResponse) else result["usage"]["prompt_tokens"]


@router.post("/embed")
async def embed_route(request: Request, body: EmbedBody, manager: ManagerDep, metrics: MetricsDep) -> Any:
    """Each input's pooled, L2-normalised embedding (the /v1/embeddings path). ``truncate`` is not honoured: an
    input beyond the embedding batch is a 400, never cut."""
    if body.input is None or body.input == [] or body.input == "":
        raise BadRequest("input: a string or a list of strings", param="input")
    inputs = [body.input] if isinstance(body.input, str) else body.input
    result, t0, n = await _embeddings(request, manager, metrics, body, inputs)
    if isinstance(result, JSONResponse):
        return result
    return {"model": result["model"], "embeddings": [d["embedding"] for d in result["data"]],
            "total_duration": _ns(time.perf_counter() - t0), "load_duration": 0, "prompt_eval_count": n}


@router.post("/embeddings")
async def embeddings(request: Request, body: EmbedBody, manager: ManagerDep, metrics: MetricsDep) -> Any:
    """The older route: one ``prompt``, one ``embedding``."""
    if not body.prompt:
        raise BadRequest("prompt: the text to embed", param="prompt")
    result, _, _ = await _embeddings(request, manager, metrics, body, [body.prompt])
    if isinstance(result, JSONResponse):
        return result
    return {"embedding": result["data"][0]["embedding"]}


# -- deleting and pulling files


@router.delete("/delete")
async def delete(body: ModelBody, manager: ManagerDep) -> Response:
    """Delete a model file of the models directory (where pulls put them), unloading the model first. The embedded
    models and a models-file entry are the operator's: 400."""
    name = body.named(manager)
    entry = await asyncio.to_thread(manager.registry.resolve, name)
    if entry.origin == "embedded":
        raise BadRequest(f"model '{entry.name}' is an embedded model: it cannot be deleted", param="model")
    if entry.origin != "models_dir":
        raise BadRequest(f"model '{entry.name}' comes from the models file (GGUF_MODELS_FILE): delete it there",
                         param="model")
    await manager.unload(entry.name)
    link = Path(manager.settings.models_dir) / f"{entry.name}.gguf"  # the name, not its target: a link goes alone
    try:
        await asyncio.to_thread(os.remove, link)
    except FileNotFoundError:
        raise ModelNotFound(f"model '{entry.name}' not found", param="model") from None
    except OSError as exc:
        raise EngineFailure(f"model '{entry.name}' could not be deleted: {exc.strerror or exc}") from exc
    return Response(status_code=200)


_QUANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A quantization in ``hf.co/OWNER/REPO:QUANT`` (``Q4_K_M``, ``IQ2_XXS``, ``bf16``)."""


class PullBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = Field(None, min_length=1, max_length=600)
    name: str | None = Field(None, min_length=1, max_length=600)
    stream: bool = True
    insecure: bool = False


def pull_source(name: str) -> tuple[str, str | None, str | None, str | None]:
    """``hf.co/OWNER/REPO/FILE.gguf`` or ``hf.co/OWNER/REPO:QUANT`` (Ollama's way to name a Hugging Face GGUF by
    its quantization), also with ``huggingface.co/`` or no host, ``@REVISION`` optional: the repo, the file (None:
    find it by ``QUANT``), the quantization and the revision. Ollama's registry names (``llama3:8b``) are not on
    Hugging Face: 400."""
    rest = name.strip()
    for prefix in ("https://", "http://"):
        rest = rest.removeprefix(prefix)
    hosted = rest.startswith(("hf.co/", "huggingface.co/"))
    rest = rest.split("/", 1)[1] if hosted else rest
    rest, _, revision = rest.partition("@")
    parts = rest.split("/")
    if len(parts) == 3 and parts[2].endswith(".gguf"):
        return f"{parts[0]}/{parts[1]}", parts[2], None, revision or None
    if len(parts) == 2:
        repo, colon, quant = parts[1].partition(":")
        if hosted and colon and quant:
            return f"{parts[0]}/{repo}", None, quant, revision or None
    raise BadRequest("model: a Hugging Face GGUF, hf.co/OWNER/REPO/FILE.gguf or hf.co/OWNER/REPO:QUANT (Ollama's own "
                     "registry is not reached)", param="model")


@router.post("/pull")
async def pull(body: PullBody, downloads: DownloadsDep) -> Any:
    """Download a GGUF from Hugging Face into the models directory (``service.catalog.downloads``): its progress as
    NDJSON (``status``, ``digest``, ``total``, ``completed``), then ``success`` or an ``error`` line; ``stream: false``:
    one answer once it ends."""
    repo_id, filename, quant, revision = pull_source(body.model or body.name or "")
    bad = BadRequest("model: the repo, file or revision has characters a Hugging Face name does not", param="model")
    try:
        HfPull.model_validate({"repo_id": repo_id, "filename": filename or "x.gguf", "revision": revision})
        if quant is not None and not _QUANT.fullmatch(quant):
            raise bad
    except ValidationError:
        raise bad from None
    projector = None
    if filename is None:
        assert quant is not None
        filename, projector = await asyncio.to_thread(downloads.find_quant, repo_id, quant, revision)
    try:
        checked = HfPull.model_validate({"repo_id": repo_id, "filename": filename, "revision": revision})
    except ValidationError:
        raise bad from None
    files = [checked.filename, *([projector] if projector else [])]
    first = downloads.pull(checked.repo_id, checked.filename, checked.revision)

    async def each() -> AsyncIterator[tuple[str, Any]]:
        """Each file's download as it runs: the model, then its projector (Ollama pulls a vision model's with it)."""
        for name in files:
            dl = first if name == checked.filename else downloads.pull(checked.repo_id, name, checked.revision)
            while dl.state == "downloading":
                yield name, dl
                await asyncio.sleep(0.25)
            yield name, dl
            if dl.state == "failed":
                return

    def digest(name: str) -> str:
        return "sha256:" + hashlib.sha256(f"{repo_id}/{name}@{revision}".encode()).hexdigest()

    async def progress() -> AsyncIterator[bytes]:
        yield _line({"status": "pulling manifest"})
        async for name, dl in each():
            if dl.state == "failed":
                yield _line({"error": dl.error or "the download failed"})
                return
            yield _line({"status": f"pulling {name}", "digest": digest(name), "total": dl.bytes_total or 0,
                         "completed": dl.bytes_done})
        yield _line({"status": "success"})

    if body.stream:
        return StreamingResponse(progress(), media_type=NDJSON)
    async for _, dl in each():
        if dl.state == "failed":
            return JSONResponse({"error": dl.error or "the download failed"}, status_code=502)
    return {"status": "success"}
