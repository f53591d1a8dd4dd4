"""``GET /metrics``: Prometheus exposition through ``prometheus-client``, one registry per app.

One ``Metrics`` object per app (built in ``create_app``, kept on ``app.state``) owns a
``CollectorRegistry`` (never the library's process-global one: tests build many apps in one
process). Three kinds of series:

- counters and histograms updated as requests run: responses by method, route and status (the
  ``MetricsMiddleware``), generation errors by code, prompt and completion tokens, time to first
  token and between tokens per model (the OpenAI routes);
- gauges read from the manager, each loaded model's runner and engine when scraped (``_ServerState``,
  a custom collector), per model (``model``): queue depth, running generations, KV cells, predicted vs
  allocated bytes per device, measured vs predicted speeds; requests waiting for a model to be loaded
  (or reloaded, or admitted again after a swap) and the oldest one's wait, and the models yielding to a
  swap. A scrape sees the state of that moment, and a series exists only while what it measures does
  (a model not loaded has none);
- the Model Server Protocol gauges of the Kubernetes Gateway API Inference Extension (pinned
  v1.0.0, ``docs/proposals/003-model-server-protocol``), per served model (``model_name``):
  TotalQueuedRequests, TotalRunningRequests, KVCacheUtilization, under this server's names and
  under vLLM's (the endpoint picker's defaults), from the runner's queue and the ``Engine``
  protocol (``running_sequences``, ``kv_cells_used`` / ``kv_cells_allocated``).

Labels are bounded: an HTTP method outside ``HTTP_METHODS`` is counted as ``other`` and a path no
route matches as ``unmatched``, so made-up methods and paths cannot add series; ``model`` is a model's
registered name (never the request's text: an alias counts under its model).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sizing.units import MIB

if TYPE_CHECKING:
    from ..residency import ModelManager

router = APIRouter()

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)

HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""Methods counted under their own name; any other is ``other`` (one series however many are invented)."""
OTHER_METHOD = "other"
UNMATCHED_ROUTE = "unmatched"

# The Model Server Protocol gauges: (this server's name, vLLM's name, help). The endpoint picker
# reads the names its flags give (--total-queued-requests-metric, --kv-cache-usage-percentage-metric;
# --total-running-requests-metric from later releases), vLLM's by default;
# deploy/k8s/inference-gateway/epp.yaml names this server's.
QUEUED_REQUESTS = ("gguf_requests_waiting", "vllm:num_requests_waiting",
                   "Requests waiting for a decode slot (TotalQueuedRequests of the Model Server Protocol).")
RUNNING_REQUESTS = ("gguf_requests_running", "vllm:num_requests_running",
                    "Sequences being decoded or having their prompt evaluated (TotalRunningRequests).")
KV_CACHE_USAGE = ("gguf_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc",
                  "KV cache cells holding tokens over the cells allocated, 0 to 1 (KVCacheUtilization).")
MSP_GAUGES = (QUEUED_REQUESTS, RUNNING_REQUESTS, KV_CACHE_USAGE)


def method_label(method: str) -> str:
    """The method as a label value: known methods by name, anything else folded into one value."""
    return method if method in HTTP_METHODS else OTHER_METHOD


