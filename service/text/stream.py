"""A generation's token ids into text, in the API process: incremental UTF-8 decoding, stop strings, log
probabilities spelt, the final chunk's reason.

The engine sends the tokens it sampled (``Chunk.tokens``, their ``scores``) and a final chunk per choice. Here each
token's text is added to the choice's text (an incremental decoder: a character split over two tokens waits for the
second), and what may be the start of a stop string is held back until the next token says whether it is
(``stops.split_stop``, llama-server's ``find_stopping_strings`` with partial matches). The tokens of one engine
chunk (a drafted step's, up to 64) go out as one text chunk, with the ids and log probabilities of its text: one
event a step, as vLLM streams, instead of one a token (each costs the API process its encoding and write, on
the cores that compute the next step). A stop string found ends
the choice: the text before it goes out, the engine is told (``Cancel.end``: it stops that choice at its next step,
and its final chunk, ``cancelled``, becomes ``stop`` here with the stop string and the tokens up to it); what the
engine sampled meanwhile is dropped.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ..engine.base import Cancel, Chunk, GenerationParams, TokenLogprob, TokenScore
from .stops import first_stop, split_stop


@dataclass
class _Choice:
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    pending: str = ""
    """Text held back: a character's first bytes, what may begin a stop string."""
    pending_lp: list[TokenLogprob] = field(default_factory=list)
    pending_ids: list[int] = field(default_factory=list)
    """The tokens of the text not sent yet, and their log probabilities."""
    n_tokens: int = 0
    stop_sequence: str | None = None


class TextStream:
    """One generation's chunks of tokens in, chunks of text out (``feed``), every choice apart."""

    def __init__(self, token_bytes: Callable[[int], bytes], params: GenerationParams, cancel: Cancel) -> None:
        """``token_bytes``: a token's text as the answer writes it (the model's control tokens silent but for the
        template's markers the parsers read: ``ModelText.token_bytes``)."""
        self._bytes = token_bytes
        self._stops = [s for s in params.stop if s]
        self._cancel = cancel
        self._choices: dict[int, _Choice] = {}

    def feed(self, chunk: Chunk) -> list[Chunk]:
        """The text of ``chunk``'s tokens as one chunk (a drafted step's tokens, one event), and the choice's end."""
        st = self._choices.get(chunk.index)
        if st is None:
            st = self._choices[chunk.index] = _Choice()
        out: list[Chunk] = []
        if st.stop_sequence is None and chunk.tokens:
            text: list[str] = []
            sent_ids = sent_lp = 0  # of the pending tokens, those whose text is in ``text``
            for i, tok in enumerate(chunk.tokens):
                score = chunk.scores[i] if i < len(chunk.scores) else None
                emit, stopped = self._token(st, tok, score)
                if emit:
                    text.append(emit)
                    sent_ids, sent_lp = len(st.pending_ids), len(st.pending_lp)
                if stopped:
                    break
            if text:
                out.append(Chunk(text="".join(text), tokens=tuple(st.pending_ids[:sent_ids]),
                                 logprobs=tuple(st.pending_lp[:sent_lp]), index=chunk.index))
                del st.pending_ids[:sent_ids], st.pending_lp[:sent_lp]
            if st.stop_sequence is not None:
                self._cancel.end(chunk.index)
        if chunk.finish_reason is not None:
            out += self._end(st, chunk)
        return out

    def _token(self, st: _Choice, tok: int, score: TokenScore | None) -> tuple[str, bool]:
        """One token of a choice: the text it lets go out (none while held back), and whether it completed a stop
        string."""
        st.n_tokens += 1
        piece = self._bytes(tok)
        st.pending_ids.append(tok)
        if score is not None:
            st.pending_lp.append(self._spelt(piece, score))
        st.pending += st.decoder.decode(piece)
        stopped = False
        if self._stops:
            text = st.pending
            emit, st.pending, stopped = split_stop(text, self._stops)
            if stopped:
                st.stop_sequence = first_stop(text, self._stops)
        else:
            emit, st.pending = st.pending, ""
        return emit, stopped

    def _spelt(self, piece: bytes, score: TokenScore) -> TokenLogprob:
        top = tuple((self._bytes(t).decode("utf-8", "replace"), lp) for t, lp in score.top)
        return TokenLogprob(piece.decode("utf-8", "replace"), score.logprob, tuple(piece), top)

    def _end(self, st: _Choice, last: Chunk) -> list[Chunk]:
        """The choice's last chunks: the rest of its text (unless a stop string ended it), then the final one."""
        if st.stop_sequence is not None:
            return [replace(last, finish_reason="stop", stop_sequence=st.stop_sequence, completion_tokens=st.n_tokens,
                            tokens=(), scores=())]
        st.pending += st.decoder.decode(b"", final=True)
        rest, lps, ids = st.pending, st.pending_lp, st.pending_ids
        st.pending, st.pending_lp, st.pending_ids = "", [], []
        end = replace(last, tokens=(), scores=())
        return [Chunk(text=rest, tokens=tuple(ids), logprobs=tuple(lps), index=last.index), end] if rest or lps else [end]
