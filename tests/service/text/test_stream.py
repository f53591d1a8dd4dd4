"""``TextStream``: a chunk of tokens in (a drafted step's), one chunk of text out, with the ids and log
probabilities of the text it holds; what is held back (a character's first bytes, the start of a stop string)
goes out with the tokens that complete it."""

from __future__ import annotations

from service.engine.base import Cancel, Chunk, GenerationParams, TokenScore
from service.text.stream import TextStream

PIECES = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: b"\xc3", 6: b"\xa9", 7: b"EN", 8: b"D"}


def _stream(*stop: str) -> tuple[TextStream, list[int]]:
    ended: list[int] = []
    cancel = Cancel()
    cancel.on_end(ended.append)
    return TextStream(PIECES.__getitem__, GenerationParams(stop=stop), cancel), ended


def _scored(*tokens: int) -> Chunk:
    return Chunk(tokens=tokens, scores=tuple(TokenScore(t, -t / 10) for t in tokens))


def test_a_steps_tokens_become_one_text_chunk_with_their_ids_and_logprobs() -> None:
    stream, _ = _stream()
    (out,) = stream.feed(_scored(1, 2, 3, 4))
    assert (out.text, out.tokens) == ("Hello world", (1, 2, 3, 4))
    assert [(lp.token, lp.logprob) for lp in out.logprobs] == [("Hel", -0.1), ("lo", -0.2), (" wor", -0.3), ("ld", -0.4)]


def test_a_character_split_over_two_steps_goes_out_with_both_of_its_tokens() -> None:
    stream, _ = _stream()
    (first,) = stream.feed(_scored(1, 5))
    assert (first.text, first.tokens, len(first.logprobs)) == ("Hel", (1,), 1)
    (second,) = stream.feed(_scored(6, 2))
    assert (second.text, second.tokens, len(second.logprobs)) == ("élo", (5, 6, 2), 3)
    assert stream.feed(_scored(5)) == []  # held: nothing to send yet
    rest, end = stream.feed(Chunk(finish_reason="length", completion_tokens=5))
    assert (rest.text, rest.tokens, end.finish_reason, end.tokens) == ("\ufffd", (5,), "length", ())


def test_a_stop_string_inside_a_step_ends_the_choice_with_the_text_before_it() -> None:
    stream, ended = _stream("END")
    (out,) = stream.feed(_scored(1, 2, 7, 8, 3, 4))
    assert (out.text, out.tokens, len(out.logprobs)) == ("Hello", (1, 2), 2)
    assert ended == [0]
    assert stream.feed(_scored(3)) == []  # sampled before the engine stopped: dropped
    (end,) = stream.feed(Chunk(finish_reason="cancelled"))
    assert (end.finish_reason, end.stop_sequence, end.completion_tokens) == ("stop", "END", 4)


def test_the_start_of_a_stop_string_is_held_until_a_step_says_it_is_not_one() -> None:
    stream, ended = _stream("ENDING")
    (out,) = stream.feed(Chunk(tokens=(1, 7, 8)))
    assert (out.text, out.tokens) == ("Hel", (1,))
    (out,) = stream.feed(Chunk(tokens=(2,)))
    assert (out.text, out.tokens) == ("ENDlo", (7, 8, 2)) and ended == []
