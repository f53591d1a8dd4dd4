"""Chat templates from GGUF metadata: sandboxed, bounded in time and size; hostile ones fail with 400 and a log line."""

from __future__ import annotations

import logging
import time

import pytest

from service.chat.sandbox import MAX_RENDERED_CHARS, ChatTemplate
from service.errors import BadRequest
from service.api.errors import http_of
from tests.figures import figure

MESSAGES = [{"role": "user", "content": "hello"}]

HOSTILE = {
    "python internals": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals via a function": "{{ raise_exception.__globals__ }}",
    "mutation": "{% set x = [] %}{{ x.append(1) }}",
    "string repetition": "{{ 'x' * 1000000000 }}",
    "list repetition": "{{ [1, 2] * 900000000 }}",
    "power": "{{ 2 ** 100000000 }}",
    "power chain": "{{ ((10 ** 200) ** 200) ** 200 }}",
    "squaring": "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
    "center filter": "{{ 'x' | center(1000000000) }}",
    "ljust method": "{{ 'x'.ljust(1000000000) }}",
    "percent width": "{{ '%01000000000d' % 1 }}",
    "doubling by concat": "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "doubling by plus": "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "explicit doubling": "{% set a = 'x' * 1000000 %}" + "".join(
        f"{{% set a{i + 1} = a{i} ~ a{i} %}}" for i in range(12)).replace("a0", "a") + "{{ a12|length }}",
    "recursive macro": "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('xxxxxxxxxxxxxxxx') }}",
    "output flood": "{% for i in range(100000) %}{% for j in range(100) %}xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx{% endfor %}{% endfor %}",
    "busy loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "busy loops with a namespace": "{% set ns = namespace(n=0) %}{% for i in range(100000) %}{% for j in range(100000) %}"
                                   "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}{{ ns.n }}",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_fails_the_request_with_400_and_a_log_line(name: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="service")
    tpl = ChatTemplate(HOSTILE[name], "<bos>", "<eos>", timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(BadRequest) as info:
        tpl.render(MESSAGES)
    elapsed = time.monotonic() - t0
    assert http_of(info.value, "/v1/chat/completions").status == 400 and info.value.param == "messages"
    # Generous (the limit is 0.5 s; the machine's load varies): unbounded, these templates run for hours.
    assert elapsed < 15.0, f"{name}: {elapsed:.2f} s"
    unsafe = any(w in info.value.message for w in ("unsafe", "did not finish", "too large", "memory"))
    assert unsafe, info.value.message
    assert caplog.records or "too large" in info.value.message, "refusals are logged"
    # The thread's trace hook is gone afterwards.
    import sys

    assert sys.gettrace() is None or "coverage" in repr(sys.gettrace())


def test_time_limit_figure() -> None:
    tpl = ChatTemplate(HOSTILE["busy loops"], "", "", timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(BadRequest, match="did not finish within 1 s"):
        tpl.render(MESSAGES)
    elapsed = time.monotonic() - t0
    # At least the limit; the upper bound is generous (a loaded machine), the 1e10-iteration loop runs for hours.
    assert 1.0 <= elapsed < 15.0
    figure(f"chat-template: nested 1e10-iteration loop stopped after {elapsed:.2f} s (limit 1 s)")


# The shape of the Gemma 3 template on Hugging Face (loop, namespace-free conditionals, filters, raise_exception).
GEMMA_LIKE = """{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = "" -%}{%- set loop_messages = messages -%}{%- endif -%}
{%- for message in loop_messages -%}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}{%- endif -%}
{%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}
{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"""


def test_a_real_shaped_template_renders_unchanged() -> None:
    tpl = ChatTemplate(GEMMA_LIKE, "<bos>", "<eos>")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count to 3"}]
    t0 = time.perf_counter()
    text, add_bos = tpl.render(msgs)
    elapsed = time.perf_counter() - t0
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nCount to 3<end_of_turn>\n<start_of_turn>model\n")
    assert add_bos is False
    # Speed is not asserted here (it would measure the machine's load): the render ran within the template's
    # time limit, or it would have raised; the figure is printed.
    figure(f"gemma-like template render: {elapsed * 1000:.2f} ms")
    with pytest.raises(BadRequest, match="must alternate"):
        tpl.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_large_but_legal_output_renders() -> None:
    tpl = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", "", "")
    text, _ = tpl.render([{"role": "user", "content": "y" * (MAX_RENDERED_CHARS // 2)}])
    assert len(text) == MAX_RENDERED_CHARS // 2
