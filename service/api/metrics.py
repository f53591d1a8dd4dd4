"""``GET /metrics``: Prometheus exposition through ``prometheus-client``, one registry per app.

One ``Metrics`` object per app (built in ``create_app``, kept on ``app.state``) owns a
``CollectorRegistry`` (never the library's process-global one: tests build many apps in one
process). Three kinds of series:

- counters and histograms updated as requests run: responses by method, route and status (the
  ``MetricsMiddleware``), generation errors by code, prompt and completion tokens, time to first
  token and between tokens (the OpenAI routes);
- gauges read from the manager, the runner and the engine when scraped (``_ServerState``, a custom
  collector): queue depth, running generations, KV cells, predicted vs allocated bytes per device,
  measured vs predicted speeds. A scrape sees the state of that moment, and a series exists only
  while what it measures does (no model: no per-device bytes);
- the Model Server Protocol gauges of the Kubernetes Gateway API Inference Extension (pinned
  v1.0.0, ``docs/proposals/003-model-server-protocol``), per served model (``model_name``):
  TotalQueuedRequests, TotalRunningRequests, KVCacheUtilization, under this server's names and
  under vLLM's (the endpoint picker's defaults), from the runner's queue and the ``Engine``
  protocol (``running_sequences``, ``kv_cells_used`` / ``kv_cells_allocated``).

Labels are bounded: an HTTP method outside ``HTTP_METHODS`` is counted as ``other`` and a path no
route matches as ``unmatched``, so made-up methods and paths cannot add series.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sizing.devices import MIB

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
        self._prompt_tokens = Counter("gguf_prompt_tokens", "Prompt tokens evaluated.", registry=self.registry)
        self._completion_tokens = Counter("gguf_completion_tokens", "Tokens generated.", registry=self.registry)
        self._ttft = Histogram("gguf_time_to_first_token_seconds", "From the request's arrival to its first generated token.",
                               buckets=TTFT_BUCKETS_S, registry=self.registry)
        self._token = Histogram("gguf_token_latency_seconds", "Time between consecutive generated tokens.",
                                buckets=TOKEN_BUCKETS_S, registry=self.registry)
        # Measured speeds: sums over every generation that the engine timed (GET /api/models shows them too).
        self._prompt_tokens_timed = 0
        self._prompt_seconds = 0.0
        self._decode_tokens_timed = 0
        self._decode_seconds = 0.0
        self._state: _ServerState | None = None

    def attach(self, manager: Any) -> None:
        """Read this manager's state at every scrape (the lifespan calls it once it built the manager)."""
        if self._state is not None:  # a second lifespan of the same app: one set of gauges, the new manager's
            self.registry.unregister(self._state)
        self._state = _ServerState(self, manager)
        self.registry.register(self._state)

    def request(self, method: str, route: str, status: int) -> None:
        self._requests.labels(method_label(method), route, str(status)).inc()

    def generation(self, last: Any) -> None:
        """A finished generation's usage and, when the engine measured them, its prompt and decode times."""
        self._prompt_tokens.inc(last.prompt_tokens)
        self._completion_tokens.inc(last.completion_tokens)
        with self._lock:
            evaluated = last.prompt_tokens - getattr(last, "cached_tokens", 0)  # a cached prefix is not evaluated
            if last.prompt_seconds > 0 and evaluated > 0:
                self._prompt_tokens_timed += evaluated
                self._prompt_seconds += last.prompt_seconds
            if last.decode_seconds > 0:
                self._decode_tokens_timed += last.completion_tokens - 1
                self._decode_seconds += last.decode_seconds

    def measured_speeds(self) -> dict[str, float | None]:
        """Tokens/s measured over every generation so far: prompt evaluation and decoding."""
        with self._lock:
            return {
                "prompt_tokens_per_s": self._prompt_tokens_timed / self._prompt_seconds if self._prompt_seconds else None,
                "decode_tokens_per_s": self._decode_tokens_timed / self._decode_seconds if self._decode_seconds else None,
            }

    def error(self, code: str) -> None:
        self._errors.labels(code).inc()

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def token(self, seconds: float) -> None:
        self._token.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class _ServerState(Collector):
    """Gauges read from the manager, runner and engine at scrape time."""

    def __init__(self, metrics: Metrics, manager: Any) -> None:
        self._metrics = metrics
        self._manager = manager

    def collect(self) -> Iterator[Metric]:
        manager = self._manager
        runner, engine = manager.runner, manager.engine
        ready = manager.ready
        waiting = runner.waiting
        yield _gauge("gguf_queue_depth", "Requests waiting for the model.", waiting)
        yield _gauge("gguf_running", "Engine calls running on the worker threads (at most GGUF_PARALLEL generations).",
                     runner.running)
        cells_used = engine.kv_cells_used if ready else 0
        cells_allocated = engine.kv_cells_allocated if ready else 0
        yield _gauge("gguf_kv_cells_used", "KV cache cells holding tokens.", cells_used)
        yield _gauge("gguf_n_ctx", "Context one request may use, tokens (per sequence with GGUF_PARALLEL > 1).",
                     engine.n_ctx if ready else 0)
        yield from self._msp(manager.current.name if ready else None, waiting,
                             engine.running_sequences if ready else 0, cells_used, cells_allocated)

        info = manager.describe(manager.current) if ready else None
        device = GaugeMetricFamily("gguf_device_bytes", "Memory per device for the loaded model: the plan's prediction "
                                   "and what llama.cpp allocated.", labels=["device", "kind"])
        for m in (info or {}).get("memory", []):
            device.add_metric([m["device"], "allocated"], int(m["allocated_mib"] * MIB))
            if m.get("predicted_mib") is not None:
                device.add_metric([m["device"], "predicted"], int(m["predicted_mib"] * MIB))
        yield device
        speed = GaugeMetricFamily("gguf_tokens_per_second", "Generation speed: measured over the generations so far, "
                                  "and the plan's prediction.", labels=["phase", "kind"])
        measured = self._metrics.measured_speeds()
        predicted = (info or {}).get("plan", {}).get("predicted_speed") or {}
        for phase in ("prompt", "decode"):
            got = measured[f"{phase}_tokens_per_s"]
            if got is not None:
                speed.add_metric([phase, "measured"], got)
            want = predicted.get(f"{phase}_tokens_per_s")
            if want is not None:
                speed.add_metric([phase, "predicted"], want)
        yield speed
        yield _gauge("gguf_model_loaded", "1 while a model is loaded and serving.", 1 if ready else 0)

    def _msp(self, model: str | None, waiting: int, running: int, used: int, allocated: int) -> Iterator[Metric]:
        """The Model Server Protocol gauges for the served model, each under both names; none without a model."""
        values = {
            QUEUED_REQUESTS: waiting,
            RUNNING_REQUESTS: running,
            KV_CACHE_USAGE: used / allocated if allocated else 0.0,
        }
        for spec in MSP_GAUGES:
            own, vllm, doc = spec
            for name in (own, vllm):
                family = GaugeMetricFamily(name, doc if name == own else f"Alias of {own} (vLLM's name).",
                                           labels=["model_name"])
                if model is not None:
                    family.add_metric([model], values[spec])
                yield family
        capacity = GaugeMetricFamily("gguf_kv_cells_allocated", "KV cache cells allocated in all (every sequence's "
                                     "stream): the denominator of gguf_kv_cache_usage_ratio.", labels=["model_name"])
        if model is not None:
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
