"""The host CPU as llama.cpp reports it, and whether its repacked weight layouts are used.

llama.cpp's CPU backend can keep weight matrices in "extra" buffer types with layouts of their own
(``llama_model_params.use_extra_bufts``; ggml/src/ggml-cpu/ggml-cpu.cpp
``ggml_backend_cpu_get_extra_buffer_types``, the llama.cpp that llama-cpp-python 0.3.36 vendors): first
**AMX** (Intel AMX tiles: only in a build compiled with ``__AMX_INT8__`` and ``__AVX512VNNI__``, and only when
the kernel grants the tile state, ``ggml_amx_init``), then **CPU_REPACK** (rows interleaved for the AVX2,
AVX512 and NEON gemm kernels of ggml-cpu/repack.cpp). Neither is an error to skip: without them the weights
are read from the mapped file as they are.

The AMX kernel for repacked weights crashes this llama.cpp (``ggml_backend_amx_mul_mat`` segfaults at the
first decode on Sapphire Rapids hosts; llama.cpp#20824, closed without a fix; llama-server from the same
vendored llama.cpp dies at its warm-up, and runs with ``--no-repack``). The AMX and the CPU_REPACK buffers are
switched on and off together (one ``use_extra_bufts`` flag), so ``auto`` turns both off where llama.cpp reports
``AMX_INT8`` and keeps them elsewhere, where CPU_REPACK is safe and faster (docs/memory.md, measured).
``GGUF_CPU_REPACK`` = on / off overrides the choice.

``llama_print_system_info`` lists the features the loaded ggml was built for, which are the ones it uses:
a wheel built on a host without AMX has no AMX buffer type even on an AMX host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from sizing.memory import auto_reason, auto_repack
from sizing.probe import ggml_features

RepackSetting = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class RepackChoice:
    """Whether a load uses llama.cpp's extra CPU buffer types (``use_extra_bufts``), and why."""

    on: bool
    reason: str
    features: frozenset[str] = frozenset()
    """The CPU features llama.cpp reported, with which the plan predicts the buffers (``sizing.memory.repack``)."""


@functools.lru_cache(maxsize=1)
def system_features() -> frozenset[str]:
    """The CPU features of the ggml this process loaded (``llama_print_system_info``; ``sizing.probe.ggml_features``)."""
    return ggml_features()


def choose_repack(setting: RepackSetting, features: frozenset[str]) -> RepackChoice:
    """The extra buffer types for a load on a CPU with ``features`` (see the module docstring)."""
    if setting == "on":
        return RepackChoice(True, "GGUF_CPU_REPACK=on", features)
    if setting == "off":
        return RepackChoice(False, "GGUF_CPU_REPACK=off", features)
    return RepackChoice(auto_repack(features), auto_reason(features), features)


def host_repack(setting: RepackSetting) -> RepackChoice:
    """``choose_repack`` for this host, from the ggml loaded in this process."""
    return choose_repack(setting, system_features())
