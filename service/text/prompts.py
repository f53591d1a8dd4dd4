"""Prompts as the engine takes them: text or chat messages to tokens (``Prompter``, over a ``Vocabulary``).

Turn markers are the template's, never the client's. A rendered chat prompt is tokenized with control tokens
parsed (``special``), as llama-server does, but no control token may come from what the client sent: every
string of the messages and tools (contents, names, ids, a past call's arguments, tool descriptions, every key
and value of a parameter schema, any other field a template may render), walked recursively. Where one spells a
control token (``<end_of_turn>``, ``<start_of_turn>``), the spelling is swapped for a placeholder of letters and
digits before the template renders, so that no template, JSON dump or trim changes it, and the placeholder is
tokenized as the spelling's text where it lands in the prompt (``_Spellings``). Texts that spell a control token
only together (two content parts, two system messages a template writes one after the other) are refused (400),
as is a placeholder a template cut. The prompt of /v1/completions is the client's whole input and keeps
llama-server's behaviour: control tokens parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Iterable, Iterator

from ..chat.format import ChatFormat, detect, prepare
from ..chat.sandbox import ChatTemplate
from ..engine.base import ImageInput
from ..errors import BadRequest
from .chat_template import BuiltinChatTemplate
from .vocab import Vocabulary


class Prompter:
    """Counting and rendering text prompts and chat messages into tokens.

    ``images``: an image's tokens (the engine's ``image_tokens``: before, the image's run, after), None where the
    model takes no images."""

    def __init__(self, vocab: Vocabulary, template: ChatTemplate | BuiltinChatTemplate | None,
                 images: Any = None) -> None:
        self.vocab = vocab
        self._template = template
        self._format: ChatFormat | None = None
        self._vision = images

    def _tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        return self.vocab.tokenize(text, add_bos=add_bos, special=special)

    def chat_format(self) -> ChatFormat:
        """The loaded template's tool-call format and thinking tags (``chat_format.detect``), read once."""
        fmt = self._format
        if fmt is None:
            template = self._template
            fmt = detect(template.source if template is not None else None)
            if fmt.think is not None and template is not None:
                try:
                    probe, _ = template.render([{"role": "user", "content": "x"}])
                except Exception:  # a template that needs more than a user turn: assume it does not open
                    probe = ""
                if probe.rstrip().endswith(fmt.think[0]):
                    fmt = ChatFormat(fmt.tools, fmt.native_tools, fmt.arguments_as_object, fmt.think, True)
            fmt = fmt.with_special(self._special_tokens(fmt.markers))
            self._format = fmt
        return fmt

    def _special_tokens(self, markers: tuple[str, ...]) -> dict[str, int]:
        """Which markers are a single control token (parsed as one only with ``special``)."""
        out: dict[str, int] = {}
        for m in markers:
            toks = self._tokenize(m, add_bos=False)
            if len(toks) == 1 and self._tokenize(m, add_bos=False, special=False) != toks:
                out[m] = toks[0]
        return out

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                     spellings: _Spellings | None = None) -> tuple[str, bool]:
        """The rendered prompt and whether BOS is still to add; ``spellings``: swapped for their placeholders in
        what the template is given (after ``prepare``, which writes a past call's arguments decoded and the tools
        as JSON: the spellings are then where the template will find them)."""
        if self._template is None:
            raise BadRequest("this model has no chat template; use /v1/completions", param="messages")
        shown, native_tools = prepare(messages, tools, self.chat_format())
        if spellings is not None:
            shown, native_tools = spellings.swap(shown), spellings.swap(native_tools)
        return self._template.render(shown, native_tools)

    def count_tokens(self, text: str) -> int:
        return len(self._tokenize(text, add_bos=True))

    def prompt_tokens(self, prompt: str) -> list[int]:
        """A completion prompt's tokens, as ``complete`` evaluates them."""
        return self._tokenize(prompt, add_bos=True)

    def chat_prompt_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """A chat's prompt tokens, as ``chat`` evaluates them."""
        return self.chat_tokens(messages, tools)

    def tokenize_text(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self._tokenize(text, add_bos=add_special, special=parse_special)

    def token_pieces(self, tokens: list[int]) -> list[bytes]:
        return self.vocab.pieces(tokens)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The rendered prompt, each image written as mtmd's marker (``<__media__>``, as llama-server shows it)."""
        marked, _ = _mark_images(messages, lambda k: "<__media__>")
        return self.chat_prompt(marked, tools)[0]

    def _token_spelling(self, token: int) -> str:
        """A token's text, a control token's spelling included."""
        return self.vocab.piece(token).decode("utf-8", "replace")

    def _control_spellings(self, text: str) -> list[str]:
        """The control tokens' spellings in ``text``: the tokens ``special`` parses and plain tokenization does not
        (llama.cpp's ``tokenizer_st_partition`` skips control and unknown tokens without ``parse_special``;
        user-defined ones it parses either way, so they are no client's forgery to undo)."""
        if not self.vocab.spells_a_control_token(text):  # both tokenizations would be the same
            return []
        special = self._tokenize(text, add_bos=False)
        plain = self._tokenize(text, add_bos=False, special=False)
        if special == plain:
            return []
        found = []
        for tok in set(special) - set(plain):  # the control tokens, and pieces that only the split changed
            piece = self._token_spelling(tok)
            if piece and piece in text and self._tokenize(piece, add_bos=False) == [tok] \
                    and self._tokenize(piece, add_bos=False, special=False) != [tok]:
                found.append(piece)
        if not found:  # parsed as something special, but no control token's spelling is there to swap out
            raise BadRequest("the request spells one of the model's control tokens in a way that cannot be kept "
                             "as plain text", param="messages")
        return found

    def chat_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The rendered prompt's tokens, no control token from the client's strings (see the module docstring);
        each image part's tokens where the template put its placeholder (``_Images``)."""
        images = _Images(messages)
        if images.found and self._vision is None:
            raise BadRequest(f"{images.found[0][0]}: this model takes no images (it was loaded without a vision "
                             "projector: mmproj)", param=images.found[0][0])
        messages = images.messages
        texts = _texts(messages)
        strings = [*_strings(messages), *_strings(tools), *(s for v in _past_arguments(messages) for s in _strings(v))]
        found = self._control_spellings("\n".join([*strings, *(w for _, w in _junctions(texts))]))
        if not found:  # nothing the client sent spells a control token: one tokenization, as llama-server's
            prompt, add_bos = self.chat_prompt(messages, tools)
            if not images.found:
                return self._tokenize(prompt, add_bos=add_bos)
            return self._pieces_tokens([(prompt, False)], add_bos, images)
        spell = _Spellings(found)
        for param, where in _junctions([(param, spell.swap(t)) for param, t in texts]):
            if spell.pattern.search(where):
                raise BadRequest(f"{param}: together with the text before it, spells one of the model's control "
                                 "tokens", param=param)
        prompt, add_bos = self.chat_prompt(messages, tools, spell)
        return self._pieces_tokens(spell.split(prompt), add_bos, images)

    def _pieces_tokens(self, pieces: Iterable[tuple[str, bool]], add_bos: bool, images: _Images) -> list[int]:
        """The tokens of a prompt in pieces ((the template's text, False), (a client's spelling, True)), each image
        placeholder in the template's text replaced by the image's tokens (the engine's: ``image_tokens``)."""
        tokens: list[int] = []
        seen: set[int] = set()
        for text, client in pieces:
            for part, k in ([(text, None)] if client or not images.found else images.split(text)):
                if k is None:
                    if part:
                        tokens += self._tokenize(part, add_bos=add_bos and not tokens, special=not client)
                    continue
                param, image = images.found[k]
                if add_bos and not tokens:
                    tokens += self._tokenize("", add_bos=True)
                before, run, after = self._vision(image, param)
                tokens += [*before, *run, *after]
                seen.add(k)
        if len(seen) != len(images.found):
            missing = next(images.found[k][0] for k in range(len(images.found)) if k not in seen)
            raise BadRequest(f"{missing}: the model's chat template does not show this image", param=missing)
        return tokens

    def count_chat_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
        return len(self.chat_tokens(messages, tools))


_EDGE = 64
"""Characters at each end of a text that may meet another text's in a prompt: more than a control token spells."""


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value, dict keys included (iteratively: the body's nesting is bounded, not small)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            stack += [k for k in v if isinstance(k, str)]
            stack += v.values()
        elif isinstance(v, (list, tuple)):
            stack += v


def _past_arguments(messages: list[dict[str, Any]]) -> Iterator[Any]:
    """Past tool calls' arguments parsed: ``prepare`` writes them decoded, so ``"\\u003c"`` arrives as ``<``."""
    for m in messages:
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            raw = fn.get("arguments") if isinstance(fn, dict) else None
            if isinstance(raw, str) and raw:
                try:
                    yield json.loads(raw)
                except (ValueError, RecursionError):
                    continue  # not JSON: written as the string it is


def _texts(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Each message's text (string content, or each text part's), in order, with its field's name."""
    out: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, str):
            out.append((f"messages[{i}].content", content))
        elif isinstance(content, list):
            out += [(f"messages[{i}].content[{j}].text", p["text"]) for j, p in enumerate(content)
                    if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return out


def _junctions(texts: Iterable[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    """Where each text meets the texts before it, as a template may write them with nothing between (text parts
    joined; llama.cpp's built-in Gemma template concatenates system messages): the last characters before it and
    its first, as given and trimmed (templates trim)."""
    texts = list(texts)
    for trim in (False, True):
        before = ""
        for param, text in texts:
            if trim:
                text = text.strip()
            if not text:
                continue
            if before:
                yield param, before + text[:_EDGE]
            before = (before + text[-_EDGE:])[-_EDGE:]


def _mark_images(messages: list[dict[str, Any]], mark: Any) -> tuple[list[dict[str, Any]], list[tuple[str, ImageInput]]]:
    """The messages with each image part (``{"type": "image", "image": ImageInput}``, the API's decoding) a text
    part ``mark(k)`` (the k-th image), and the images with their fields' names."""
    found: list[tuple[str, ImageInput]] = []
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
            parts = []
            for j, p in enumerate(content):
                if isinstance(p, dict) and p.get("type") == "image" and isinstance(p.get("image"), ImageInput):
                    parts.append({"type": "text", "text": mark(len(found))})
                    found.append((f"messages[{i}].content[{j}]", p["image"]))
                else:
                    parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out, found


class _Images:
    """A chat's images, each swapped for a placeholder of letters and digits around a random nonce while the
    template renders (as ``_Spellings``), found again in the rendered prompt by ``split``."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.nonce = "M" + uuid.uuid4().hex
        self.messages, self.found = _mark_images(messages, lambda k: f"{self.nonce}I{k}I")
        self._mark = re.compile(self.nonce + "I([0-9]+)I")

    def split(self, text: str) -> Iterator[tuple[str, int | None]]:
        """``text`` in pieces: (text, None) and ("", the image's index)."""
        pos = 0
        for m in self._mark.finditer(text):
            yield text[pos:m.start()], None
            yield "", int(m.group(1))
            pos = m.end()
        yield text[pos:], None


class _Spellings:
    """The control tokens' spellings found in a request, each swapped for a placeholder while the template renders.

    A placeholder is letters and digits around a random nonce: a JSON dump, ``tojson``, a trim or llama.cpp's
    built-in templates write it unchanged, and no client text holds it. ``split`` then cuts the prompt at the
    placeholders: the template's text is tokenized with control tokens, each spelling as text."""

    def __init__(self, spellings: list[str]) -> None:
        # The longest first, as llama.cpp matches them (``cache_special_tokens`` sorts them by length).
        self.spellings = sorted(set(spellings), key=len, reverse=True)
        self.index = {s: i for i, s in enumerate(self.spellings)}
        self.pattern = re.compile("|".join(map(re.escape, self.spellings)))
        self.nonce = "Q" + uuid.uuid4().hex
        self._mark = re.compile(self.nonce + "Q([0-9]+)Q")

    def swap(self, value: Any) -> Any:
        """``value`` with every spelling in its strings (dict keys included) replaced by its placeholder."""
        if isinstance(value, str):
            return self.pattern.sub(lambda m: f"{self.nonce}Q{self.index[m.group()]}Q", value)
        if isinstance(value, dict):
            return {self.swap(k): self.swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.swap(v) for v in value]
        return value

    def split(self, prompt: str) -> Iterator[tuple[str, bool]]:
        """The prompt in pieces: (the template's text, False) and (a client's spelling, True)."""
        pos = 0
        for m in self._mark.finditer(prompt):
            yield from self._between(prompt[pos:m.start()])
            yield self.spellings[int(m.group(1))], True
            pos = m.end()
        yield from self._between(prompt[pos:])

    def _between(self, text: str) -> Iterator[tuple[str, bool]]:
        if self.nonce in text:  # the template cut or changed a placeholder: the spelling cannot be kept as text
            raise BadRequest("a message or tool spells one of the model's control tokens, and the chat template "
                             "changes it so that it cannot be kept as plain text", param="messages")
        if text:
            yield text, False
