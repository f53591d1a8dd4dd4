"""The sizing package's exceptions, one tree.

    SizingError
    ├── ProbeError            a GGUF header could not be read (carries the offset)
    │   ├── NotGGUFError      bad magic
    │   ├── UnsupportedVersionError
    │   ├── TruncatedError    the file ends before the header does
    │   ├── MalformedError    counts, types, offsets or shapes that cannot be right
    │   │   └── LayerArrayError  a per-layer array of the wrong length (also an UnsupportedModelError)
    │   ├── ShardError        a split GGUF's shards are missing or disagree
    │   ├── RemoteError       an HTTP(S) source could not be read (status, network, no Range support)
    │   └── InvalidURLError   a location that is not a valid http(s) URL or hf:// name: refused before any request
    ├── UnsupportedModelError the header is valid but the model cannot be sized
    ├── ConfigError           a context configuration llama.cpp would refuse
    │   └── FlashAttentionRequiredError
    └── DeviceError           a device inventory could not be read or parsed

Foreign errors (struct.error, OSError, NVML errors) are converted where they
are caught, with ``raise ... from exc``.
"""

from __future__ import annotations

import re


class SizingError(Exception):
    """Base of every error raised by the sizing package."""


_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]*@")


def without_credentials(text: str) -> str:
    """``text`` with the user and password of every URL in it replaced by ``***`` (``https://***@host/...``):
    what an error or a log line may say of a location a client sent."""
    return _CREDENTIALS.sub("***@", text)


class ProbeError(SizingError):
    """A GGUF header could not be read; ``offset`` is where the problem is. A URL's credentials never reach the
    message (``without_credentials``)."""

    def __init__(self, message: str, *, offset: int | None = None, source: str | None = None) -> None:
        self.offset = offset
        source = without_credentials(source) if source else source
        self.source = source
        where = f" at offset {offset}" if offset is not None else ""
        origin = f"{source}: " if source else ""
        super().__init__(f"{origin}{message}{where}")
        self.reason = message


class NotGGUFError(ProbeError):
    """The bytes do not start with the GGUF magic."""


class UnsupportedVersionError(ProbeError):
    """A GGUF version this reader does not understand."""


class TruncatedError(ProbeError):
    """The file ends before the header (or a tensor's data) does."""


class MalformedError(ProbeError):
    """Counts, types, offsets or shapes that cannot be right."""


class UnsupportedModelError(SizingError):
    """A valid GGUF whose model cannot be sized (missing keys, unknown layout)."""


class LayerArrayError(MalformedError, UnsupportedModelError):
    """A per-layer array (``head_count_kv``, ``sliding_window_pattern``...) whose
    length is not ``block_count``; ``offset`` is the key's entry."""


class ShardError(ProbeError):
    """A split GGUF whose shards are missing, misnumbered or disagree."""


class RemoteError(ProbeError):
    """An HTTP(S) source could not be read: a status, a network error, no Range support."""

    def __init__(self, message: str, *, status: int | None = None, source: str | None = None) -> None:
        super().__init__(message, source=source)
        self.status = status


class InvalidURLError(ProbeError):
    """A location that is not a valid http(s) URL (scheme, host name, IDNA, port, brackets) or ``hf://`` name.

    The caller's mistake, found before any request is made: not a ``RemoteError`` (the service answers 400, not 502).
    """


class ConfigError(SizingError):
    """A context configuration that llama.cpp would refuse."""


class FlashAttentionRequiredError(ConfigError):
    """A quantized KV cache with flash attention explicitly off."""


class DeviceError(SizingError):
    """A device inventory could not be read or parsed."""
