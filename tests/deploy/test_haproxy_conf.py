"""deploy/haproxy.cfg against deploy/compose.replicas.yml, and HAProxy's own check of the file.

Routing by model: each pool's servers are compose replicas serving the model that pool is chosen for, on
the port they listen on. Routing by health: every server is health-checked on /ready, and a refused
connection or a 503 is retried on another replica. The live behaviour is test_router_live.py's.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from .test_compose import SAMPLE_ENV, interpolate

ROOT = Path(__file__).resolve().parents[2]
CFG = ROOT / "deploy" / "haproxy.cfg"
REPLICAS = ROOT / "deploy" / "compose.replicas.yml"


@dataclass
class Section:
    kind: str
    name: str
    lines: list[str] = field(default_factory=list)

    def directives(self, keyword: str) -> list[str]:
        return [ln[len(keyword):].strip() for ln in self.lines if ln == keyword or ln.startswith(keyword + " ")]


def parse(text: str) -> list[Section]:
    """HAProxy's layout: a section keyword at the start of a line, its directives indented below; # comments."""
    sections: list[Section] = []
    for raw in text.splitlines():
        line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip():
            continue
        if not raw[0].isspace():
            kind, _, name = line.partition(" ")
            sections.append(Section(kind, name.strip()))
        else:
            assert sections, f"directive outside a section: {raw!r}"
            sections[-1].lines.append(line.strip())
    return sections


def _env_default(token: str) -> tuple[str, str | None]:
    """'"${NAME-default}"' -> (NAME, default)."""
    m = re.fullmatch(r'"\$\{(\w+)(?:-([^}]*))?\}"', token)
    assert m, token
    return m.group(1), m.group(2)


@pytest.fixture(scope="module")
def sections() -> dict[tuple[str, str], Section]:
    return {(s.kind, s.name): s for s in parse(CFG.read_text(encoding="utf-8"))}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    with REPLICAS.open(encoding="utf-8") as fh:
        return interpolate(yaml.safe_load(fh), SAMPLE_ENV)  # type: ignore[no-any-return]


def _router_env(compose: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in compose["services"]["router"]["environment"].items()}


def test_haproxy_accepts_the_file(haproxy_bin: str, compose: dict[str, Any]) -> None:
    env = {"PATH": "/usr/sbin:/usr/bin:/bin", **_router_env(compose)}
    r = subprocess.run([haproxy_bin, "-c", "-f", str(CFG)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    broken = CFG.read_text(encoding="utf-8").replace("balance leastconn", "balance leastconnn", 1)
    r = subprocess.run([haproxy_bin, "-c", "-f", "/dev/stdin"], input=broken, env=env, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode != 0, "the check is live"


def test_image_is_the_tested_version(haproxy_bin: str, compose: dict[str, Any]) -> None:
    image = compose["services"]["router"]["image"]
    tag = image.rpartition(":")[2]
    out = subprocess.run([haproxy_bin, "-v"], capture_output=True, text=True, timeout=30).stdout
    local = re.search(r"version (\d+\.\d+)", out)
    assert local and tag == local.group(1), f"compose runs {image}, the tests run HAProxy {out.splitlines()[0]}"


def _backend_models(sections: dict[tuple[str, str], Section], env: dict[str, str]) -> dict[str, str]:
    """Backend -> the model routed to it (use_backend ... if { var(txn.model) -m str MODEL }; default_backend: A)."""
    (frontend,) = [s for (k, n), s in sections.items() if k == "frontend" and n == "openai"]
    out: dict[str, str] = {}
    for rule in frontend.directives("use_backend"):
        m = re.fullmatch(r'(\w+) if \{ var\(txn\.model\) -m str ("\$\{\w+(?:-[^}]*)?\}") \}', rule)
        assert m, rule
        var, default = _env_default(m.group(2))
        out[m.group(1)] = env.get(var) or default or ""
    (default_backend,) = frontend.directives("default_backend")
    out[default_backend] = env["GGUF_MODEL_A"]  # requests naming no model (or model A) go to model A's pool
    return out


def test_each_pool_holds_the_replicas_of_its_model(sections: dict[tuple[str, str], Section], compose: dict[str, Any]) -> None:
    env = _router_env(compose)
    services = compose["services"]
    models = _backend_models(sections, env)
    assert len(set(models.values())) == len(models) >= 2, models
    placed: set[str] = set()
    for backend, model in models.items():
        section = sections[("backend", backend)]
        servers = section.directives("server")
        assert servers, backend
        for server in servers:
            name, address, *opts = server.split()
            assert "check" in opts, f"{backend}/{name} is not health-checked"
            _, default = _env_default(address)
            assert default, f"{backend}/{name}: no default address"
            host, _, port = default.partition(":")
            assert host in services and host != "router", f"{backend}/{name}: {host} is not a replica"
            replica = services[host]["environment"]
            assert port == str(replica["GGUF_PORT"]), f"{backend}/{name}: port {port}"
            assert replica["GGUF_DEFAULT_MODEL"] == model, f"{backend} routes {model} to {host}, which serves another"
            placed.add(host)
        assert section.directives("option") and "httpchk GET /ready" in section.directives("option")
        assert section.directives("http-check") == ["expect status 200"]
    assert placed == {n for n in services if n != "router"}, "every replica is behind the router"


def test_routes_by_body_and_retries_elsewhere(sections: dict[tuple[str, str], Section]) -> None:
    frontend = sections[("frontend", "openai")]
    assert "http-buffer-request" in frontend.directives("option"), "the body must be read before routing"
    assert any("req.body,json_query('$.model')" in d for d in frontend.directives("http-request"))
    assert any(d.startswith("return status 404") and "model_not_found" in d for d in frontend.directives("http-request"))
    defaults = sections[("defaults", "")]
    retry_on = defaults.directives("retry-on")[0].split()
    assert {"conn-failure", "503"} <= set(retry_on)
    assert int(defaults.directives("retries")[0]) >= 1
    assert defaults.directives("option").count("redispatch 1") == 1, "a retry goes to another replica"
    timeouts = dict(d.split(None, 1) for d in defaults.directives("timeout"))
    assert timeouts["server"].rstrip("s").isdigit() and int(timeouts["server"].rstrip("s")) >= 300, "long generations"
