"""The prompts of llama-server's rerank and infill tasks, as token ids.

Mirrors ``format_prompt_rerank`` and ``format_prompt_infill`` (tools/server/server-common.cpp of the llama.cpp
that llama-cpp-python 0.3.36 vendors):

- **Rerank.** With the GGUF's ``tokenizer.chat_template.rerank``, its ``{query}`` and ``{document}`` replaced,
  tokenized without BOS and with control tokens parsed; else ``[BOS] query [EOS] [SEP] document [EOS]``, each
  special token only where the vocabulary adds it (``llama_vocab_get_add_bos``/``_eos``/``_sep``; SEP stands in
  for a missing EOS), query and document tokenized as text. One difference: where the query or a document
  spells a control token, the template's text and the client's are tokenized apart (the client's as text), so a
  request cannot forge the template's markers; llama-server parses the whole string.
- **Infill.** The repo-level FIM layout (Qwen2.5-Coder's, arXiv 2409.12186): ``[FIM_REP]myproject\\n``, then
  for each extra chunk ``[FIM_SEP]filename\\n`` and its text (without FIM_SEP: a ``--- snippet ---`` line), then
  ``[FIM_SEP]filename\\n``; then ``[BOS]`` where the vocabulary adds it, ``[FIM_PRE]`` prefix prompt
  ``[FIM_SUF]`` suffix ``[FIM_MID]``. The prefix keeps its last ``3 * n_batch / 4`` tokens, the suffix its first
  ``n_batch / 4 - 2 - len(prompt)``; the extra context keeps its last ``n_ctx - n_batch - 2 * n_predict`` tokens
  (``infill_layout``, pure). llama-server's ``--spm-infill`` order is not built.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BadRequest, ContextLengthExceeded
from .vocab import FIM_NAMES, Vocabulary

FIM_REQUIRED = ("pre", "suf", "mid")
_SNIPPET = "\n\n--- snippet ---\n\n"
"""llama-server's chunk separator when the vocabulary has no FIM_SEP (``k_chunk_prefix_str``)."""


@dataclass(frozen=True)
class FimTokens:
    """The vocabulary's FIM token ids (-1: the vocabulary has none: ``LLAMA_TOKEN_NULL``)."""

    pre: int = -1
    suf: int = -1
    mid: int = -1
    pad: int = -1
    rep: int = -1
    sep: int = -1

    def missing(self) -> list[str]:
        """The required FIM tokens the vocabulary lacks, by their GGUF keys."""
        return [f"tokenizer.ggml.fim_{n}_token_id" for n in FIM_REQUIRED if getattr(self, n) < 0]


