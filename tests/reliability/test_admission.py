"""Oversized prompts never hold admission (``service.api.admission``): a text no tokenization can fit is refused
unread, at once; long ones are tokenized off the engine's queue, a few at a time, so short requests never wait for
them. Against the real server on the embedded model (a 2,048-token context: a text beyond 2,048 x 48 characters,
48 bytes being its longest token, cannot fit)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.api.admission import LARGE_TEXT_CHARS, client_chars, refuse_unfit
from service.errors import ContextLengthExceeded
from tests.conftest import ServiceProcess

pytestmark = pytest.mark.slow

HUGE = "lighthouse keeper " * 200_000  # 3.6 MB: ~400k tokens, far beyond 2,048 x 48 characters


def test_the_character_bound_is_a_lower_bound_on_tokens() -> None:
    refuse_unfit(2048 * 48, 2048, 48, "prompt")  # could still fit: every token 48 characters
    with pytest.raises(ContextLengthExceeded) as e:
        refuse_unfit(2048 * 48 + 1, 2048, 48, "prompt")
    assert e.value.param == "prompt"
    refuse_unfit(10**9, 2048, 0, "prompt")  # unknown bound: never refused unread
    msgs = [{"role": "system", "content": "ab"}, {"role": "assistant", "content": "x" * 99},
            {"role": "user", "content": [{"type": "text", "text": "cde"}]}]
    assert client_chars(msgs) == 5, "a past answer may lose its thinking in the template: not counted"


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory, embedded_model: str) -> Any:
    d = tmp_path_factory.mktemp("admission")
    with ServiceProcess({"GGUF_MODELS_DIR": str(d), "GGUF_CONTEXT_LENGTH": "2048", "GGUF_CONFIRM_LOADS": "false"},
                        d / "service.log").running() as s:
        yield s


def _small(url: str) -> float:
    t0 = time.perf_counter()
    with httpx.Client(timeout=120) as c:
        r = c.post(url + "/v1/completions", json={"prompt": "The sea is", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def test_a_prompt_that_cannot_fit_is_refused_unread(svc: ServiceProcess) -> None:
    pid = svc.proc.pid
    for route, body, param in (("/v1/completions", {"prompt": HUGE, "max_tokens": 2}, "prompt"),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}]}, "messages"),
                               ("/v1/messages/count_tokens", {"model": "gemma-3-270m-q4_k_m", "messages": [
                                   {"role": "user", "content": HUGE}]}, None)):
        t0 = time.perf_counter()
        r = svc.client.post(route, json=body)
        took = time.perf_counter() - t0
        assert r.status_code == 400, r.text
        if param is not None:
            assert r.json()["error"]["code"] == "context_length_exceeded" and r.json()["error"]["param"] == param
        # Tokenizing 3.6 MB takes seconds; refused unread it takes the body's parse (generous for a busy host).
        assert took < 3.0, (route, took)
    assert _small(svc.url) < 10 and svc.proc.pid == pid


def test_eight_oversized_prompts_do_not_hold_a_short_completion(svc: ServiceProcess) -> None:
    alone = min(_small(svc.url) for _ in range(3))
    codes: list[int] = []

    def hostile() -> None:
        with httpx.Client(timeout=120) as c:
            codes.append(c.post(svc.url + "/v1/completions", json={"prompt": HUGE, "max_tokens": 2}).status_code)

    threads = [threading.Thread(target=hostile) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    during = _small(svc.url)
    for t in threads:
        t.join(120)
    assert codes == [400] * 8
    # Before: 32.8 s behind 8 such prompts tokenized on the engine's queue. A generous bound for 2 busy cores.
    assert during < 5.0, (alone, during)


def test_long_prompts_that_fit_are_tokenized_beside_short_requests(svc: ServiceProcess) -> None:
    """Texts above LARGE_TEXT_CHARS that may fit are tokenized in their own lane, a few at a time: a short
    completion sent meanwhile is answered without waiting for all of them."""
    long = "the sea " * (LARGE_TEXT_CHARS // 8 + 10)  # 64 KiB of text, about 16k tokens: past the context after
    codes: list[int] = []

    def longer() -> None:
        with httpx.Client(timeout=120) as c:
            codes.append(c.post(svc.url + "/v1/completions", json={"prompt": long, "max_tokens": 2}).status_code)

    threads = [threading.Thread(target=longer) for _ in range(6)]
    for t in threads:
        t.start()
    during = _small(svc.url)
    for t in threads:
        t.join(120)
    assert codes == [400] * 6  # tokenized (64 KiB may fit 2,048 x 48), then too long for the context
    assert during < 10.0


def test_nothing_is_left_of_the_pool_after_the_server_stops(tmp_path: Path, embedded_model: str) -> None:
    s = ServiceProcess({"GGUF_MODELS_DIR": str(tmp_path), "GGUF_CONTEXT_LENGTH": "2048",
                        "GGUF_CONFIRM_LOADS": "false"}, tmp_path / "service.log")
    try:
        s.wait_healthy()
        s.wait_ready()
        assert _small(s.url) < 30
    finally:
        s.stop()
    assert s.proc.returncode == 0, s.log()
