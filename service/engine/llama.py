"""The llama.cpp engine, through llama-cpp-python: the only module that imports ``llama_cpp``.

It applies a ``Plan`` (n_ctx, type_k/type_v, flash attention, n_gpu_layers,
tensor_split, swa_full, set explicitly since llama-cpp-python's defaults
differ from llama-server's), parses llama.cpp's allocation log lines into
``Allocation`` values, and generates token by token so that cancellation,
stop strings and usage counts are exact and streaming equals non-streaming.
"""

from __future__ import annotations

import codecs
import collections
import ctypes
import logging
import random
import re
import threading
import os
import time
from typing import Any, Iterator

from sizing.ggml import GGML_TYPE_IDS
from sizing.plan import Plan

from ..errors import EngineFailure, InsufficientMemory, NotReady
from .base import Allocation, Cancel, Chunk, GenerationParams, LoadReport, TokenLogprob
from . import loglines as L
from .chat_template import BuiltinChatTemplate, ChatTemplate
from .grammar import compile_grammar, grammar_logits_processor
from .prompting import Prompting
from . import params as _params
from .params import plan_params

log = logging.getLogger(__name__)

ABORT_MIN_PROMPT_TOKENS = 256
"""Prompts at least this long are evaluated with llama.cpp's abort callback set (see ``_generate``)."""

# NVML lists GPUs in PCI bus order; CUDA, by default, fastest first. The plan's card
# indexes come from NVML, so llama.cpp must see the same order (set before CUDA starts).
os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")

_MIB = 1 << 20
_RE_DEVICE = re.compile(r"device (\d+)")


def _device_of(buffer_name: str) -> str:
    """llama.cpp buffer names to devices: CPU, CPU_Mapped, CUDA_Host -> CPU; CUDA0 -> CUDA0."""
    if buffer_name.startswith("CPU") or buffer_name.endswith("_Host"):
        return "CPU"
    return buffer_name


def parse_allocations(lines: list[str]) -> tuple[tuple[Allocation, ...], tuple[int, int] | None]:
    """Per-device bytes from llama.cpp's load log, and the offloaded/total layer counts."""
    acc: dict[str, dict[str, float]] = {}
    offloaded = None
    for line in lines:
        for rx, field in ((L.MODEL_BUFFER, "weights"), (L.KV_BUFFER, "kv"), (L.OUTPUT_BUFFER, "output"), (L.COMPUTE_BUFFER, "compute")):
            m = rx.search(line)
            if m:
                dev = _device_of(m.group(1))
                acc.setdefault(dev, {}).setdefault(field, 0.0)
                acc[dev][field] += float(m.group(2))
        m = L.OFFLOADED.search(line)
        if m:
            offloaded = (int(m.group(1)), int(m.group(2)))
    allocs = tuple(
        Allocation(
            device=dev,
            weights_bytes=int(f.get("weights", 0) * _MIB),
            kv_bytes=int(f.get("kv", 0) * _MIB),
            compute_bytes=int(f.get("compute", 0) * _MIB),
            output_bytes=int(f.get("output", 0) * _MIB),
        )
        for dev, f in sorted(acc.items(), key=lambda kv: (kv[0] != "CPU", kv[0]))
    )
    return allocs, offloaded


