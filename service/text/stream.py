"""A generation's token ids into text, in the API process: incremental UTF-8 decoding, stop strings, log
probabilities spelt, the final chunk's reason.

The engine sends the tokens it sampled (``Chunk.tokens``, their ``scores``) and a final chunk per choice. Here each
token's text is added to the choice's text (an incremental decoder: a character split over two tokens waits for the
second), and what may be the start of a stop string is held back until the next token says whether it is
(``stops.split_stop``, llama-server's ``find_stopping_strings`` with partial matches). A stop string found ends
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
    pending_lp: list[TokenLogprob] = field(default_factory=list)
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
        st = self._choices.get(chunk.index)
        if st is None:
            st = self._choices[chunk.index] = _Choice()
        out: list[Chunk] = []
        if st.stop_sequence is None:
            for i, tok in enumerate(chunk.tokens):
                score = chunk.scores[i] if i < len(chunk.scores) else None
                if self._token(st, tok, score, chunk.index, out):
                    break
        if chunk.finish_reason is not None:
            out += self._end(st, chunk)
        return out

    def _token(self, st: _Choice, tok: int, score: TokenScore | None, index: int, out: list[Chunk]) -> bool:
        """One token of a choice: its text, held back or sent; True when it completed a stop string."""
        st.n_tokens += 1
        piece = self._bytes(tok)
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
        if emit:
            out.append(Chunk(text=emit, logprobs=tuple(st.pending_lp), index=index))
            st.pending_lp = []
        if stopped:
            self._cancel.end(index)
        return stopped

    def _spelt(self, piece: bytes, score: TokenScore) -> TokenLogprob:
        top = tuple((self._bytes(t).decode("utf-8", "replace"), lp) for t, lp in score.top)
        return TokenLogprob(piece.decode("utf-8", "replace"), score.logprob, tuple(piece), top)

    def _end(self, st: _Choice, last: Chunk) -> list[Chunk]:
        """The choice's last chunks: the rest of its text (unless a stop string ended it), then the final one."""
        if st.stop_sequence is not None:
            return [replace(last, finish_reason="stop", stop_sequence=st.stop_sequence, completion_tokens=st.n_tokens,
                            tokens=(), scores=())]
        st.pending += st.decoder.decode(b"", final=True)
        rest, lps = st.pending, st.pending_lp
        st.pending, st.pending_lp = "", []
        end = replace(last, tokens=(), scores=())
        return [Chunk(text=rest, logprobs=tuple(lps), index=last.index), end] if rest or lps else [end]
