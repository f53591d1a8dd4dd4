"""``GET /metrics`` in the Prometheus text format (0.0.4), written by hand: a few counters and histograms.

One ``Metrics`` object per app (built in ``create_app``, kept on ``app.state``);
an ASGI middleware counts responses by route and status, the OpenAI routes
record tokens and latencies, and the gauges (queue depth, KV cells, predicted
vs allocated bytes per device) are read from the manager when scraped.
"""

from __future__ import annotations

import threading
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sizing.devices import MIB

router = APIRouter()

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.sum}")
        out.append(f"{name}_count {self.count}")
        return out


class Metrics:
    """The service's counters; safe to update from the event loop and the engine thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, int], int] = {}
        self.tokens_in = 0
        self.tokens_out = 0
        self.generation_errors: dict[str, int] = {}
        self.ttft_s = Histogram(TTFT_BUCKETS_S)
        self.prompt_tokens_timed = 0
        self.prompt_seconds = 0.0
        self.decode_tokens_timed = 0
        self.decode_seconds = 0.0
        self.token_s = Histogram(TOKEN_BUCKETS_S)

    def request(self, method: str, route: str, status: int) -> None:
        with self._lock:
            key = (method, route, status)
            self.requests[key] = self.requests.get(key, 0) + 1

    def generation(self, last: Any) -> None:
        """A finished generation's usage and, when the engine measured them, its prompt and decode times."""
        with self._lock:
            self.tokens_in += last.prompt_tokens
            self.tokens_out += last.completion_tokens
            if last.prompt_seconds > 0:
                self.prompt_tokens_timed += last.prompt_tokens
                self.prompt_seconds += last.prompt_seconds
            if last.decode_seconds > 0:
                self.decode_tokens_timed += last.completion_tokens - 1
                self.decode_seconds += last.decode_seconds

    def measured_speeds(self) -> dict[str, float | None]:
        """Tokens/s measured over every generation so far: prompt evaluation and decoding."""
        with self._lock:
            return {
                "prompt_tokens_per_s": self.prompt_tokens_timed / self.prompt_seconds if self.prompt_seconds else None,
                "decode_tokens_per_s": self.decode_tokens_timed / self.decode_seconds if self.decode_seconds else None,
            }

    def error(self, code: str) -> None:
        with self._lock:
            self.generation_errors[code] = self.generation_errors.get(code, 0) + 1

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft_s.observe(seconds)

    def token(self, seconds: float) -> None:
        with self._lock:
            self.token_s.observe(seconds)

    def render(self, manager: Any) -> str:
        with self._lock:
            lines = [
                "# HELP gguf_requests_total HTTP responses by method, route and status.",
                "# TYPE gguf_requests_total counter",
            ]
            for (method, route, status), n in sorted(self.requests.items()):
                lines.append(f'gguf_requests_total{{method="{method}",route="{_esc(route)}",status="{status}"}} {n}')
            lines += [
                "# HELP gguf_generation_errors_total Generations that failed, by error code (streamed ones included).",
                "# TYPE gguf_generation_errors_total counter",
            ]
            lines += [f'gguf_generation_errors_total{{code="{_esc(c)}"}} {n}' for c, n in sorted(self.generation_errors.items())]
            lines += [
                "# HELP gguf_prompt_tokens_total Prompt tokens evaluated.",
                "# TYPE gguf_prompt_tokens_total counter",
                f"gguf_prompt_tokens_total {self.tokens_in}",
                "# HELP gguf_completion_tokens_total Tokens generated.",
                "# TYPE gguf_completion_tokens_total counter",
                f"gguf_completion_tokens_total {self.tokens_out}",
                "# HELP gguf_time_to_first_token_seconds From the request's arrival to its first generated token.",
                "# TYPE gguf_time_to_first_token_seconds histogram",
                *self.ttft_s.lines("gguf_time_to_first_token_seconds"),
                "# HELP gguf_token_latency_seconds Time between consecutive generated tokens.",
                "# TYPE gguf_token_latency_seconds histogram",
                *self.token_s.lines("gguf_token_latency_seconds"),
            ]
        runner = manager.runner
        lines += [
            "# HELP gguf_queue_depth Requests waiting for the model.",
            "# TYPE gguf_queue_depth gauge",
            f"gguf_queue_depth {runner.waiting}",
            "# HELP gguf_running Generations running (0 or 1).",
            "# TYPE gguf_running gauge",
            f"gguf_running {runner.running}",
            "# HELP gguf_kv_cells_used KV cache cells holding tokens.",
            "# TYPE gguf_kv_cells_used gauge",
            f"gguf_kv_cells_used {manager.engine.kv_cells_used if manager.ready else 0}",
            "# HELP gguf_n_ctx Context of the loaded model, tokens.",
            "# TYPE gguf_n_ctx gauge",
            f"gguf_n_ctx {manager.engine.n_ctx if manager.ready else 0}",
            "# HELP gguf_device_bytes Memory per device for the loaded model: the plan's prediction and what llama.cpp allocated.",
            "# TYPE gguf_device_bytes gauge",
        ]
        info = manager.describe(manager.current) if manager.ready else None
        for m in (info or {}).get("memory", []):
            dev = _esc(m["device"])
            lines.append(f'gguf_device_bytes{{device="{dev}",kind="allocated"}} {int(m["allocated_mib"] * MIB)}')
            if m.get("predicted_mib") is not None:
                lines.append(f'gguf_device_bytes{{device="{dev}",kind="predicted"}} {int(m["predicted_mib"] * MIB)}')
        lines += [
            "# HELP gguf_tokens_per_second Generation speed: measured over the generations so far, and the plan's prediction.",
            "# TYPE gguf_tokens_per_second gauge",
        ]
        measured = self.measured_speeds()
        predicted = (info or {}).get("plan", {}).get("predicted_speed") or {}
        for phase in ("prompt", "decode"):
            m = measured[f"{phase}_tokens_per_s"]
            if m is not None:
                lines.append(f'gguf_tokens_per_second{{phase="{phase}",kind="measured"}} {m:.3f}')
            p = predicted.get(f"{phase}_tokens_per_s")
            if p is not None:
                lines.append(f'gguf_tokens_per_second{{phase="{phase}",kind="predicted"}} {p:.3f}')
        lines += [
            "# HELP gguf_model_loaded 1 while a model is loaded and serving.",
            "# TYPE gguf_model_loaded gauge",
            f"gguf_model_loaded {1 if manager.ready else 0}",
        ]
        return "\n".join(lines) + "\n"


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


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
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.request(scope.get("method", ""), path, status)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> PlainTextResponse:
    m: Metrics = request.app.state.metrics
    return PlainTextResponse(m.render(request.app.state.manager), media_type="text/plain; version=0.0.4; charset=utf-8")
