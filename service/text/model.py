"""A loaded model's text, in the API process: its vocabulary (a vocab-only load), chat template and prompts.

``ModelText`` is what ``ServedModel`` asks of it; ``LlamaText`` is llama.cpp's tokenizer behind it (the fake
engine's is word-based, ``service.testing.fake.FakeText``).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from ..chat.format import ChatFormat
from ..engine.base import EngineLimits, ImageInput
from .prompts import Prompter
from .tasks import FimTokens, TaskPrompter
from .chat_template import template_for
from .vocab import Vocabulary

ImageTokens = Callable[[ImageInput, str], tuple[list[int], list[int], list[int]]]
"""An image's tokens for a prompt (the engine's ``image_tokens``)."""


class ModelText(Protocol):
    """Prompts into tokens, tokens into text, for one loaded model."""

    def chat_format(self) -> ChatFormat: ...

    def tokenize(self, text: str) -> list[int]:
        """Tokens of ``text`` as embeddings take it (BOS added, control-token spellings as text)."""
        ...

    def count_tokens(self, text: str) -> int: ...

    def count_chat_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int: ...

    def max_token_chars(self) -> int:
        """The most characters one token of the vocabulary spells (0: unknown)."""
        ...

    def prompt_tokens(self, prompt: str) -> list[int]:
        """A completion prompt's tokens (BOS added, control tokens parsed)."""
        ...

    def chat_prompt_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A chat's rendered prompt's tokens (every client span tokenized as text)."""
        ...

    def tokenize_text(self, text: str, add_special: bool, parse_special: bool) -> list[int]: ...

    def token_pieces(self, tokens: list[int]) -> list[bytes]: ...

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str: ...

    def fim_tokens(self) -> FimTokens: ...

    def rerank_tokens(self, query: str, documents: list[str], max_tokens: int) -> list[list[int]]: ...

    def infill_tokens(self, prefix: str, suffix: str, extra: list[tuple[str, str]], prompt: str,
                      n_predict: int) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes:
        """A sampled token's text as the answer writes it."""
        ...

    def close(self) -> None: ...


class LlamaText:
    """``ModelText`` over llama.cpp's vocabulary (``Vocabulary``), the model's chat template (or the operator's,
    ``GGUF_CHAT_TEMPLATE_FILE``; llama.cpp's built-in one for files without), and the engine's image tokens."""

    def __init__(self, vocab: Vocabulary, limits: EngineLimits, *, chat_template: str | None = None,
                 image_tokens: ImageTokens | None = None) -> None:
        self.vocab = vocab
        self.prompter = Prompter(vocab, template_for(vocab, chat_template), image_tokens if limits.images else None)
        self.tasks = TaskPrompter(vocab, rerank_template=_rerank_template(vocab), n_batch=limits.n_batch,
                                  n_ctx_seq=limits.n_ctx)
        # Markers of the template's tool calls and thinking that are control tokens are written out in the text
        # (as llama-server's preserved tokens), so that the parsers see them; other control tokens stay silent.
        self._preserved = set(self.prompter.chat_format().special.values())
        self._bytes: dict[int, bytes] = {}

    @classmethod
    def open(cls, path: str, limits: EngineLimits, *, chat_template: str | None = None,
             image_tokens: ImageTokens | None = None) -> "LlamaText":
        """The text of the GGUF at ``path``, from a vocab-only load."""
        return cls(Vocabulary.open(path), limits, chat_template=chat_template, image_tokens=image_tokens)

    def close(self) -> None:
        self.vocab.close()

    def token_bytes(self, token: int) -> bytes:
        """``detokenize([token])``: a function of the token id alone, so computed once per id."""
        got = self._bytes.get(token)
        if got is None:
            got = self._bytes[token] = self.vocab.detokenize([token], special=token in self._preserved)
        return got

    def chat_format(self) -> ChatFormat:
        return self.prompter.chat_format()

    def tokenize(self, text: str) -> list[int]:
        return self.vocab.tokenize(text, add_bos=True, special=False)

    def count_tokens(self, text: str) -> int:
        return self.prompter.count_tokens(text)

    def count_chat_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
        return self.prompter.count_chat_tokens(messages, tools)

    def max_token_chars(self) -> int:
        return self.vocab.max_token_chars()

    def prompt_tokens(self, prompt: str) -> list[int]:
        return self.prompter.prompt_tokens(prompt)

    def chat_prompt_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.prompter.chat_prompt_tokens(messages, tools)

    def tokenize_text(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self.prompter.tokenize_text(text, add_special, parse_special)

    def token_pieces(self, tokens: list[int]) -> list[bytes]:
        return self.vocab.pieces(tokens)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        return self.prompter.render_chat(messages, tools)

    def fim_tokens(self) -> FimTokens:
        return self.tasks.fim_tokens()

    def rerank_tokens(self, query: str, documents: list[str], max_tokens: int) -> list[list[int]]:
        return self.tasks.rerank_tokens(query, documents, max_tokens)

    def infill_tokens(self, prefix: str, suffix: str, extra: list[tuple[str, str]], prompt: str,
                      n_predict: int) -> list[int]:
        return self.tasks.infill_tokens(prefix, suffix, extra, prompt, n_predict)


def _rerank_template(vocab: Vocabulary) -> str | None:
    """The GGUF's ``tokenizer.chat_template.rerank`` (``{query}``, ``{document}``), when it has one."""
    return vocab.metadata.get("tokenizer.chat_template.rerank") or None