class _LogTap:
    """One process-wide llama.cpp log callback; lines go to logging and, while capturing, to a list."""

    _lock = threading.Lock()
    _installed = False
    _callback: Any = None
    _capture: list[str] | None = None
    _partial = ""
    _recent: "collections.deque[str]" = collections.deque(maxlen=32)
    """The last warning and error lines: where an allocation failed names its device."""

    @classmethod
    def install(cls) -> None:
        import llama_cpp

        with cls._lock:
            if cls._installed:
                return

            @llama_cpp.llama_log_callback  # type: ignore[misc]
            def _cb(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
                cls._on_text(level, text.decode("utf-8", "replace") if text else "")

            cls._callback = _cb  # keep a reference: ctypes callbacks must outlive their use
            llama_cpp.llama_log_set(_cb, ctypes.c_void_p(0))
            cls._installed = True

    @classmethod
    def _on_text(cls, level: int, text: str) -> None:
        buf = cls._partial + text
        *lines, cls._partial = buf.split("\n")
        for line in lines:
            if cls._capture is not None:
                cls._capture.append(line)
            if level in (3, 4):  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
                cls._recent.append(line)
                log.warning("llama.cpp: %s", line)
            else:
                log.debug("llama.cpp: %s", line)

    @classmethod
    def start(cls) -> list[str]:
        cls._capture = []
        return cls._capture

    @classmethod
    def stop(cls) -> None:
        cls._capture = None

    @classmethod
    def failed_device(cls) -> str | None:
        """The device of the latest failed allocation in llama.cpp's log (ggml-cuda.cu: "... on device N ...")."""
        for line in reversed(cls._recent):
            if "alloc" in line.lower() or "out of memory" in line.lower():
                m = _RE_DEVICE.search(line)
                if m:
                    return f"CUDA{m.group(1)}"
        return None


def llama_placement_kwargs(plan: Plan) -> dict[str, Any]:
    """n_gpu_layers, tensor_split and main_gpu as ``Llama`` takes them, from the one translation
    (``service.engine.params``): tensor_split covers every device, 0 for the cards the plan does not use."""
    mp, _ = plan_params(plan)
    return {"n_gpu_layers": mp.n_gpu_layers, "tensor_split": list(mp.tensor_split) or None, "main_gpu": mp.main_gpu}


def expert_overrides(plan: Plan) -> list[str]:
    """Tensor-name patterns the plan keeps in host memory (MoE experts of the first blocks)."""
    return list(plan_params(plan)[0].cpu_overrides)


_override_lock = threading.Lock()


class tensor_overrides:
    """Load with ``tensor_buft_overrides`` pinning tensors that match ``patterns`` to host memory.

    llama-cpp-python's ``Llama`` does not expose the field, so for the duration
    of the constructor ``llama_model_default_params`` returns params that carry it.
    """

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = patterns
        self._keep: Any = None

    def __enter__(self) -> "tensor_overrides":
        if not self.patterns:
            return self
        import llama_cpp.llama as llama_mod

        _override_lock.acquire()
        buft = _params._cpu_buffer_type()
        arr = (_params._BuftOverride * (len(self.patterns) + 1))()
        encoded = [p.encode("utf-8") for p in self.patterns]
        for i, pat in enumerate(encoded):
            arr[i].pattern = pat
            arr[i].buft = buft
        arr[len(encoded)].pattern = None
        arr[len(encoded)].buft = None
        self._keep = (arr, encoded)
        lib = llama_mod.llama_cpp
        original = lib.llama_model_default_params
        self._restore = (lib, original)

        def params_with_overrides() -> Any:
            params = original()
            params.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p)
            return params

        lib.llama_model_default_params = params_with_overrides
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.patterns:
            return
        lib, original = self._restore
        lib.llama_model_default_params = original
        _override_lock.release()


