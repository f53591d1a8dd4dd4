"""Images through the real service (issue 27): the embedded model with a small projector of its width (random
weights), named by ``GGUF_MMPROJ``, over real HTTP with the official ``openai`` and ``anthropic`` clients.

What can break: the projector in the plan, ``/api/models`` and its allocation beside the prediction; an image's
tokens counted in the usage; every refusal a 4xx naming the field (an over-sized, malformed or undecodable image,
a URL of a host not allowed, too many images, an image where none may be) and the service answering the next
request after each."""

from __future__ import annotations

import base64
import http.server
import io
import threading
from typing import Any, Iterator

import httpx
import pytest
from PIL import Image

from service.settings import Settings
from sizing.testing.projector_fixtures import TINY, write_projector
from tests.conftest import EMBEDDED_NAME, free_port, in_process_service

pytestmark = pytest.mark.slow

MAX_PIXELS = 640 * 480


def _png(w: int = 64, h: int = 48, color: tuple[int, int, int] = (200, 30, 90)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, "PNG")
    return buf.getvalue()


def _data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    models = tmp_path_factory.mktemp("vision-models")
    projector = write_projector(models / "mmproj-gemma3-270m-tiny.gguf", TINY, values="random")
    settings = Settings(host="127.0.0.1", port=free_port(), models_dir=str(models), context_length=2048, parallel=2,
                        confirm=False, mmproj=str(projector), image_max_pixels=MAX_PIXELS, images_per_request=2)
    with in_process_service(settings) as s:
        yield s


def _chat(url: str, content: Any, role: str = "user") -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": EMBEDDED_NAME, "max_tokens": 4, "temperature": 0, "messages": [{"role": role, "content": content}]})


def test_the_plan_and_api_models_show_the_projector_as_allocated(served: tuple[str, Any]) -> None:
    url, _ = served
    m = {x["name"]: x for x in httpx.get(url + "/api/models", timeout=60).json()["models"]}[EMBEDDED_NAME]
    pj = m["plan"]["projector"]
    assert pj["projector_type"] == "gemma3" and pj["device"] == "CPU" and pj["tokens_per_image"] == 16
    assert pj["compute_source"] == "measured"  # mtmd's warmup, measured when the plan was made
    host = [d for d in m["plan"]["estimate"]["devices"] if d["device"] == "CPU"][0]
    assert host["projector_mib"] == pj["total_mib"] > pj["weights_mib"] > 0
    rows = m["projector"]["memory"]
    assert len(rows) == 1 and rows[0]["device"] == "CPU"
    assert abs(rows[0]["allocated_mib"] - rows[0]["predicted_mib"]) <= 0.01, rows
    # The model's own rows are still exact: the projector's bytes are not counted in them.
    for r in m["memory"]:
        assert r["predicted_mib"] is not None and abs(r["allocated_mib"] - r["predicted_mib"]) <= 0.01, r


def test_a_chat_with_an_image_through_the_openai_client(served: tuple[str, Any]) -> None:
    import openai

    url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    text = [{"type": "text", "text": "What colour is this?"}]
    with_image = client.chat.completions.create(
        model=EMBEDDED_NAME, max_tokens=8, temperature=0,
        messages=[{"role": "user", "content": [*text, {"type": "image_url", "image_url": {"url": _data_url(_png())}}]}])
    without = client.chat.completions.create(model=EMBEDDED_NAME, max_tokens=8, temperature=0,
                                             messages=[{"role": "user", "content": text}])
    assert with_image.choices[0].finish_reason in ("stop", "length")
    # 16 image tokens and the two that wrap them (<start_of_image>, <end_of_image>).
    assert with_image.usage.prompt_tokens == without.usage.prompt_tokens + 18  # type: ignore[union-attr]
    streamed = client.chat.completions.create(
        model=EMBEDDED_NAME, max_tokens=8, temperature=0, stream=True,
        messages=[{"role": "user", "content": [*text, {"type": "image_url", "image_url": {"url": _data_url(_png())}}]}])
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == with_image.choices[0].message.content


