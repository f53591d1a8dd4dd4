"""The OpenAI API's request bodies for completions and chats, as wire models: their fields, bounds and checks.

Each turns into the engine's ``GenerationParams`` (``params``); what the service does not build is refused by
name, never silently ignored (``functions``/``function_call``, ``best_of``, ``suffix``, audio output, image, audio
and file parts). Anthropic's Messages API (``service.api.anthropic``) converts its bodies to a ``ChatRequest``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..chat.tools import check_call_id, check_name
from ..engine.base import GenerationParams
from ..errors import BadRequest
from ..grammar.schema import check_schema_bounds
from .validation import KeepAlive, check_json_depth

UNSUPPORTED_FIELDS: dict[str, str] = {
    "functions": "the deprecated functions API is not supported; use tools",
    "function_call": "the deprecated functions API is not supported; use tool_choice",
}
"""Fields refused (400, param names the field) unless neutral (null, empty, "none")."""


MAX_STOP = 4


MAX_TOP_LOGPROBS = 20


MAX_SEED = 2**32 - 1
"""llama.cpp seeds are uint32 (``llama_sampler_init_dist``); -1 means random, as in llama-server."""


COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for /v1/completions when max_tokens is absent or null."""


def _neutral(value: Any) -> bool:
    """A value that asks for nothing: what clients send for a feature they do not use."""
    return value is None or value == [] or value == {} or value == "" or value == "none"


MAX_LOGIT_BIAS = 1024
"""Most ``logit_bias`` entries (OpenAI allows 300 tokens of one tokenizer; a bound, not a target)."""


_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,8}")
"""A ``logit_bias`` key (``fullmatch``): a token id as canonical decimal, ASCII digits without a sign, a leading zero
or whitespace (``"5\\n"`` and ``"05"`` are not ids; ``$`` in a ``match`` would allow the trailing newline)."""


STRICT = ConfigDict(strict=True)
"""Request models take JSON's own types: ``"n": "2"``, ``"stream": "true"``, ``"max_tokens": 5.0`` or ``true`` for an
integer are 400s naming the field, as OpenAI answers them ("Invalid type for 'n': expected an integer, but got a
string instead"), where pydantic's lax mode would coerce them. Integers are still numbers (``"temperature": 1``)."""


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


def _float(default: float, **bounds: float) -> Any:
    return Field(default, allow_inf_nan=False, **bounds)  # type: ignore[call-overload]


