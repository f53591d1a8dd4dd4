"""What the engine takes from outside Python: the libggml that llama-cpp-python ships, and the environment of the
processes that run llama.cpp (the runners, the dry-run worker).

``libggml()`` is the one loader of the shared library (its ctypes signatures set once); ``child_env()`` the one
environment a llama.cpp child starts with: this one, the project root on ``PYTHONPATH``, and ``CUDA_DEVICE_ORDER``
(NVML lists cards in PCI bus order, CUDA fastest first by default; the plan's card indexes come from NVML, so
llama.cpp must see the same order, set before CUDA starts: ``cuda_order``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
from typing import cast

_ROOT = str(pathlib.Path(__file__).resolve().parents[2])

GGML_BACKEND_DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}
"""ggml-backend.h's ``enum ggml_backend_dev_type``."""


class DevCaps(ctypes.Structure):
    """ggml-backend.h's ``struct ggml_backend_dev_caps`` (the vendored ggml's: five flags)."""

    _fields_ = [("async_", ctypes.c_bool), ("host_buffer", ctypes.c_bool), ("buffer_from_host_ptr", ctypes.c_bool),
                ("events", ctypes.c_bool), ("mmap_support", ctypes.c_bool)]


class InitParams(ctypes.Structure):
    """ggml.h's ``struct ggml_init_params`` (passed by value to ``ggml_init``)."""

    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


GGML_TYPE_I8 = 24
"""ggml.h's ``GGML_TYPE_I8``: one byte an element, so a 1-D tensor of n elements is n bytes."""


class DevProps(ctypes.Structure):
    """ggml-backend.h's ``struct ggml_backend_dev_props``: what ``ggml_backend_dev_get_props`` fills in."""

    _fields_ = [("name", ctypes.c_char_p), ("description", ctypes.c_char_p), ("memory_free", ctypes.c_size_t),
                ("memory_total", ctypes.c_size_t), ("type", ctypes.c_int), ("device_id", ctypes.c_char_p),
                ("caps", DevCaps)]


def cuda_order(env: "os._Environ[str] | dict[str, str]") -> None:
    """Make CUDA number the cards as NVML does (PCI bus order), unless the operator chose an order."""
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")


def child_env() -> dict[str, str]:
    """The environment of a process that runs llama.cpp: this process's, with the project importable and CUDA's
    card order NVML's."""
    env = dict(os.environ)
    env["PYTHONPATH"] = _ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cuda_order(env)
    return env


@functools.lru_cache(maxsize=1)
def libggml() -> ctypes.CDLL | None:
    """The libggml next to llama-cpp-python's libllama (None: not found), with the signatures the engine calls:
    ``ggml_backend_dev_count/get/by_type/name/description/type/memory/get_props/backend_reg/buffer_type/
    host_buffer_type``, ``ggml_backend_reg_name``, ``ggml_backend_buft_name/get_alignment/get_max_size``."""
    import llama_cpp

    libdir = pathlib.Path(llama_cpp.__file__).parent / "lib"
    # libggml.so.0 first: the name libllama links (its DT_NEEDED). A wheel holds libggml.so, .so.0 and .so.0.x as
    # three copies, not links, and loading another copy than libllama's gives a second ggml with a registry of its
    # own (an RPC server registered there is a device no model sees).
    names = ("libggml.so.0", "libggml.so", "libggml.dylib", "ggml.dll")
    path = next((c for c in (libdir / n for n in names) if c.exists()), None)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    lib.ggml_backend_dev_name.restype = ctypes.c_char_p
    lib.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_description.restype = ctypes.c_char_p
    lib.ggml_backend_dev_description.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_memory.restype = None
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_dev_get_props.restype = None
    lib.ggml_backend_dev_get_props.argtypes = [ctypes.c_void_p, ctypes.POINTER(DevProps)]
    lib.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    lib.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_name.restype = ctypes.c_char_p
    lib.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_host_buffer_type.restype = ctypes.c_void_p
    lib.ggml_backend_dev_host_buffer_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_buft_name.restype = ctypes.c_char_p
    lib.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_buft_get_alignment.restype = ctypes.c_size_t
    lib.ggml_backend_buft_get_alignment.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_buft_get_max_size.restype = ctypes.c_size_t
    lib.ggml_backend_buft_get_max_size.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_supports_op.restype = ctypes.c_bool
    lib.ggml_backend_dev_supports_op.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.ggml_tensor_overhead.restype = ctypes.c_size_t
    lib.ggml_tensor_overhead.argtypes = []
    lib.ggml_init.restype = ctypes.c_void_p
    lib.ggml_init.argtypes = [InitParams]
    lib.ggml_free.restype = None
    lib.ggml_free.argtypes = [ctypes.c_void_p]
    lib.ggml_new_tensor_1d.restype = ctypes.c_void_p
    lib.ggml_new_tensor_1d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    return lib


class NextnApi:
    """llama.cpp's staging API for MTP drafting (src/llama-ext.h of the vendored llama.cpp: C++ linkage, so its
    names are mangled and llama-cpp-python binds none of them): whether a context outputs the hidden rows an MTP
    head reads (``llama_set_embeddings_nextn``), and those rows (``llama_get_embeddings_nextn[_ith]``)."""

    _NAMES = {
        "set": "_Z26llama_set_embeddings_nextnP13llama_contextbb",
        "get": "_Z26llama_get_embeddings_nextnP13llama_context",
        "get_ith": "_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
    }

    def __init__(self, lib: ctypes.CDLL) -> None:
        f = ctypes.POINTER(ctypes.c_float)
        self._set = getattr(lib, self._NAMES["set"])
        self._set.argtypes, self._set.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
        self._get = getattr(lib, self._NAMES["get"])
        self._get.argtypes, self._get.restype = [ctypes.c_void_p], f
        self._get_ith = getattr(lib, self._NAMES["get_ith"])
        self._get_ith.argtypes, self._get_ith.restype = [ctypes.c_void_p, ctypes.c_int32], f

    def set_embeddings(self, ctx: int, value: bool, masked: bool) -> None:
        """``masked``: rows for the batch's output tokens only (as logits); unmasked: a row for every token."""
        self._set(ctx, value, masked)

    def rows(self, ctx: int) -> "ctypes._Pointer[ctypes.c_float]":
        return cast("ctypes._Pointer[ctypes.c_float]", self._get(ctx))

    def row(self, ctx: int, i: int) -> "ctypes._Pointer[ctypes.c_float]":
        return cast("ctypes._Pointer[ctypes.c_float]", self._get_ith(ctx, i))


@functools.lru_cache(maxsize=1)
def nextn_api() -> NextnApi | None:
    """The MTP staging API of llama-cpp-python's libllama (None: this build does not export it)."""
    import llama_cpp

    try:
        return NextnApi(llama_cpp.llama_cpp._lib)
    except AttributeError:
        return None
