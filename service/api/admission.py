"""A prompt's tokens, before the engine's queue: off its first-in-first-out path, bounded, and refused unread
when no tokenization could fit the context.

A request's prompt used to be tokenized by the engine's worker in queue order: a multi-megabyte prompt held a
worker for seconds before its length check refused it, and eight of them made a 2-token completion wait 32.8 s
(issue 29). Now the route tokenizes first, on a pool of its own:

- a text that no tokenization can fit is refused at once, unread: every token spells at most
  ``max_token_chars()`` characters (the longest piece of the vocabulary, ``Engine.max_token_chars``), so a text of
  more than ``n_ctx * max_token_chars`` characters holds more than ``n_ctx`` tokens whatever they are;
- texts under ``LARGE_TEXT_CHARS`` are tokenized at once (milliseconds); longer ones take one of
  ``LARGE_AT_ONCE`` places per model, so a flood of long prompts never delays a short one;
- the tokens go to the engine with the request (``Engine.generate``): a prompt is tokenized once, and its
  length is checked against the context before it is queued.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ..errors import ContextLengthExceeded

LARGE_TEXT_CHARS = 64 * 1024
"""Texts from this many characters on are tokenized in the bounded lane (a few ms below it, seconds above)."""
LARGE_AT_ONCE = 2
"""Long texts one model tokenizes at once; more wait their turn (short ones never wait for them)."""
WORKERS = 8


class Admission:
    """The tokenizing pool of one app (on its state): a lane for short texts, a bounded lane per model for long."""

    def __init__(self, workers: int = WORKERS) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")
        self._large: dict[str, asyncio.Semaphore] = {}

    async def run(self, model: str, chars: int, fn: Callable[[], Any]) -> Any:
        """``fn()`` (a tokenization of ``chars`` characters for ``model``) on the pool, in its lane."""
        loop = asyncio.get_running_loop()
        if chars < LARGE_TEXT_CHARS:
            return await loop.run_in_executor(self._pool, fn)
        lane = self._large.setdefault(model, asyncio.Semaphore(LARGE_AT_ONCE))
        async with lane:
            return await loop.run_in_executor(self._pool, fn)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def client_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the client's text that any chat template renders whole: the content of every message but
    the assistant's (templates may drop a past answer's thinking), string or text parts."""
    n = 0
    for m in messages:
        if m.get("role") == "assistant":
            continue
        content = m.get("content")
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return n


def refuse_unfit(chars: int, n_ctx: int, max_token_chars: int, param: str) -> None:
    """``ContextLengthExceeded`` for a text of ``chars`` characters no tokenization fits into ``n_ctx`` tokens."""
    if max_token_chars > 0 and n_ctx > 0 and chars > n_ctx * max_token_chars:
        raise ContextLengthExceeded(
            f"the {param} holds {chars} characters; a token of this model spells at most {max_token_chars}, so it "
            f"takes more than the {n_ctx} tokens of the context", param=param, n_ctx=n_ctx)


async def prompt_tokens(admission: Admission, model: str, engine: Any, *, param: str, prompt: str | None = None,
                        messages: list[dict[str, Any]] | None = None,
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The tokens of a completion's ``prompt`` or a chat's ``messages`` (and ``tools``), as the engine evaluates
    them; refused unread when they cannot fit (``refuse_unfit``)."""
    chars = len(prompt) if prompt is not None else client_chars(messages or [])
    if chars >= LARGE_TEXT_CHARS:
        per_token = int(await admission.run(model, 0, engine.max_token_chars))
        refuse_unfit(chars, engine.n_ctx, per_token, param)
    if prompt is not None:
        return await admission.run(model, chars, lambda: engine.prompt_tokens(prompt))  # type: ignore[no-any-return]
    return await admission.run(model, chars,  # type: ignore[no-any-return]
                               lambda: engine.chat_prompt_tokens(messages or [], tools))


__all__ = ["LARGE_AT_ONCE", "LARGE_TEXT_CHARS", "Admission", "client_chars", "prompt_tokens", "refuse_unfit"]
