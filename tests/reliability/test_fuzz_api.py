"""Property-based fuzz of the HTTP API from its own OpenAPI schema (schemathesis), on the real service.

Every operation the service publishes in ``/openapi.json`` gets bodies, queries and paths generated
from its schema (valid and invalid) and sent to ``python -m service`` with the embedded model. The
property: no 5xx other than the documented refusals (503 ``model_not_ready`` while no model is
loaded or a load runs, 507/503 ``insufficient_memory`` for what does not fit), every error in the
OpenAI shape with a string ``code``, no hang (each request has a limit), the same PID answering at
the end, and the process's peak RSS (VmHWM) within ``RSS_BOUND_MIB``.

Nothing leaves the machine: every generated dry-run ``url`` is replaced by a loopback URL (refused:
not a public address), and the Hugging Face endpoint is a closed loopback port. Generation stays
short (max_tokens capped at 8; the server's own default for chat is 8 here). Examples per operation:
``GGUF_FUZZ_EXAMPLES`` (default 40 in ``make test``; ``make soak`` runs 300). Half the generated bodies
that name a model name the loaded one, so loads, dry runs and generations run with the generated options
instead of stopping at 404.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any, Callable

import httpx
import pytest

from service.api.errors import OLLAMA_PATHS
from tests.conftest import EMBEDDED_NAME, ServiceProcess

from .conftest import SOAK, rss_kib
from tests.figures import figure

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("GGUF_FUZZ_EXAMPLES", "300" if SOAK else "40"))
RSS_BOUND_MIB = 1536
"""Peak resident memory of the fuzzed server: the embedded model (about 450 MiB loaded), reloaded with
generated options under a 4096-token context ceiling, plus the HTTP layer."""
DOCUMENTED_5XX = {(503, "model_not_ready"), (503, "insufficient_memory"), (507, "INSUFFICIENT_MEMORY"),
                  (503, "overloaded_error")}
"""The last: Anthropic's name for a 503 on /v1/messages (its errors carry a type, not a code)."""
HUB_ROUTES = {"POST /api/hf/files", "POST /api/pull"}
"""Routes that ask the Hugging Face hub: here a closed loopback port, so 502 ``upstream_error`` is their true answer."""
OLLAMA_CODES = {502: "upstream_error", 503: "model_not_ready", 507: "INSUFFICIENT_MEMORY"}
"""Ollama's errors carry only a message: on its routes the status alone is the documented answer."""
ENV = {
    "GGUF_CONFIRM_LOADS": "false", "GGUF_CONTEXT_LENGTH": "4096", "GGUF_MAX_TOKENS_DEFAULT": "8",
    "GGUF_LOAD_WAIT_S": "5", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1",
    "GGUF_REMOTE_TIMEOUT_S": "2", "GGUF_EMBEDDING_TOKENS": "128",
}


def _peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def _tame(case: Any) -> None:
    """Keep a generated case on this machine and short: loopback URLs only, few tokens."""
    body = case.body
    if isinstance(body, dict):
        if "model" in body and len(repr(body)) % 2 == 0:
            body["model"] = EMBEDDED_NAME
        if "url" in body:
            body["url"] = "http://127.0.0.1:9/fuzz.gguf"
        for key in ("max_tokens", "max_completion_tokens", "n_predict"):  # n_predict: /infill (llama-server's name)
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > 8:
                body[key] = 8
        options = body.get("options")  # Ollama's routes
        if isinstance(options, dict) and isinstance(options.get("num_predict"), int) and options["num_predict"] > 8:
            options["num_predict"] = 8


@pytest.fixture(scope="module")
def fuzzed(service_factory: Callable[..., ServiceProcess]) -> ServiceProcess:
    svc = service_factory(**ENV)
    svc.wait_ready()
    return svc