def infill_layout(fim: FimTokens, *, extra: list[int], prefix: list[int], suffix: list[int], prompt: list[int],
                  bos: int | None, n_batch: int, n_ctx: int, n_predict: int) -> list[int]:
    """``format_prompt_infill``'s token order and truncation, given every part already tokenized (``extra``: the
    repo-level context, FIM_REP and FIM_SEP lines included; ``bos``: None where the vocabulary adds none)."""
    n_prefix_take = min(len(prefix), 3 * (n_batch // 4))
    n_suffix_take = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    out = extra[len(extra) - n_extra_take:] if n_extra_take else []
    if bos is not None:
        out.append(bos)
    out += [fim.pre, *prefix[len(prefix) - n_prefix_take:], *prompt, fim.suf, *suffix[:n_suffix_take], fim.mid]
    return out


@dataclass(frozen=True)
class _Specials:
    """What ``format_prompt_rerank`` adds around a pair without a template: the vocabulary's flags and ids (SEP
    stands in for a missing EOS)."""

    add_bos: bool
    add_eos: bool
    add_sep: bool
    bos: int
    eos: int
    sep: int


class TaskPrompter:
    """Rerank and infill prompts over a vocabulary; ``n_batch`` and ``n_ctx_seq`` are the loaded context's (the
    infill layout's truncation)."""

    def __init__(self, vocab: Vocabulary, *, rerank_template: str | None, n_batch: int, n_ctx_seq: int) -> None:
        self.vocab = vocab
        self._rerank_template = rerank_template
        self._n_batch = n_batch
        self._n_ctx_seq = n_ctx_seq

    def _tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        return self.vocab.tokenize(text, add_bos=add_bos, special=special)

    def fim_tokens(self) -> FimTokens:
        return FimTokens(*(self.vocab.special(f"fim_{n}") for n in FIM_NAMES))

    def _plain(self, text: str) -> bool:
        """No control token's spelling in ``text`` (it tokenizes the same with and without parsing them)."""
        return self._tokenize(text, add_bos=False) == self._tokenize(text, add_bos=False, special=False)

    def _rerank_pair(self, query: list[int], query_text: str, document: str, v: "_Specials") -> list[int]:
        template = self._rerank_template
        if template is not None:
            if self._plain(query_text) and self._plain(document):
                return self._tokenize(template.replace("{query}", query_text).replace("{document}", document),
                                      add_bos=False)
            out: list[int] = []
            for piece, client in _split_template(template, query_text, document):
                out += self._tokenize(piece, add_bos=False, special=not client)
            return out
        out = [v.bos] if v.add_bos else []
        out += query
        if v.add_eos:
            out.append(v.eos)
        if v.add_sep:
            out.append(v.sep)
        out += self._tokenize(document, add_bos=False, special=False)
        if v.add_eos:
            out.append(v.eos)
        return out

    def rerank_tokens(self, query: str, documents: list[str], max_tokens: int) -> list[list[int]]:
        """Each (query, document) pair's tokens (see the module docstring), counted as they are made: more than
        ``max_tokens`` in all is a ``BadRequest`` naming ``documents``, before the rest is tokenized."""
        v = self.vocab
        eos, sep = v.special("eos"), v.special("sep")
        specials = _Specials(v.adds("bos"), v.adds("eos"), v.adds("sep"), v.special("bos"), eos if eos >= 0 else sep,
                             sep)
        q = self._tokenize(query, add_bos=False, special=False)
        out: list[list[int]] = []
        total = 0
        for i, d in enumerate(documents):
            out.append(self._rerank_pair(q, query, d, specials))
            total += len(out[-1])
            if total > max_tokens:
                raise BadRequest(f"documents: {'more than ' if i + 1 < len(documents) else ''}{total} tokens with "
                                 f"the query in all; one request ranks at most {max_tokens} "
                                 "(GGUF_EMBEDDING_MAX_REQUEST_TOKENS)", param="documents")
        return out

    def infill_tokens(self, prefix: str, suffix: str, extra: list[tuple[str, str]], prompt: str,
                      n_predict: int) -> list[int]:
        """An /infill request's prompt (see the module docstring): ``extra`` is (filename, text) pairs; ``prompt``
        is tokenized with control tokens parsed, as llama-server does, the rest as text. ``BadRequest`` naming
        ``model`` when the vocabulary lacks a required FIM token."""
        fim = self.fim_tokens()
        missing = fim.missing()
        if missing:
            raise BadRequest("this model cannot infill: its vocabulary has no " + ", ".join(missing), param="model")
        def text(t: str) -> list[int]:
            return self._tokenize(t, add_bos=False, special=False)

        head: list[int] = []
        if fim.rep >= 0:
            head += [fim.rep, *text("myproject\n")]
        for filename, chunk in extra:
            head += [fim.sep, *text(filename + "\n")] if fim.sep >= 0 else text(_SNIPPET)
            head += text(chunk)
        if fim.sep >= 0:
            head += [fim.sep, *text("filename\n")]
        add_bos = self.vocab.adds("bos")
        tokens = infill_layout(fim, extra=head, prefix=text(prefix), suffix=text(suffix),
                               prompt=self._tokenize(prompt, add_bos=False) if prompt else [],
                               bos=self.vocab.special("bos") if add_bos else None,
                               n_batch=self._n_batch, n_ctx=self._n_ctx_seq, n_predict=max(0, n_predict))
        if len(tokens) >= self._n_ctx_seq:
            raise ContextLengthExceeded(
                f"the infill prompt has {len(tokens)} tokens (prompt and FIM tokens beside the kept prefix and "
                f"suffix); a sequence holds {self._n_ctx_seq}", param="prompt", prompt_tokens=len(tokens),
                n_ctx=self._n_ctx_seq)
        return tokens


def _split_template(template: str, query: str, document: str) -> list[tuple[str, bool]]:
    """The rerank template with its placeholders filled, as (text, from the client) pieces."""
    out: list[tuple[str, bool]] = []
    rest = template
    while rest:
        iq, idoc = rest.find("{query}"), rest.find("{document}")
        hits = [(i, name) for i, name in ((iq, "{query}"), (idoc, "{document}")) if i >= 0]
        if not hits:
            out.append((rest, False))
            break
        i, name = min(hits)
        if i:
            out.append((rest[:i], False))
        value = query if name == "{query}" else document
        if value:
            out.append((value, True))
        rest = rest[i + len(name):]
    return out


__all__ = ["FIM_NAMES", "FimTokens", "TaskPrompter", "infill_layout"]
