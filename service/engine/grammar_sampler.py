"""The engine's side of structured output: llguidance's matcher over llama.cpp's vocabulary, as a llama.cpp sampler.

``grammar_sampler`` (the batched engine's sampler chain) and ``grammar_logits_processor`` (llama-cpp-python's
``Llama.generate``) mask the tokens a compiled grammar (``service.grammar.schema``) forbids; nothing else in the
engine knows how a grammar is represented. The tokenizer llguidance needs is built once per vocabulary.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any, Callable

from ..grammar.schema import MAX_REASON_CHARS, Grammar, parser_limits

log = logging.getLogger(__name__)

_tok_lock = threading.Lock()
_tokenizers: dict[tuple[Any, ...], Any] = {}

_MAX_TOKENIZERS = 2


def _vocab_key(vocab: Any) -> tuple[Any, ...]:
    """The vocabulary's identity: its address, size and a sample of its pieces (an unloaded model's address
    may be reused by the next one; the pieces tell them apart)."""
    import llama_cpp

    n = int(llama_cpp.llama_vocab_n_tokens(vocab))
    buf = ctypes.create_string_buffer(256)
    sample = []
    for tok in range(0, n, max(1, n // 64)):
        k = llama_cpp.llama_token_to_piece(vocab, tok, buf, 256, 0, True)
        sample.append(buf.raw[: max(k, 0)])
    address = ctypes.cast(vocab, ctypes.c_void_p).value
    return (address, n, int(llama_cpp.llama_vocab_eos(vocab)), tuple(sample))


def _tokenizer(vocab: Any) -> Any:
    """llguidance's tokenizer for this vocabulary, built once per model (about 1 s for 262k tokens)."""
    import llama_cpp
    from llguidance.llamacpp import lltokenizer_from_vocab

    key = _vocab_key(vocab)
    with _tok_lock:
        tok = _tokenizers.get(key)
        if tok is None:
            n = key[1]
            # Every end-of-generation token may end a grammar's output (gemma: <eos> and <end_of_turn>).
            eog = [t for t in range(n) if llama_cpp.llama_vocab_is_eog(vocab, t)] or [key[2]]
            tok = lltokenizer_from_vocab(vocab, eos_token=eog)
            while len(_tokenizers) >= _MAX_TOKENIZERS:
                _tokenizers.pop(next(iter(_tokenizers)))
            _tokenizers[key] = tok
        return tok


class _Mask:
    """One request's grammar state: an llguidance matcher and the mask of the tokens it allows next."""

    def __init__(self, vocab: Any, grammar: Grammar) -> None:
        import numpy as np
        from llguidance import LLMatcher

        tok = _tokenizer(vocab)
        self.n_vocab = int(tok.vocab_size)
        self.eos = np.array(sorted(set(tok.eos_tokens)), dtype=np.int64)
        self.matcher = LLMatcher(tok, grammar.text, log_level=0, limits=parser_limits())
        if self.matcher.is_error():
            log.warning("grammar matcher refused a validated grammar: %s", self.matcher.get_error()[:MAX_REASON_CHARS])
        self._words = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)

    def allowed(self) -> Any:
        """A boolean array over token ids: what may come next (only end-of-generation once done or failed)."""
        import numpy as np

        m = self.matcher
        if m.is_error() or m.is_stopped():
            out = np.zeros(self.n_vocab, dtype=bool)
            out[self.eos] = True
            return out
        m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        return np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self.n_vocab].astype(bool)

    def accept(self, token: int) -> None:
        if not (self.matcher.is_error() or self.matcher.is_stopped()):
            self.matcher.consume_token(int(token))


# -- the batched engine: a llama.cpp sampler (llama_sampler_init with our interface) ---------------------

_TOKEN_DATA = None  # numpy dtype of llama_token_data, built on first use
_live: dict[int, tuple[Any, ...]] = {}
"""Samplers llama.cpp holds, by context id: their Python state must outlive every call into them."""
_freed: list[int] = []
"""Ids whose ``free`` callback ran: released at the next creation, never inside the callback itself (its
thunk would be freed while it runs)."""
_next_id = 0
_live_lock = threading.Lock()


def _token_data_view(cur_p: Any) -> Any:
    import llama_cpp
    import numpy as np

    global _TOKEN_DATA
    if _TOKEN_DATA is None:
        _TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)
        assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)
    arr = cur_p.contents
    size = int(arr.size)
    buf = (llama_cpp.llama_token_data * size).from_address(ctypes.addressof(arr.data.contents))
    return np.frombuffer(buf, dtype=_TOKEN_DATA, count=size)  # type: ignore[call-overload]  # a ctypes array is a buffer


def grammar_sampler(vocab: Any, grammar: Grammar) -> Any:
    """A llama.cpp sampler constraining tokens to ``grammar`` (a ``compile_grammar`` result).

    Allocated by llama.cpp (``llama_sampler_init``), so ``llama_sampler_free`` on its chain frees it as it
    frees its own; our ``free`` callback releases the Python state.
    """
    import llama_cpp
    import numpy as np

    global _next_id
    mask = _Mask(vocab, grammar)

    def apply(_smpl: Any, cur_p: Any) -> None:
        data = _token_data_view(cur_p)
        ok = mask.allowed()
        ids = data["id"]
        inside = ids < mask.n_vocab
        keep = np.zeros(len(ids), dtype=bool)
        keep[inside] = ok[ids[inside]]
        data["logit"][~keep] = -np.inf

    def accept(_smpl: Any, token: int) -> None:
        mask.accept(token)

    def reset(_smpl: Any) -> None:
        mask.matcher.reset()

    def name(_smpl: Any) -> bytes:
        return b"llguidance"

    with _live_lock:
        while _freed:
            _live.pop(_freed.pop(), None)
        _next_id += 1
        sid = _next_id

    def free(_smpl: Any) -> None:
        with _live_lock:
            _freed.append(sid)

    iface = llama_cpp.llama_sampler_i()
    callbacks = (
        llama_cpp.llama_sampler_i_name(name),
        llama_cpp.llama_sampler_i_accept(accept),
        llama_cpp.llama_sampler_i_apply(apply),
        llama_cpp.llama_sampler_i_reset(reset),
        llama_cpp.llama_sampler_i_free(free),
    )
    iface.name, iface.accept, iface.apply, iface.reset, iface.free = callbacks
    smpl = llama_cpp.llama_sampler_init(ctypes.pointer(iface), ctypes.c_void_p(sid))
    with _live_lock:
        _live[sid] = (iface, callbacks, mask)
    return smpl


# -- the single-sequence engine: a logits processor for llama-cpp-python's Llama.generate ----------------

def grammar_logits_processor(vocab: Any, grammar: Grammar) -> Callable[[Any, Any], Any]:
    """``Llama.generate``'s ``logits_processor``: masks the scores (in token-id order) to what ``grammar`` allows.

    ``Llama.generate`` does not tell a processor which token it sampled; the processor sees the tokens
    evaluated so far (``input_ids``), so on each call it feeds the matcher those it has not seen.
    """
    import numpy as np

    mask = _Mask(vocab, grammar)
    state = {"start": -1, "seen": 0}

    def process(input_ids: Any, scores: Any) -> Any:
        n = len(input_ids)
        if state["start"] < 0:
            state["start"] = n
        for tok in input_ids[state["start"] + state["seen"] : n]:
            mask.accept(int(tok))
        state["seen"] = n - state["start"]
        ok = mask.allowed()
        m = min(len(scores), len(ok))
        scores[:m][~ok[:m]] = -np.inf
        return scores

    return process
