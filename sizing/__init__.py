"""Pure sizing core and probes: what a GGUF model needs, and where it fits.

The modules ``spec``, ``ggml``, ``kv``, ``compute``, ``memory``, ``fit`` and
``placement`` are pure: they take values and return values, with no I/O and
no heavy imports. ``gguf`` (header reader) and ``devices`` (NVML, host
memory) are the adapters that produce those values.
"""