class Metrics:
    """The service's counters and histograms; safe to update from the event loop and the engine threads."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._requests = Counter("gguf_requests", "HTTP responses by method, route and status.",
                                 ["method", "route", "status"], registry=self.registry)
        self._errors = Counter("gguf_generation_errors", "Generations that failed, by error code (streamed ones included).",
                               ["code"], registry=self.registry)
        self._prompt_tokens = Counter("gguf_prompt_tokens", "Prompt tokens evaluated.", ["model"],
                                      registry=self.registry)
        self._completion_tokens = Counter("gguf_completion_tokens", "Tokens generated.", ["model"],
                                          registry=self.registry)
        self._drafted = Counter("gguf_draft_tokens", "Tokens drafted by self-speculation and verified.", ["model"],
                                registry=self.registry)
        self._accepted = Counter("gguf_draft_accepted_tokens", "Drafted tokens the model chose itself (each a decode "
                                 "step saved).", ["model"], registry=self.registry)
        self._ttft = Histogram("gguf_time_to_first_token_seconds", "From the request's arrival to its first generated token.",
                               ["model"], buckets=TTFT_BUCKETS_S, registry=self.registry)
        self._token = Histogram("gguf_token_latency_seconds", "Time between consecutive generated tokens.",
                                ["model"], buckets=TOKEN_BUCKETS_S, registry=self.registry)
        # Measured speeds per model: sums over every generation that the engine timed (GET /api/models shows them).
        self._timed: dict[str, list[float]] = {}
        """model -> [prompt tokens timed, prompt seconds, decode tokens timed, decode seconds]."""
        self._state: _ServerState | None = None

    def attach(self, manager: "ModelManager") -> None:
        """Read this manager's state at every scrape (the lifespan calls it once it built the manager)."""
        if self._state is not None:  # a second lifespan of the same app: one set of gauges, the new manager's
            self.registry.unregister(self._state)
        self._state = _ServerState(self, manager)
        self.registry.register(self._state)

    def request(self, method: str, route: str, status: int) -> None:
        self._requests.labels(method_label(method), route, str(status)).inc()

    def generation(self, last: Any, model: str) -> None:
        """A finished generation's usage and, when the engine measured them, its prompt and decode times."""
        self._prompt_tokens.labels(model).inc(last.prompt_tokens)
        self._completion_tokens.labels(model).inc(last.completion_tokens)
        drafted = getattr(last, "drafted_tokens", 0)
        if drafted:
            self._drafted.labels(model).inc(drafted)
            self._accepted.labels(model).inc(last.accepted_tokens)
        with self._lock:
            t = self._timed.setdefault(model, [0.0, 0.0, 0.0, 0.0])
            evaluated = last.prompt_tokens - getattr(last, "cached_tokens", 0)  # a cached prefix is not evaluated
            if last.prompt_seconds > 0 and evaluated > 0:
                t[0] += evaluated
                t[1] += last.prompt_seconds
            if last.decode_seconds > 0:
                t[2] += last.completion_tokens - 1
                t[3] += last.decode_seconds

    def measured_speeds(self, model: str) -> dict[str, float | None]:
        """Tokens/s measured over every generation of ``model`` so far: prompt evaluation and decoding."""
        with self._lock:
            t = self._timed.get(model, [0.0, 0.0, 0.0, 0.0])
            return {
                "prompt_tokens_per_s": t[0] / t[1] if t[1] else None,
                "decode_tokens_per_s": t[2] / t[3] if t[3] else None,
            }

    def error(self, code: str) -> None:
        self._errors.labels(code).inc()

    def first_token(self, seconds: float, model: str) -> None:
        self._ttft.labels(model).observe(seconds)

    def token(self, seconds: float, model: str) -> None:
        self._token.labels(model).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class _ServerState(Collector):
    """Gauges read from the manager and each loaded model's runner and engine at scrape time."""

    def __init__(self, metrics: Metrics, manager: "ModelManager") -> None:
        self._metrics = metrics
        self._manager = manager

    def collect(self) -> Iterator[Metric]:
        loaded = [s for s in self._manager.loaded() if s.runner is not None and s.engine is not None]
        families = {
            "queue": GaugeMetricFamily("gguf_queue_depth", "Requests waiting for the model.", labels=["model"]),
            "running": GaugeMetricFamily("gguf_running", "Engine calls running on the model's worker threads (at most "
                                         "its slots' generations).", labels=["model"]),
            "cells": GaugeMetricFamily("gguf_kv_cells_used", "KV cache cells holding tokens.", labels=["model"]),
            "n_ctx": GaugeMetricFamily("gguf_n_ctx", "Context one request may use, tokens (per sequence with several "
                                       "slots).", labels=["model"]),
            "evaluated": GaugeMetricFamily("gguf_prompt_tokens_evaluated", "Prompt tokens the model evaluated since "
                                           "its load (cached prefixes and the other choices of n > 1 share an "
                                           "evaluation and are not counted).", labels=["model"]),
        }
        device = GaugeMetricFamily("gguf_device_bytes", "Memory per device for each loaded model: the plan's "
                                   "prediction and what llama.cpp allocated.", labels=["model", "device", "kind"])
        speed = GaugeMetricFamily("gguf_tokens_per_second", "Generation speed per model: measured over the "
                                  "generations so far, and the plan's prediction.", labels=["model", "phase", "kind"])
        pc_gauges = {k: GaugeMetricFamily(f"gguf_prompt_cache_{k}", text, labels=["model"]) for k, text in (
            ("bytes", "Host memory holding idle conversations' KV beyond the slots."),
            ("entries", "Conversations held in host memory beyond the slots."),
            ("budget_bytes", "The host memory the prompt cache may hold (planned at load)."),
            ("disk_bytes", "Disk holding cached prompts (GGUF_PROMPT_CACHE_DIR)."),
            ("disk_entries", "Cached prompts on disk."))}
        pc_counts = {k: CounterMetricFamily(f"gguf_prompt_cache_{k}", text, labels=["model"]) for k, text in (
            ("hits", "Requests whose prompt prefix was restored from the prompt cache beyond the slots (since load)."),
            ("misses", "Requests of whose prompt the slots held less than half and the prompt cache nothing (since load)."),
            ("restored_tokens", "Prompt tokens restored from the prompt cache instead of evaluated (since load)."),
            ("evicted", "Cached prompts evicted from host memory to keep the budget (since load)."),
            ("rejected", "Cache files ignored: another model or parameters, truncated, corrupt (since load)."),
            ("held_unused", "Requests that reused less than half of their prompt although a slot or a cached prompt "
             "shared at least half of it: a sliding window that no longer reached the cut, a state llama.cpp did not "
             "take back (since load)."))}
        lookups = CounterMetricFamily(
            "gguf_prompt_cache_lookups", "Requests by how much of their prompt the slots and the prompt cache gave "
            "back (since load): hit, at least half of its tokens; partial, 32 or more but less than half; miss, fewer.",
            labels=["model", "result"])
        msp: list[tuple[str, int, int, int, int]] = []
        for st in loaded:
            runner, engine, name = st.runner, st.engine, st.name
            assert runner is not None and engine is not None
            waiting = runner.waiting
            gauges = engine.gauges()  # one round trip to the runner for all of them
            used, allocated = gauges.kv_cells_used, engine.kv_cells_allocated
            families["queue"].add_metric([name], waiting)
            families["running"].add_metric([name], runner.running)
            families["cells"].add_metric([name], used)
            families["n_ctx"].add_metric([name], engine.n_ctx)
            families["evaluated"].add_metric([name], gauges.prompt_tokens_evaluated)
            msp.append((name, waiting, gauges.running_sequences, used, allocated))
            pc = gauges.prompt_cache
            for k, gauge in pc_gauges.items():
                if k in pc:
                    gauge.add_metric([name], pc[k])
            for k, count in pc_counts.items():
                if k in pc:
                    count.add_metric([name], pc[k])
            for result in ("hit", "partial", "miss"):
                if f"lookup_{result}" in pc:
                    lookups.add_metric([name, result], pc[f"lookup_{result}"])
            info = self._manager.describe(st) or {}
            for m in info.get("memory", []):
                device.add_metric([name, m["device"], "allocated"], int(m["allocated_mib"] * MIB))
                if m.get("predicted_mib") is not None:
                    device.add_metric([name, m["device"], "predicted"], int(m["predicted_mib"] * MIB))
            measured = self._metrics.measured_speeds(name)
            predicted = (info.get("plan") or {}).get("predicted_speed") or {}
            for phase in ("prompt", "decode"):
                got = measured[f"{phase}_tokens_per_s"]
                if got is not None:
                    speed.add_metric([name, phase, "measured"], got)
                want = predicted.get(f"{phase}_tokens_per_s")
                if want is not None:
                    speed.add_metric([name, phase, "predicted"], want)
        yield from families.values()
        yield from pc_gauges.values()
        yield from pc_counts.values()
        yield lookups
        yield from self._msp(msp)
        yield device
        yield speed
        yield _gauge("gguf_model_loaded", "Models loaded and serving (1 or 0 with one model).", len(loaded))
        yield from self._admission()
        yield from self._workers()

    def _workers(self) -> Iterator[Metric]:
        """The ggml-rpc workers of GGUF_RPC_WORKERS: whether each answers, and since when one does not."""
        watch = getattr(self._manager, "worker_watch", None)
        if watch is None or not watch.endpoints:
            return
        up = GaugeMetricFamily("gguf_rpc_worker_up", "1 while the ggml-rpc worker answers its /status, 0 while it is "
                               "missing (its host, link or process gone or stopped).", labels=["worker"])
        since = GaugeMetricFamily("gguf_rpc_worker_missing_since_seconds", "Unix time from which a missing worker "
                                  "has not answered (only while it is missing).", labels=["worker"])
        for h in watch.health():
            up.add_metric([h.endpoint], 1 if h.up else 0)
            if not h.up:
                since.add_metric([h.endpoint], h.since_unix_s)
        yield up
        yield since

    def _admission(self) -> Iterator[Metric]:
        """Requests waiting to be admitted to a model (not loaded, reloading, or yielding to a swap), per model."""
        waiting, yielding = self._manager.admission()
        count = GaugeMetricFamily("gguf_requests_waiting_for_load", "Requests waiting for the model to be loaded "
                                  "(on demand, perhaps a swap), reloaded, or admitted again after a swap it yields "
                                  "to: the queue a new request joins at the end.", labels=["model"])
        oldest = GaugeMetricFamily("gguf_load_wait_seconds", "How long the oldest request waiting for the model "
                                   "(gguf_requests_waiting_for_load) has waited.", labels=["model"])
        for name, w in sorted(waiting.items()):
            count.add_metric([name], w["waiting"])
            oldest.add_metric([name], w["oldest_s"])
        ylds = GaugeMetricFamily("gguf_model_yielding", "1 for a loaded model that admits no new request: a swap "
                                 "waits for its memory, and it finishes what it admitted first.", labels=["model"])
        for name in yielding:
            ylds.add_metric([name], 1)
        yield count
        yield oldest
        yield ylds

    def _msp(self, models: list[tuple[str, int, int, int, int]]) -> Iterator[Metric]:
        """The Model Server Protocol gauges per served model, each under both names; none without a model."""
        for i, spec in enumerate(MSP_GAUGES):
            own, vllm, doc = spec
            for name in (own, vllm):
                family = GaugeMetricFamily(name, doc if name == own else f"Alias of {own} (vLLM's name).",
                                           labels=["model_name"])
                for model, waiting, running, used, allocated in models:
                    value = (waiting, running, used / allocated if allocated else 0.0)[i]
                    family.add_metric([model], value)
                yield family
        capacity = GaugeMetricFamily("gguf_kv_cells_allocated", "KV cache cells allocated in all (every sequence's "
                                     "stream): the denominator of gguf_kv_cache_usage_ratio.", labels=["model_name"])
        for model, _, _, _, allocated in models:
            capacity.add_metric([model], allocated)
        yield capacity


class MetricsMiddleware:
    """Counts every HTTP response by method, route template and status (pure ASGI: streaming untouched)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def _send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            # The route's template (bounded by the app's routes), never the raw path.
            route = scope.get("route")
            path = getattr(route, "path", None) or UNMATCHED_ROUTE
            self.metrics.request(str(scope.get("method", "")), path, status)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    m: Metrics = request.app.state.metrics
    return Response(m.render(), media_type=CONTENT_TYPE_PLAIN_0_0_4)
