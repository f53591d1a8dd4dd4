"""The sizing package's exceptions, one tree.

    SizingError
    ├── ProbeError            a GGUF header could not be read (carries the offset)
    │   ├── NotGGUFError      bad magic
    │   ├── UnsupportedVersionError
    │   ├── TruncatedError    the file ends before the header does
    │   └── MalformedError    counts, types, offsets or shapes that cannot be right
    ├── UnsupportedModelError the header is valid but the model cannot be sized
    ├── ConfigError           a context configuration llama.cpp would refuse
    │   └── FlashAttentionRequiredError
    └── DeviceError           a device inventory could not be read or parsed

Foreign errors (struct.error, OSError, NVML errors) are converted where they
are caught, with ``raise ... from exc``.
"""

from __future__ import annotations


class SizingError(Exception):
    """Base of every error raised by the sizing package."""


class ProbeError(SizingError):
    """A GGUF header could not be read; ``offset`` is where the problem is."""

    def __init__(self, message: str, *, offset: int | None = None, source: str | None = None) -> None:
        self.offset = offset
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


class ConfigError(SizingError):
    """A context configuration that llama.cpp would refuse."""


class FlashAttentionRequiredError(ConfigError):
    """A quantized KV cache with flash attention explicitly off."""


class DeviceError(SizingError):
    """A device inventory could not be read or parsed."""