class LlamaEngine(Prompting):
    """A llama-cpp-python ``Llama`` behind the ``Engine`` protocol."""

    def __init__(self, *, n_threads: int | None = None) -> None:
        self._llm: Any = None
        self._n_threads = n_threads
        self._template: ChatTemplate | BuiltinChatTemplate | None = None
        self._abort_cb: Any = None
        self._device = "CPU"
        self._running = 0

    @property
    def n_ctx(self) -> int:
        return int(self._llm.n_ctx()) if self._llm is not None else 0

    def _require(self) -> Any:
        if self._llm is None:
            raise NotReady("no model is loaded")
        return self._llm

    def load(self, path: str, plan: Plan) -> LoadReport:
        from llama_cpp import Llama

        _LogTap.install()
        cfg = plan.cfg
        p = plan.placement
        kwargs: dict[str, Any] = dict(
            model_path=path,
            n_ctx=cfg.n_ctx,
            n_batch=cfg.n_batch,
            n_ubatch=cfg.n_ubatch,
            n_seq_max=cfg.n_seq_max,
            type_k=GGML_TYPE_IDS[cfg.type_k],
            type_v=GGML_TYPE_IDS[cfg.type_v],
            flash_attn=cfg.flash_attn == "on",
            swa_full=cfg.swa_full,
            offload_kqv=cfg.offload_kqv,
            verbose=False,
            **llama_placement_kwargs(plan),
        )
        if self._n_threads:
            kwargs["n_threads"] = self._n_threads
            kwargs["n_threads_batch"] = self._n_threads
        lines = _LogTap.start()
        t0 = time.perf_counter()
        try:
            with tensor_overrides(expert_overrides(plan)) as overrides:
                llm = Llama(**kwargs)
            self._overrides_keep = overrides._keep
        except ValueError as exc:
            text = "\n".join(lines[-20:])
            if "out of memory" in text.lower() or "failed to allocate" in text.lower():
                raise InsufficientMemory(f"llama.cpp could not allocate the model: {exc}") from exc
            raise EngineFailure(f"llama.cpp failed to load {path}: {exc}") from exc
        finally:
            _LogTap.stop()
        elapsed = time.perf_counter() - t0
        self.unload()
        self._llm = llm
        self._template = ChatTemplate.from_llama(llm)
        self._device = ",".join(f"CUDA{i}" for i in p.gpus) if p.gpus and p.n_gpu_layers else "CPU"
        allocs, offloaded = parse_allocations(lines)
        return LoadReport(
            n_ctx=int(llm.n_ctx()),
            allocations=allocs,
            offloaded_layers=offloaded,
            load_seconds=elapsed,
            log_lines=tuple(lines),
        )

    def unload(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.close()

    def _tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        llm = self._require()
        return list(llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special))

    def _generate_tokens(self, tokens: list[int], params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        return self._generate(tokens, params, cancel)

    def check(self, params: GenerationParams) -> None:
        """Compile the request's grammar now, so a bad schema is a 400 before any byte is streamed."""
        compile_grammar(params)

    @property
    def kv_cells_used(self) -> int:
        return int(self._llm.n_tokens) if self._llm is not None else 0

    @property
    def kv_cells_allocated(self) -> int:
        return self.n_ctx

    @property
    def running_sequences(self) -> int:
        return self._running


    def _set_abort(self, cancel: Cancel | None) -> None:
        """llama.cpp's abort callback: polled per graph node, so a long prompt evaluation stops when the client leaves.

        Only set during prompt evaluation: a ctypes callback per node costs more than the
        per-token ``Cancel`` check it would duplicate (ggml-cpu.c ``ggml_graph_compute_thread``).
        """
        import llama_cpp

        llm = self._llm
        if llm is None:
            return
        if cancel is None:
            self._abort_cb = None
            llama_cpp.llama_set_abort_callback(llm._ctx.ctx, llama_cpp.ggml_abort_callback(), None)
            return

        event = cancel.event

        @llama_cpp.ggml_abort_callback  # type: ignore[misc]
        def _abort(_data: ctypes.c_void_p) -> bool:
            return event.is_set()

        self._abort_cb = _abort  # keep a reference while llama.cpp holds the pointer
        llama_cpp.llama_set_abort_callback(llm._ctx.ctx, _abort, None)

    def _logprob(self, llm: Any, tok: int, k: int) -> TokenLogprob:
        """The sampled token's log-softmax over the logits it was sampled from, and the top k alternatives."""
        import llama_cpp
        import numpy as np

        n_vocab = llm.n_vocab()
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,))
        x = logits.astype(np.float64)
        m = x.max()
        lse = m + np.log(np.exp(x - m).sum())
        piece = bytes(llm.detokenize([tok]))
        top: tuple[tuple[str, float], ...] = ()
        if k > 0:
            idx = np.argpartition(-x, k)[:k]
            idx = idx[np.argsort(-x[idx])]
            top = tuple((bytes(llm.detokenize([int(i)])).decode("utf-8", "replace"), float(x[i] - lse)) for i in idx)
        return TokenLogprob(piece.decode("utf-8", "replace"), float(x[tok] - lse), tuple(piece), top)

    def _decode_failure(self, exc: RuntimeError, n_prompt: int, params: GenerationParams, cancel: Cancel) -> Exception | None:
        """llama_decode's return code to our errors (llama.cpp llama-context.cpp ``llama_context::decode``):
        1 no KV slot, -2 allocation failed: out of memory; 2 aborted (our abort callback); else a failure."""
        m = re.search(r"llama_decode returned (-?\d+)", str(exc))
        code = int(m.group(1)) if m else None
        if code == 2 and cancel.cancelled:
            return None
        if code in (1, -2) or "out of memory" in str(exc).lower():
            device = _LogTap.failed_device() or self._device
            return InsufficientMemory(
                f"out of memory on {device} during generation (llama_decode returned {code}) with "
                f"{n_prompt} prompt tokens and max_tokens {params.max_tokens}",
                device=device, prompt_tokens=n_prompt, max_tokens=params.max_tokens,
            )
        return EngineFailure(f"llama.cpp failed to decode: {exc}")

    def _release(self, llm: Any) -> None:
        """Drop the failed request's KV cells so the next request starts from an empty cache."""
        import llama_cpp

        try:
            llm.reset()
            mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
            if mem is not None:
                llama_cpp.llama_memory_clear(mem, True)
        except Exception:  # best effort: the next request resets again
            log.exception("clearing the KV cache after a failed request failed")

    def _generate(self, tokens: list[int], params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        import llama_cpp

        llm = self._require()
        n_ctx = int(llm.n_ctx())
        n_prompt = len(tokens)
        room = n_ctx - n_prompt
        max_new = room if params.max_tokens is None else min(params.max_tokens, room)
        if max_new <= 0:
            yield Chunk(finish_reason="length", prompt_tokens=n_prompt, completion_tokens=0)
            return
        grammar = compile_grammar(params)
        # Start from an empty cache every request: identical inputs give identical outputs.
        llm.reset()
        llm.set_seed(params.seed if params.seed is not None else random.randint(0, 2**31 - 1))
        vocab = llm._model.vocab
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        stops = [s for s in params.stop if s]
        pending = ""
        pending_lp: list[TokenLogprob] = []
        n_out = 0
        finish = "length"
        gen = llm.generate(
            tokens,
            top_k=0,
            top_p=params.top_p,
            min_p=0.0,
            temp=params.temperature,
            repeat_penalty=1.0,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
            reset=True,
            logits_processor=[grammar_logits_processor(llm._model.vocab, grammar)] if grammar is not None else None,
        )
        stopped = False
        # The abort callback lets a client that leaves stop a long prompt's evaluation, but it is a
        # Python call per graph node: for a short prompt (evaluated in tens of ms) it would cost more
        # time to first token than it could save.
        aborting = len(tokens) >= ABORT_MIN_PROMPT_TOKENS
        if aborting:
            self._set_abort(cancel)
        first = True
        # Measured speeds, for comparison with the plan's predictions: the prompt's evaluation
        # (until the first token is sampled) and the decoding of every later token.
        t_start = time.perf_counter()
        t_first = t_last = 0.0
        self._running = 1
        try:
            for tok in gen:
                t_last = time.perf_counter()
                if first:
                    t_first = t_last
                    first = False
                if aborting:
                    self._set_abort(None)
                    aborting = False
                if cancel.cancelled:
                    finish = "cancelled"
                    break
                if not params.ignore_eos and llama_cpp.llama_vocab_is_eog(vocab, tok):
                    finish = "stop"
                    break
                n_out += 1
                if params.logprobs is not None:
                    pending_lp.append(self._logprob(llm, tok, params.logprobs))
                pending += decoder.decode(llm.detokenize([tok]))
                emit, pending, stopped = _split_stop(pending, stops)
                if emit:
                    yield Chunk(text=emit, logprobs=tuple(pending_lp))
                    pending_lp = []
                if stopped:
                    finish = "stop"
                    break
                if n_out >= max_new:
                    finish = "length"
                    break
        except RuntimeError as exc:
            self._release(llm)
            err = self._decode_failure(exc, n_prompt, params, cancel)
            if err is None:
                finish = "cancelled"
            else:
                raise err from exc
        finally:
            self._running = 0
            if aborting:
                self._set_abort(None)
            gen.close()
        if not stopped:
            pending += decoder.decode(b"", final=True)
            if pending or pending_lp:
                yield Chunk(text=pending, logprobs=tuple(pending_lp))
        yield Chunk(finish_reason=finish, prompt_tokens=n_prompt, completion_tokens=n_out,
                    prompt_seconds=(t_first - t_start) if t_first else 0.0,
                    decode_seconds=(t_last - t_first) if n_out > 1 else 0.0)


def _split_stop(text: str, stops: list[str]) -> tuple[str, str, bool]:
    """(text safe to emit, text held back, stopped): hold back a suffix that may start a stop string."""
    if not stops:
        return text, "", False
    first = -1
    for s in stops:
        i = text.find(s)
        if i != -1 and (first == -1 or i < first):
            first = i
    if first != -1:
        return text[:first], "", True
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold], text[len(text) - hold :], False