@pytest.mark.timeout(900 if SOAK else 300)
def test_fuzz_every_operation_from_the_openapi_schema(fuzzed: ServiceProcess) -> None:
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    svc = fuzzed
    pid = svc.proc.pid
    raw = svc.client.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(raw)
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 10
    statuses: collections.Counter[tuple[str, int]] = collections.Counter()
    slowest = [0.0, ""]
    failures: list[str] = []
    t_start = time.monotonic()
    for op in operations:
        label = f"{op.method.upper()} {op.path}"

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not SOAK,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def check(case: Any) -> None:
            _tame(case)
            t0 = time.monotonic()
            r = case.call(base_url=svc.url, timeout=60)
            took = time.monotonic() - t0
            if took > slowest[0]:
                slowest[0], slowest[1] = took, label
            statuses[(label, r.status_code)] += 1
            ctype = str(r.headers.get("content-type", ""))  # schemathesis keeps each header as a list
            code = None
            if r.status_code >= 400 and "json" in ctype:
                body = r.json()
                err = body.get("error")
                if op.path.startswith("/v1/messages"):  # Anthropic's shape: {"type": "error", "error": {"type", "message"}}
                    assert body.get("type") == "error" and isinstance(err, dict) and isinstance(err.get("type"), str) \
                        and isinstance(err.get("message"), str), (label, r.text[:300])
                    code = err["type"]
                elif op.path in OLLAMA_PATHS:  # Ollama's shape, {"error": "..."}: no code, the status says it
                    assert isinstance(err, str) and err, (label, r.text[:300])
                    code = OLLAMA_CODES.get(r.status_code)
                else:
                    assert isinstance(err, dict) and isinstance(err.get("code"), str), (label, r.text[:300])
                    code = err["code"]
            asks_hub = label in HUB_ROUTES or (label == "POST /api/dry-run" and isinstance(case.body, dict)
                                               and bool(case.body.get("repo_id")) and not case.body.get("url"))
            hub_down = asks_hub and (r.status_code, code) == (502, "upstream_error")
            if r.status_code >= 500 and (r.status_code, code) not in DOCUMENTED_5XX and not hub_down:
                failures.append(f"{label} -> {r.status_code} {r.text[:300]} for {case.body!r:.300}")
            assert svc.proc.poll() is None, f"the server died on {label} with {case.body!r:.300}"

        check()
    elapsed = time.monotonic() - t_start
    assert not failures, failures[:5]
    # The same process serves: the embedded model loads (a fuzzed unload or load may have changed it) and answers.
    r = svc.client.post("/api/models/load", json={"model": EMBEDDED_NAME}, timeout=120)
    assert r.status_code == 200, r.text
    r = svc.client.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3})
    assert r.status_code == 200 and svc.proc.pid == pid
    peak = _peak_rss_kib(pid) // 1024
    now = rss_kib(pid) // 1024
    assert peak <= RSS_BOUND_MIB, f"peak RSS {peak} MiB"
    by_status: collections.Counter[int] = collections.Counter()
    for (_, st), n in statuses.items():
        by_status[st] += n
    figure(f"API fuzz: {sum(by_status.values())} requests over {len(operations)} operations in "
           f"{elapsed:.0f} s; statuses {dict(sorted(by_status.items()))}; slowest {slowest[0]:.2f} s ({slowest[1]}); "
           f"peak RSS {peak} MiB (bound {RSS_BOUND_MIB}), now {now} MiB; same PID {pid}")


@pytest.mark.timeout(120)
def test_unknown_methods_and_paths_answer_in_the_error_shape(fuzzed: ServiceProcess) -> None:
    """Made-up methods and paths: 404/405 with string codes (their metrics series are bounded in service/api/metrics.py)."""
    for method in ("BREW", "PROPFIND", "X" * 40, "get"):
        for path in ("/v1/completions", "/nope", "/" + "a" * 300):
            r = httpx.request(method, svc_url(fuzzed) + path, timeout=10)
            assert r.status_code in (404, 405, 400), (method, path, r.status_code)
            assert isinstance(r.json()["error"]["code"], str)
    assert fuzzed.client.get("/health").status_code == 200


def svc_url(svc: ServiceProcess) -> str:
    return svc.url