def test_a_chat_with_an_image_through_the_anthropic_client(served: tuple[str, Any]) -> None:
    import anthropic

    url, _ = served
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    jpeg = io.BytesIO()
    Image.new("RGB", (80, 60), (10, 120, 250)).save(jpeg, "JPEG")
    content: Any = [{"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                                 "data": base64.b64encode(jpeg.getvalue()).decode()}},
                    {"type": "text", "text": "Describe it."}]
    msg = client.messages.create(model=EMBEDDED_NAME, max_tokens=8, messages=[{"role": "user", "content": content}])
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.usage.input_tokens > 18
    counted = client.messages.count_tokens(model=EMBEDDED_NAME, messages=[{"role": "user", "content": content}])
    assert counted.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    bad: Any = [{"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "AAAA"}}]
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=EMBEDDED_NAME, max_tokens=8, messages=[{"role": "user", "content": bad}])
    assert "media_type" in str(info.value)


class _Counting(http.server.BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        type(self).hits += 1
        body = _png()
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def image_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/cat.png"
    finally:
        server.shutdown()
        server.server_close()


def test_bad_images_are_4xx_naming_the_field_and_the_service_answers_on(served: tuple[str, Any],
                                                                         image_server: str) -> None:
    url, _ = served
    ok = [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": _data_url(_png())}}]

    def image(u: str) -> list[dict[str, Any]]:
        return [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": u}}]

    cases: list[tuple[Any, str, int, str]] = [
        (image(_data_url(_png(700, 500))), "user", 400, "pixels"),                      # over the pixel limit
        (image(_data_url(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)), "user", 400, "not an image"),  # truncated
        (image(_data_url(b"hello, not an image at all")), "user", 400, "not an image"),
        (image("data:image/png;base64,@@@notbase64@@@"), "user", 400, "base64"),
        (image("data:text/plain;base64,aGVsbG8="), "user", 400, "image"),
        (image(image_server), "user", 400, "GGUF_IMAGE_URL_HOSTS"),                     # no host allowed
        (image("http://[v1.x]/a.png"), "user", 400, "image_url"),
        (ok + ok[1:] + ok[1:], "user", 400, "more than 2 images"),
        (ok, "assistant", 400, "type"),                                                  # images are the user's
    ]
    for content, role, status, words in cases:
        r = _chat(url, content, role)
        assert r.status_code == status, (words, r.text)
        err = r.json()["error"]
        assert words in err["message"] and str(err.get("param", "")).startswith("messages[0].content"), err
        assert _chat(url, ok).status_code == 200  # the next request is served
    assert _Counting.hits == 0  # the disallowed host was never asked


def test_an_image_to_a_model_without_a_projector_is_a_400(tmp_path_factory: pytest.TempPathFactory,
                                                          image_server: str) -> None:
    models = tmp_path_factory.mktemp("no-vision")
    settings = Settings(host="127.0.0.1", port=free_port(), models_dir=str(models), context_length=1024, parallel=1,
                        confirm=False, image_url_hosts="127.0.0.1")
    with in_process_service(settings) as (url, _):
        m = {x["name"]: x for x in httpx.get(url + "/api/models", timeout=60).json()["models"]}[EMBEDDED_NAME]
        assert m["plan"]["projector"] is None and "projector" not in m
        r = _chat(url, [{"type": "image_url", "image_url": {"url": _data_url(_png())}}, {"type": "text", "text": "x"}])
        assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "messages[0].content[0]"
        # A URL of a host it may fetch from is refused the same, before any request to the host (issue 54).
        hits = _Counting.hits
        r = _chat(url, [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": image_server}}])
        assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "messages[0].content[1]" and _Counting.hits == hits


def test_images_through_ollamas_api_and_the_responses_api(served: tuple[str, Any]) -> None:
    import ollama
    import openai

    url, _ = served
    client = ollama.Client(host=url, timeout=120)
    caps = client.show(EMBEDDED_NAME).capabilities or []
    assert "vision" in caps
    png = _png(32, 32, (0, 255, 0))
    r = client.chat(model=EMBEDDED_NAME, messages=[{"role": "user", "content": "Colour?", "images": [png]}],
                    options={"num_predict": 4, "temperature": 0})
    plain = client.chat(model=EMBEDDED_NAME, messages=[{"role": "user", "content": "Colour?"}],
                        options={"num_predict": 4, "temperature": 0})
    assert r.prompt_eval_count is not None and plain.prompt_eval_count is not None
    g = client.generate(model=EMBEDDED_NAME, prompt="Colour?", images=[png], options={"num_predict": 4})
    assert g.done
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=EMBEDDED_NAME, messages=[{"role": "user", "content": "x", "images": [b"not an image"]}])
    assert info.value.status_code == 400 and "not an image" in str(info.value)
    oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    resp = oa.responses.create(model=EMBEDDED_NAME, max_output_tokens=8, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Colour?"}, {"type": "input_image", "image_url": _data_url(png), "detail": "auto"}]}])
    text_only = oa.responses.create(model=EMBEDDED_NAME, max_output_tokens=8, input="Colour?")
    assert resp.usage is not None and text_only.usage is not None
    assert resp.usage.input_tokens >= text_only.usage.input_tokens + 16


def test_an_images_tokens_count_against_the_context_before_admission(served: tuple[str, Any]) -> None:
    url, _ = served
    n_ctx = {x["name"]: x for x in httpx.get(url + "/api/models", timeout=60).json()["models"]}[EMBEDDED_NAME]["n_ctx"]
    text = [{"type": "text", "text": "Describe the picture."}]
    image = [{"type": "image_url", "image_url": {"url": _data_url(_png())}}]

    def ask(content: list[dict[str, Any]], max_tokens: int) -> httpx.Response:
        return httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": EMBEDDED_NAME, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": content}]})

    plain = ask(text, 1).json()["usage"]["prompt_tokens"]
    room = n_ctx - plain - 10  # fits without the image; its 18 tokens do not
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "model": EMBEDDED_NAME, "max_tokens": room, "stream": True,
            "messages": [{"role": "user", "content": text}]}) as admitted:
        assert admitted.status_code == 200  # admitted (the stream is left at once: cancelled)
    r = ask([*text, *image], room)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
