"""Issue 29's smaller items about what operators and URLs bring in: a deeply nested models file and a chat template
that does not compile stop the service at start with one line (exit 2), a URL's credentials never reach an answer,
and IPv6 transition addresses are judged as the IPv4 addresses they reach."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.chat.sandbox import check_template
from sizing.errors import ProbeError, without_credentials
from sizing.probe.remote import ProbeLimits, embedded_ipv4, probe_url
from tests.conftest import ROOT


def _run_service(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_")}
    full.update({"GGUF_DEFAULT_MODEL": "", "GGUF_PORT": "0", **env})
    return subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("suffix,text", [
    (".yaml", "models: " + "[" * 20_000 + "]" * 20_000 + "\n"),
    (".toml", "a = " + "[" * 20_000 + "]" * 20_000 + "\n"),
    (".yaml", "models:\n  m:\n    aliases: " + "{a: " * 5_000 + "1" + "}" * 5_000 + "\n"),
])
def test_a_deeply_nested_models_file_stops_the_service_with_one_line(tmp_path: Path, suffix: str, text: str) -> None:
    f = tmp_path / f"models{suffix}"
    f.write_text(text)
    p = _run_service({"GGUF_MODELS_FILE": str(f)})
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "models file" in lines[0] and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_a_chat_template_that_does_not_compile_stops_the_service_with_one_line(tmp_path: Path) -> None:
    f = tmp_path / "template.jinja"
    f.write_text("{% for m in messages %}{{ m.content }}\n{% endfor")  # the closing tag is cut
    p = _run_service({"GGUF_CHAT_TEMPLATE_FILE": str(f)})
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "GGUF_CHAT_TEMPLATE_FILE" in lines[0] and "line" in lines[0], p.stderr
    check_template("{% for m in messages %}{{ m.content }}{% endfor %}")  # a good one passes
    check_template(None)
    with pytest.raises(ValueError, match="line 2"):
        check_template("ok\n{{ x ")


def test_a_urls_credentials_never_reach_an_error() -> None:
    assert without_credentials("see https://bob:hunter2@example.com/x.gguf and http://t@h/") == \
        "see https://***@example.com/x.gguf and http://***@h/"
    assert str(ProbeError("refused", source="https://bob:hunter2@10.0.0.1/m.gguf")).count("hunter2") == 0
    with pytest.raises(ProbeError) as e:
        probe_url("http://bob:hunter2@10.0.0.1/m.gguf", limits=ProbeLimits(public_only=True))
    assert "hunter2" not in str(e.value) and "bob" not in str(e.value)


def test_the_dry_run_by_url_does_not_echo_a_password(fake) -> None:  # type: ignore[no-untyped-def]
    for url in ("http://bob:hunter2@127.0.0.1:9/m.gguf", "http://bob:hunter2@[v1.x]/m.gguf",
                "https://bob:hunter2@xn--a.com/m.gguf"):
        r = fake.client.post("/api/dry-run", json={"url": url})
        assert 400 <= r.status_code < 500, r.text
        assert "hunter2" not in r.text and "bob:" not in r.text, r.text


@pytest.mark.parametrize("v6,v4", [
    ("64:ff9b::7f00:1", "127.0.0.1"),          # NAT64 (RFC 6052)
    ("64:ff9b:1::a00:1", "10.0.0.1"),          # local-use NAT64 (RFC 8215)
    ("2002:a9fe:a9fe::1", "169.254.169.254"),  # 6to4: the cloud metadata address
    ("::ffff:192.168.1.1", "192.168.1.1"),     # IPv4-mapped
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "192.0.2.45"),  # Teredo's client (RFC 4380's example)
])
def test_ipv6_transition_addresses_are_the_ipv4_addresses_they_reach(v6: str, v4: str) -> None:
    assert embedded_ipv4(ipaddress.ip_address(v6)) == ipaddress.ip_address(v4)


def test_transition_addresses_of_private_hosts_are_refused_and_of_public_ones_allowed() -> None:
    strict = ProbeLimits(public_only=True)
    for private in ("64:ff9b::7f00:1", "2002:7f00:1::", "64:ff9b::a9fe:a9fe", "2002:c0a8:101::1"):
        assert not strict.address_allowed(private), private
    assert strict.address_allowed("64:ff9b::808:808")  # 8.8.8.8
    assert strict.address_allowed("2606:4700:4700::1111")  # a plain global IPv6 address
