"""A model's vocabulary: llama.cpp's tokenizer, its token texts and special tokens, and the facts the templates need.

Over a loaded model, or a vocab-only load (``Vocabulary.open``: the tokenizer and the metadata, no weights; 0.5 s
and 43 MiB of host memory for gemma-3's 262,144 tokens, measured), which is what the API process holds of each
model: prompts are tokenized and answers detokenized there, and the runner takes token ids.
"""

from __future__ import annotations

import collections
import ctypes
import threading
from typing import Any, Iterable

from ..errors import BadRequest, NotReady

TOKENIZE_MEMO = 4
"""Prompts whose tokens ``tokenize`` remembers (per vocabulary)..."""
TOKENIZE_MEMO_MAX_CHARS = 256 * 1024
"""...when they are at most this long (a bound on what the memo holds)."""
FIM_NAMES = ("pre", "suf", "mid", "pad", "rep", "sep")
"""The FIM tokens llama.cpp knows (``llama_vocab_fim_pre`` ...)."""


class Vocabulary:
    """Tokens and texts of one model (``model``: llama-cpp-python's ``_internals.LlamaModel``, full or vocab-only)."""

    def __init__(self, model: Any, *, owned: bool = False) -> None:
        self._model = model
        self._owned = owned
        self.vocab = model.vocab
        self.n_vocab = int(model.n_vocab())
        self.metadata: dict[str, str] = model.metadata()
        self._lock = threading.Lock()
        self._memo: "collections.OrderedDict[tuple[str, bool, bool], list[int]]" = collections.OrderedDict()
        self._max_piece = 0
        self._pieces: dict[tuple[int, bool], bytes] = {}
        self._controls: "Spellings | None" = None

    @classmethod
    def open(cls, path: str) -> "Vocabulary":
        """A vocab-only load of the GGUF at ``path`` (``NotReady`` where llama.cpp cannot read it)."""
        import llama_cpp
        from llama_cpp import _internals

        mp = llama_cpp.llama_model_default_params()
        mp.vocab_only = True
        try:
            model = _internals.LlamaModel(path_model=path, params=mp, verbose=False)
        except ValueError as exc:
            raise NotReady(f"the vocabulary of {path} could not be read: {exc}") from exc
        return cls(model, owned=True)

    def close(self) -> None:
        if self._owned and self._model is not None:
            self._model.close()
        self._model = None

    def _require(self) -> Any:
        if self._model is None:
            raise NotReady("no model is loaded")
        return self._model

    # -- tokens

    def tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        """llama.cpp's tokenizer (``special``: control-token spellings become control tokens), remembering the
        last few prompts: the API counts a prompt's tokens before it generates from the same text (2.9 ms a
        time for 1,500 tokens, measured)."""
        key = (text, add_bos, special)
        with self._lock:
            hit = self._memo.get(key)
        if hit is not None:
            return list(hit)
        tokens = list(self._require().tokenize(text.encode("utf-8"), add_bos, special))
        if len(text) > TOKENIZE_MEMO_MAX_CHARS:
            return tokens
        with self._lock:
            self._memo[key] = tokens
            while len(self._memo) > TOKENIZE_MEMO:
                self._memo.popitem(last=False)
        return list(tokens)

    def piece(self, token: int, *, special: bool = True) -> bytes:
        """A token's bytes (``special``: a control token spelt; ``llama_token_to_piece``, sized as llama.cpp's
        ``common_token_to_piece``: a negative answer is the size the piece needs), computed once per id."""
        import llama_cpp

        key = (token, special)
        got = self._pieces.get(key)
        if got is not None:
            return got
        vocab = self._require().vocab
        size = 64
        out = b""
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(vocab, token, buf, size, 0, special)
            if n >= 0:
                out = buf.raw[:n]
                break
            size = -n
        self._pieces[key] = out
        return out

    def pieces(self, tokens: list[int]) -> list[bytes]:
        """Each token's bytes, control tokens spelt (/detokenize, /tokenize's pieces); ``BadRequest`` naming
        ``tokens`` for an id outside the vocabulary (llama.cpp would abort on one)."""
        self._require()
        for i, t in enumerate(tokens):
            if not 0 <= t < self.n_vocab:
                raise BadRequest(f"tokens[{i}]: {t} is not a token of this model (0 .. {self.n_vocab - 1})",
                                 param="tokens")
        return [self.piece(t) for t in tokens]

    def detokenize(self, tokens: list[int], special: bool = False) -> bytes:
        return bytes(self._require().detokenize(tokens, special=special))

    def is_eog(self, token: int) -> bool:
        import llama_cpp

        return bool(llama_cpp.llama_vocab_is_eog(self._require().vocab, token))

    def max_token_chars(self) -> int:
        """The longest piece of the vocabulary, in bytes (at least its characters): computed on first use, a walk
        over every token (0.55 s for gemma-3's 262,144, measured: 48 bytes), then kept."""
        import llama_cpp

        with self._lock:
            if self._max_piece:
                return self._max_piece
            vocab = self._require().vocab
            buf = ctypes.create_string_buffer(512)
            longest = 0
            for tok in range(self.n_vocab):
                longest = max(longest, int(llama_cpp.llama_token_to_piece(vocab, tok, buf, len(buf), 0, True)))
            self._max_piece = longest
            return longest

    # -- special tokens

    def special(self, name: str) -> int:
        """``bos``, ``eos``, ``sep``, or a FIM token (``fim_pre`` ...): its id, -1 where the vocabulary has none."""
        import llama_cpp

        return int(getattr(llama_cpp, f"llama_vocab_{name}")(self._require().vocab))

    def adds(self, name: str) -> bool:
        """Whether tokenizing adds the ``bos``, ``eos`` or ``sep`` token (``llama_vocab_get_add_*``)."""
        import llama_cpp

        return bool(getattr(llama_cpp, f"llama_vocab_get_add_{name}")(self._require().vocab))

    def spells_a_control_token(self, text: str) -> bool:
        """Whether ``text`` holds the text of a control or unknown token: the tokens llama.cpp's
        ``tokenizer_st_partition`` parses only with ``parse_special`` (src/llama-vocab.cpp). Where it holds none,
        tokenizing with and without ``special`` gives the same tokens, so a check for forged control tokens needs
        no tokenization. The spellings are read once (``llama_vocab_get_attr`` and ``_get_text`` per token)."""
        if self._controls is None:
            import llama_cpp

            vocab = self._require().vocab
            mask = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
            self._controls = Spellings(
                llama_cpp.llama_vocab_get_text(vocab, t).decode("utf-8", "replace")
                for t in range(self.n_vocab) if llama_cpp.llama_vocab_get_attr(vocab, t) & mask)
        return self._controls.found_in(text)

    def token_bos(self) -> int:
        return self.special("bos")

    def token_eos(self) -> int:
        return self.special("eos")


class Spellings:
    """A set of strings, and whether a text holds one of them: at each place one's first character occurs, a
    hash lookup per length (thousands of spellings that begin alike, gemma's ``<unused0>`` ... cost no more)."""

    def __init__(self, spellings: Iterable[str]) -> None:
        self._set = frozenset(s for s in spellings if s)
        self._firsts = frozenset(s[0] for s in self._set)
        self._lengths = sorted({len(s) for s in self._set})

    def found_in(self, text: str) -> bool:
        for c in self._firsts:
            pos = text.find(c)
            while pos != -1:
                if any(text[pos:pos + n] in self._set for n in self._lengths):
                    return True
                pos = text.find(c, pos + 1)
        return False


__all__ = ["FIM_NAMES", "TOKENIZE_MEMO", "Spellings", "Vocabulary"]
