"""llama-server's text utilities: ``/tokenize``, ``/detokenize`` and ``/apply-template``, in its shapes.

They answer from the model a request names (or the default one), off the engine's queue: tokenizing runs in the
admission pool (``service.api.admission``: long texts in their bounded lane), as prompts are. ``/tokenize``
parses control-token spellings by default, as llama-server does (``parse_special``: its answer is only a list of
ids, never a prompt); ``/detokenize`` refuses an id outside the vocabulary (llama.cpp would abort on one);
``/apply-template`` renders a chat request's messages (and tools) with the model's template, exactly as
/v1/chat/completions renders them before tokenizing.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from .admission import client_chars
from .deps import ManagerDep
from .generation import chat_setup, resolve_model
from .openai_wire import ChatRequest
from .validation import KeepAlive

router = APIRouter()

MAX_TOKENS_IN = 1 << 20
"""Most token ids one /detokenize takes (the body's size bounds it too)."""


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, max_length=256)
    content: str = Field(description="The text to tokenize.")
    add_special: bool = Field(False, description="Add BOS (and what else the model adds), as a prompt gets it.")
    parse_special: bool = Field(True, description="Control-token spellings become control tokens (llama-server's "
                                "default).")
    with_pieces: bool = Field(False, description="Each token as {id, piece}: the piece a string when it is UTF-8, "
                              "else its bytes.")
    keep_alive: KeepAlive = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, max_length=256)
    tokens: list[StrictInt] = Field(max_length=MAX_TOKENS_IN)
    keep_alive: KeepAlive = None


def _piece(raw: bytes) -> str | list[int]:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:  # part of a character: llama-server answers the bytes
        return list(raw)


@router.post("/tokenize")
async def tokenize(request: Request, body: TokenizeRequest, manager: ManagerDep) -> dict[str, Any]:
    """The model's tokens for ``content`` (llama-server's /tokenize)."""
    lease = await resolve_model(manager, body, request)
    try:
        engine = lease.engine
        tokens: list[int] = await request.app.state.admission.run(
            lease.name, len(body.content), lambda: engine.tokenize_text(body.content, body.add_special,
                                                                        body.parse_special))
        if not body.with_pieces:
            return {"tokens": tokens}
        pieces: list[bytes] = await request.app.state.admission.run(lease.name, 0, lambda: engine.token_pieces(tokens))
        return {"tokens": [{"id": t, "piece": _piece(p)} for t, p in zip(tokens, pieces)]}
    finally:
        lease.release()


@router.post("/detokenize")
async def detokenize(request: Request, body: DetokenizeRequest, manager: ManagerDep) -> dict[str, str]:
    """The text of ``tokens``, control tokens spelt (llama-server's /detokenize); 400 naming ``tokens`` for an id
    outside the vocabulary."""
    lease = await resolve_model(manager, body, request)
    try:
        engine = lease.engine
        pieces: list[bytes] = await request.app.state.admission.run(lease.name, 0,
                                                                    lambda: engine.token_pieces(body.tokens))
    finally:
        lease.release()
    return {"content": b"".join(pieces).decode("utf-8", "replace")}


@router.post("/apply-template")
async def apply_template(request: Request, body: ChatRequest, manager: ManagerDep) -> dict[str, str]:
    """A chat request's prompt as the model's template renders it (llama-server's /apply-template): the body of
    /v1/chat/completions (its messages and tools), nothing generated."""
    body.check_messages()
    params = body.params(manager.settings.max_tokens_default)
    lease = await resolve_model(manager, body, request)
    try:
        engine = lease.engine
        _, _, tools = chat_setup(body, engine, manager.settings, params)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        prompt: str = await request.app.state.admission.run(lease.name, client_chars(messages),
                                                            lambda: engine.render_chat(messages, tools))
    finally:
        lease.release()
    return {"prompt": prompt}


__all__ = ["DetokenizeRequest", "TokenizeRequest", "router"]
