"""A loaded model as the routes use it: its engine (token ids, in a runner process of its own) and its text (in
this process).

``ServedModel`` loads the engine, then the model's text (``ModelText``: a vocab-only load of the same file, the
chat template); prompts are tokenized here and generations turned into text here (``TextStream``), so that only
token ids, sampling parameters, images and cache keys cross to the runner.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from sizing.plan import Plan

from ..chat.format import ChatFormat
from ..engine.base import (CachedPrompt, Cancel, Chunk, EmbeddingResult, Engine, EngineGauges, EngineLimits, GenerationParams,
                           LoadReport, RerankResult, current_delivery, direct_delivery)
from ..errors import NotReady
from .model import LlamaText, ModelText
from .stream import TextStream
from .tasks import FimTokens

TextFactory = Callable[[str, EngineLimits, Engine], ModelText]
"""The text of a loaded model: from its file's path, its engine's limits and the engine (its image tokens)."""

def text_factory(chat_template: str | None = None) -> TextFactory:
    """A loaded model's text: the engine's own where it has one (the fake's), else a vocab-only load of the file
    (``LlamaText``) with ``chat_template`` (the operator's, ``GGUF_CHAT_TEMPLATE_FILE``), images tokenized by the
    engine."""

    def make(path: str, limits: EngineLimits, engine: Engine) -> ModelText:
        text_for = getattr(engine, "text_for", None)
        if text_for is not None:
            return text_for(path, limits)  # type: ignore[no-any-return]
        return LlamaText.open(path, limits, chat_template=chat_template, image_tokens=engine.image_tokens)

    return make


RUNNER_FACTS = frozenset({"watch", "runner_json", "pid", "state", "restarts", "failure", "last_exit"})
"""What residency reads of a runner process's engine (``ProcessEngine``), where the engine has them."""


class ServedModel:
    """An engine and the text of the model it loaded."""

    def __init__(self, engine: Engine, text_for: TextFactory) -> None:
        self.engine = engine
        self._text_for = text_for
        self.text: ModelText | None = None

    @classmethod
    def of(cls, engine: Engine, *, chat_template: str | None = None) -> "ServedModel":
        """``engine`` with the text ``text_factory`` makes (tests and benches that load one engine themselves)."""
        return cls(engine, text_factory(chat_template))

    def __getattr__(self, name: str) -> Any:
        if name in RUNNER_FACTS:
            return getattr(self.engine, name)
        raise AttributeError(name)

    def _txt(self) -> ModelText:
        text = self.text
        if text is None:
            raise NotReady("no model is loaded")
        return text

    # -- load and unload

    def load(self, path: str, plan: Plan) -> LoadReport:
        self._close_text()
        report = self.engine.load(path, plan)
        try:
            self.text = self._text_for(path, self.engine.limits, self.engine)
        except BaseException:
            self.engine.unload()
            raise
        return report

    def unload(self) -> None:
        self.engine.unload()
        self._close_text()

    def _close_text(self) -> None:
        text, self.text = self.text, None
        if text is not None:
            text.close()

    # -- the engine's figures

    @property
    def limits(self) -> EngineLimits:
        return self.engine.limits

    @property
    def n_ctx(self) -> int:
        return self.engine.limits.n_ctx

    @property
    def slots(self) -> int:
        return self.engine.limits.slots

    @property
    def n_vocab(self) -> int:
        return self.engine.limits.n_vocab

    @property
    def kv_cells_allocated(self) -> int:
        return self.engine.limits.kv_cells_allocated

    def embedding_limits(self) -> tuple[int, int]:
        return self.engine.limits.embedding

    def rerank_limit(self) -> int:
        return self.engine.limits.rerank

    def gauges(self) -> EngineGauges:
        """The engine's gauges now (a runner's: one round trip): read once per scrape."""
        return self.engine.gauges()

    @property
    def kv_cells_used(self) -> int:
        return self.engine.gauges().kv_cells_used

    @property
    def running_sequences(self) -> int:
        return self.engine.gauges().running_sequences

    @property
    def prompt_tokens_evaluated(self) -> int:
        return self.engine.gauges().prompt_tokens_evaluated

    @property
    def prompt_cache_gauges(self) -> dict[str, int]:
        return dict(self.engine.gauges().prompt_cache)

    def set_prompt_cache_budget(self, budget_bytes: int) -> None:
        self.engine.set_prompt_cache_budget(budget_bytes)

    def forget(self) -> None:
        self.engine.forget()

    def cached_prompts(self) -> tuple[CachedPrompt, ...]:
        return self.engine.cached_prompts()

    # -- the engine's work

    def check(self, params: GenerationParams) -> None:
        self.engine.check(params)

    def embed(self, inputs: list[list[int]], cancel: Cancel) -> EmbeddingResult:
        return self.engine.embed(inputs, cancel)

    def rerank(self, inputs: list[list[int]], cancel: Cancel) -> RerankResult:
        return self.engine.rerank(inputs, cancel)

    def generate(self, tokens: list[int], params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        """The engine's generation as text (``TextStream``); where the queue's worker takes the chunks directly
        (``direct_delivery``), they are turned into text on the thread that delivers them."""
        stream = TextStream(self._txt().token_bytes, params, cancel)
        outer = current_delivery()
        if outer is None:
            for c in self.engine.generate(tokens, params, cancel):
                yield from stream.feed(c)
            return

        def deliver(item: Any) -> None:
            if isinstance(item, Chunk):
                for c in stream.feed(item):
                    outer(c)
            else:
                outer(item)

        flush = getattr(outer, "flush", None)
        if flush is not None:
            deliver.flush = flush  # type: ignore[attr-defined]
        with direct_delivery(deliver):
            for c in self.engine.generate(tokens, params, cancel):
                yield from stream.feed(c)

    def complete(self, prompt: str, params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        return self.generate(self.prompt_tokens(prompt), params, cancel)

    def chat(self, messages: list[dict[str, Any]], params: GenerationParams, cancel: Cancel,
             tools: list[dict[str, Any]] | None = None) -> Iterator[Chunk]:
        return self.generate(self.chat_prompt_tokens(messages, tools), params, cancel)

    # -- the text's

    def chat_format(self) -> ChatFormat:
        return self._txt().chat_format()

    def tokenize(self, text: str) -> list[int]:
        return self._txt().tokenize(text)

    def count_tokens(self, text: str) -> int:
        return self._txt().count_tokens(text)

    def count_chat_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
        return self._txt().count_chat_tokens(messages, tools)

    def max_token_chars(self) -> int:
        return self._txt().max_token_chars()

    def prompt_tokens(self, prompt: str) -> list[int]:
        return self._txt().prompt_tokens(prompt)

    def chat_prompt_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self._txt().chat_prompt_tokens(messages, tools)

    def tokenize_text(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self._txt().tokenize_text(text, add_special, parse_special)

    def token_pieces(self, tokens: list[int]) -> list[bytes]:
        return self._txt().token_pieces(tokens)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        return self._txt().render_chat(messages, tools)

    def fim_tokens(self) -> FimTokens:
        return self._txt().fim_tokens()

    def rerank_tokens(self, query: str, documents: list[str], max_tokens: int) -> list[list[int]]:
        return self._txt().rerank_tokens(query, documents, max_tokens)

    def infill_tokens(self, prefix: str, suffix: str, extra: list[tuple[str, str]], prompt: str,
                      n_predict: int) -> list[int]:
        return self._txt().infill_tokens(prefix, suffix, extra, prompt, n_predict)