class JsonSchemaFormat(BaseModel):
    model_config = STRICT

    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = Field(None, max_length=256)
    max_tokens: int | None = Field(None, ge=1, description="Absent or null: 16 on /v1/completions (OpenAI's "
                                   "default), GGUF_MAX_TOKENS_DEFAULT on /v1/chat/completions.")
    temperature: float = _float(1.0, ge=0.0, le=2.0)
    top_p: float = _float(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1 << 20, description="llama.cpp server extension: keep the k most likely tokens (0: all).")
    min_p: float = _float(0.0, ge=0.0, le=1.0)
    """llama.cpp server extension: drop tokens less likely than min_p times the most likely (0: none; OpenAI's
    whole vocabulary, where llama-server defaults to 0.05)."""
    frequency_penalty: float = _float(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = _float(0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-1, le=MAX_SEED, description="0 .. 2^32-1 (llama.cpp's uint32); -1: random.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128, description="Choices: at most the engine's slots (GGUF_PARALLEL), else 400; "
                   "the prompt is evaluated once and shared.")
    response_format: ResponseFormat | None = None
    user: str | None = Field(None, max_length=256)
    ignore_eos: bool = Field(False, description="llama.cpp server extension: generate past end-of-generation tokens.")
    functions: Any = Field(None, description="Not supported (deprecated): anything but null or [] is a 400.")
    function_call: Any = Field(None, description="Not supported (deprecated): anything but null or \"none\" is a 400.")
    logit_bias: dict[str, Any] | None = Field(None, description="Token id (a string) to a bias -100..100 added to "
                                               "its logit; -100 bans the token. Unknown ids: 400.")
    cache_prompt: bool = Field(True, description="llama.cpp server extension: reuse a slot's cached prefix of the prompt.")
    cache_salt: str | None = Field(None, max_length=256, description="vLLM's extension: cached prompts are reused only "
                                   "by requests with the same salt (and, with API keys configured, the same key).")
    keep_alive: KeepAlive = None
    return_token_ids: bool = Field(False, description="vLLM's extension: the answer names the token ids the prompt "
                                   "was evaluated as (prompt_token_ids; not in streams). The render routes "
                                   "(/v1/completions/render, /v1/chat/completions/render) give them without generating.")
    speculative: bool = Field(True, description="Self-speculative decoding where the server has it on "
                              "(GGUF_SPECULATIVE): several tokens a step where the answer repeats its context, the "
                              "same answer. false: one token a step.")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        return v

    def logprobs_n(self) -> int | None:
        """None: no log probabilities; k: the sampled token's and k alternatives'."""
        return None

    def refuse_unsupported(self) -> None:
        """400 for a field whose feature is not built (see ``UNSUPPORTED_FIELDS``)."""
        for name, why in self.unsupported_fields().items():
            if not _neutral(getattr(self, name, None)):
                raise BadRequest(f"{name}: {why}", param=name)

    def unsupported_fields(self) -> dict[str, str]:
        return UNSUPPORTED_FIELDS

    def bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs; -100 is a ban (-inf), as OpenAI documents it."""
        if not self.logit_bias:
            return ()
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise BadRequest(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
        out = []
        for key, value in self.logit_bias.items():
            if not _TOKEN_ID.fullmatch(key):
                raise BadRequest(f"logit_bias: keys are token ids (decimal strings), not {key[:40]!r}", param="logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not -100 <= value <= 100:
                raise BadRequest(f"logit_bias[{key}]: a number from -100 to 100", param="logit_bias")
            out.append((int(key), float("-inf") if value <= -100 else float(value)))
        return tuple(out)

    def params(self, default_max_tokens: int = COMPLETIONS_DEFAULT_MAX_TOKENS) -> GenerationParams:
        self.refuse_unsupported()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        json_schema = None
        json_object = False
        rf = self.response_format
        if rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise BadRequest("response_format json_schema needs json_schema.schema", param="response_format")
            check_schema_bounds(rf.json_schema.schema_)  # before json.dumps: a deep schema must not recurse
            json_schema = json.dumps(rf.json_schema.schema_)
        elif rf is not None and rf.type == "json_object":
            json_object = True
        return GenerationParams(
            max_tokens=self.requested_max_tokens() or default_max_tokens, temperature=self.temperature,
            top_p=self.top_p, stop=stop, seed=None if self.seed == -1 else self.seed,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            logprobs=self.logprobs_n(), json_schema=json_schema, json_object=json_object, ignore_eos=self.ignore_eos,
            cache_prompt=self.cache_prompt, logit_bias=self.bias(), n=self.n, top_k=self.top_k, min_p=self.min_p,
            speculative=self.speculative,
        )

    def requested_max_tokens(self) -> int | None:
        """The client's own limit (None: it gave none and the server's default applies)."""
        return self.max_tokens


class CompletionRequest(GenerationRequest):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, description="Not supported: anything but null or 1 is a 400.")
    suffix: str | None = Field(None, description="Not supported: anything but null or \"\" is a 400.")

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.best_of not in (None, 1):
            raise BadRequest("best_of: only one completion per request is supported (best_of 1)", param="best_of")
        if self.suffix:
            raise BadRequest("suffix: inserting text before a suffix is not supported", param="suffix")

    def logprobs_n(self) -> int | None:
        return self.logprobs

    def prompt_text(self) -> str:
        if self.echo:
            raise BadRequest("echo is not supported", param="echo")
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise BadRequest("exactly one prompt is supported", param="prompt")
            return self.prompt[0]
        return self.prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def check(self, i: int) -> None:
        """400 for what this server cannot honour in a message (non-text parts, NUL characters), for tool turns
        that are not OpenAI's shape (a ``tool`` message names its call, an assistant's calls are functions), and
        for names and call ids beyond their safe characters (``tools.NAME``, ``tools.CALL_ID``: they reach the
        prompt, and OpenAI refuses the same)."""
        where = f"messages[{i}]"
        extra = self.model_extra or {}
        for name in ("function_call", "audio"):
            if not _neutral(extra.get(name)):
                raise BadRequest(f"{where}.{name}: not supported", param=f"{where}.{name}")
        if self.role == "tool" and not (isinstance(extra.get("tool_call_id"), str) and extra["tool_call_id"]):
            raise BadRequest(f"{where}.tool_call_id: a tool message names the call it answers", param=f"{where}.tool_call_id")
        if extra.get("tool_call_id") is not None:
            check_call_id(extra["tool_call_id"], f"{where}.tool_call_id")
        if extra.get("name") is not None:
            check_name(extra["name"], f"{where}.name")
        calls = extra.get("tool_calls")
        call_texts: list[tuple[str, str]] = []
        if not _neutral(calls):
            if self.role != "assistant" or not isinstance(calls, list):
                raise BadRequest(f"{where}.tool_calls: a list, on assistant messages only", param=f"{where}.tool_calls")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                        or not isinstance(fn.get("arguments", ""), str) or c.get("type", "function") != "function":
                    raise BadRequest(f"{where}.tool_calls[{j}]: {{\"id\", \"type\": \"function\", \"function\": "
                                     "{\"name\": string, \"arguments\": string}}", param=f"{where}.tool_calls[{j}]")
                if c.get("id") is not None:
                    check_call_id(c["id"], f"{where}.tool_calls[{j}].id")
                check_name(fn["name"], f"{where}.tool_calls[{j}].function.name")
                call_texts.append((f"{where}.tool_calls[{j}].function.arguments", fn.get("arguments", "")))
                # The chat format parses the arguments (json.loads) to give the template an object.
                check_json_depth(fn.get("arguments", ""), f"{where}.tool_calls[{j}].function.arguments")
        if isinstance(self.content, str):
            texts = [(f"{where}.content", self.content)]
        elif isinstance(self.content, list):
            texts = []
            for j, part in enumerate(self.content):
                kind = part.get("type")
                if kind == "image_url" and self.role == "user":  # decoded at admission (``service.api.images``)
                    value = part.get("image_url")
                    url = value.get("url") if isinstance(value, dict) else value
                    if not isinstance(url, str) or not url:
                        raise BadRequest(f"{where}.content[{j}].image_url: {{\"url\": a data: or http(s) URL}}",
                                         param=f"{where}.content[{j}].image_url")
                    continue
                if kind != "text":
                    raise BadRequest(f"{where}.content[{j}].type: only text parts"
                                     + (" and (in user messages) image_url parts" if kind != "image_url" else
                                        " in a message of role " + self.role)
                                     + f" are supported, not {str(kind)[:40]!r}", param=f"{where}.content[{j}].type")
                if not isinstance(part.get("text"), str):
                    raise BadRequest(f"{where}.content[{j}].text: a text part needs a string",
                                     param=f"{where}.content[{j}].text")
                texts.append((f"{where}.content[{j}].text", part["text"]))
        else:
            texts = []
        for param, text in texts + call_texts:
            if "\x00" in text:
                # Chat templates are C strings in llama.cpp: a NUL would silently end the message there.
                raise BadRequest(f"{param}: contains a NUL character", param=param)


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = Field(None, description="Functions the model may call (OpenAI's shape).")
    tool_choice: str | dict[str, Any] | None = Field(None, description="none, auto (default with tools), required, "
                                                     "or {\"type\": \"function\", \"function\": {\"name\"}}.")
    parallel_tool_calls: bool | None = Field(None, description="Several calls in one answer (default: "
                                             "GGUF_PARALLEL_TOOL_CALLS, false).")
    reasoning_format: Literal["none", "separate", "inline"] | None = Field(
        None, description="llama.cpp server extension: how thinking is returned (default GGUF_REASONING_FORMAT).")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    audio: Any = Field(None, description="Not supported: audio output.")
    modalities: list[str] | None = Field(None, description="Only [\"text\"].")
    prediction: Any = Field(None, description="Not supported: predicted outputs.")

    def check_messages(self) -> None:
        """Each message (``ChatMessage.check``), then the conversation: a ``tool`` message answers a call that an
        earlier assistant message made (its ``tool_calls[].id``). OpenAI refuses a result for no call ("messages
        with role 'tool' must be a response to a preceding message with 'tool_calls'"); here it would reach the
        prompt as the result of a call the model never made."""
        called: set[str] = set()
        for i, m in enumerate(self.messages):
            m.check(i)
            extra = m.model_extra or {}
            if m.role == "assistant" and not _neutral(extra.get("tool_calls")):
                called.update(c["id"] for c in extra["tool_calls"] if c.get("id") is not None)
            elif m.role == "tool" and extra["tool_call_id"] not in called:
                param = f"messages[{i}].tool_call_id"
                raise BadRequest(f"{param}: no earlier assistant message made a tool call with id "
                                 f"{extra['tool_call_id'][:64]!r}", param=param)

    def logprobs_n(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if not _neutral(self.audio) or (self.modalities is not None and set(self.modalities) - {"text"}):
            raise BadRequest("audio output is not supported: modalities can only be [\"text\"]",
                             param="audio" if not _neutral(self.audio) else "modalities")
        if not _neutral(self.prediction):
            raise BadRequest("prediction: predicted outputs are not supported", param="prediction")

    def requested_max_tokens(self) -> int | None:
        # Chat has no default limit in the OpenAI API; the server's (GGUF_MAX_TOKENS_DEFAULT) applies.
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
