"""vLLM's render routes: ``POST /v1/completions/render`` and ``POST /v1/chat/completions/render``.

A router in front of several replicas (llm-d's precise prefix-cache scorer) asks a server which token ids a request
would evaluate, so that it can match them against the blocks each replica holds (its KV events). The body is the
one of ``/v1/completions`` or ``/v1/chat/completions``; nothing is generated and the model's queue is not used:
the prompt is rendered and tokenized by the code generation uses (``service.api.generation.prompt_source``, then
``prompt_tokens`` off the engine's queue), so the ids are the ones that request would evaluate, and a request
that generation would refuse (a prompt over the context, a bad tool) is refused here the same way.

The answer has vLLM's ``GenerateRequest`` shape: ``request_id``, ``token_ids``, ``features`` (null: no images
as vLLM's multimodal features), ``sampling_params``, and ``model``; for completions a list of them, one per
prompt (one prompt per request here, as ``/v1/completions`` takes).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request

from ..engine.base import GenerationParams
from .admission import prompt_tokens
from .deps import ManagerDep
from .generation import check_context, prompt_source, resolve_model
from .openai_wire import COMPLETIONS_DEFAULT_MAX_TOKENS, ChatRequest, CompletionRequest, GenerationRequest

router = APIRouter(prefix="/v1")


def _sampling(params: GenerationParams) -> dict[str, Any]:
    """The request's sampling parameters under vLLM's ``SamplingParams`` names."""
    return {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k or -1,
            "min_p": params.min_p, "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty, "seed": params.seed, "stop": list(params.stop),
            "max_tokens": params.max_tokens, "ignore_eos": params.ignore_eos, "n": params.n}


async def _render(request: Request, manager: Any, body: GenerationRequest,
                  kind: Literal["completion", "chat"]) -> dict[str, Any]:
    default = COMPLETIONS_DEFAULT_MAX_TOKENS if kind == "completion" else manager.settings.max_tokens_default
    params = body.params(default)
    lease = await resolve_model(manager, body, request)
    try:
        engine = lease.engine
        source = await prompt_source(request, body, kind, engine, manager.settings, params)
        params = source.params or params
        tokens = await prompt_tokens(request.app.state.admission, lease.name, engine, param=source.param,
                                     prompt=source.prompt, messages=source.messages, tools=source.tools)
        asked = body.requested_max_tokens() if kind == "chat" else params.max_tokens
        check_context(engine.n_ctx, len(tokens), asked, source.param)
        name = lease.name
    finally:
        lease.release()
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return {"request_id": f"{prefix}-{uuid.uuid4().hex}", "model": name, "token_ids": tokens, "features": None,
            "sampling_params": _sampling(params), "stream": bool(body.stream)}


@router.post("/completions/render")
async def completions_render(request: Request, body: CompletionRequest, manager: ManagerDep) -> list[dict[str, Any]]:
    """The token ids ``/v1/completions`` would evaluate for this body, one entry per prompt; nothing generated."""
    return [await _render(request, manager, body, "completion")]


@router.post("/chat/completions/render")
async def chat_completions_render(request: Request, body: ChatRequest, manager: ManagerDep) -> dict[str, Any]:
    """The token ids ``/v1/chat/completions`` would evaluate for this body (its template, tools and images);
    nothing generated."""
    return await _render(request, manager, body, "chat")


__all__ = ["router"]
