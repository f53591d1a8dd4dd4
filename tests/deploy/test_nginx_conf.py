"""deploy/nginx.conf: parsed (no nginx needed) and checked against deploy/compose.replicas.yml.

Routing by model: every model a map names goes to an upstream pool whose
servers are compose replicas serving exactly that model, on the port they
listen on. Routing by health: failed replicas are skipped (proxy_next_upstream
on errors and 503) and left out for a while (max_fails/fail_timeout).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
NGINX_CONF = ROOT / "deploy" / "nginx.conf"
REPLICAS = ROOT / "deploy" / "compose.replicas.yml"


@dataclass
class Directive:
    name: str
    args: list[str]
    block: list[Directive] | None = None

    def children(self, name: str) -> list[Directive]:
        return [d for d in self.block or [] if d.name == name]


@dataclass
class Conf:
    directives: list[Directive] = field(default_factory=list)

    def children(self, name: str) -> list[Directive]:
        return [d for d in self.directives if d.name == name]


_TOKEN = re.compile(r"""\s+|#[^\n]*|"((?:[^"\\]|\\.)*)"|'((?:[^'\\]|\\.)*)'|([{};])|([^\s{};"'#]+)""")


def parse_nginx(text: str) -> Conf:
    """nginx's grammar: directives end in ``;`` or open a ``{ }`` block; ``#`` comments; quoted words."""
    stack: list[list[Directive]] = [[]]
    words: list[str] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        assert m, f"nginx.conf: cannot tokenize at {text[pos:pos + 30]!r}"
        pos = m.end()
        dq, sq, punct, bare = m.groups()
        if dq is not None or sq is not None:
            words.append(dq if dq is not None else sq)
        elif bare is not None:
            words.append(bare)
        elif punct == ";":
            assert words, "empty directive"
            stack[-1].append(Directive(words[0], words[1:]))
            words = []
        elif punct == "{":
            assert words, "block without a name"
            directive = Directive(words[0], words[1:], [])
            stack[-1].append(directive)
            stack.append(directive.block)  # type: ignore[arg-type]
            words = []
        elif punct == "}":
            assert not words, f"missing ';' after {words}"
            assert len(stack) > 1, "unbalanced '}'"
            stack.pop()
    assert not words and len(stack) == 1, "nginx.conf ends inside a directive or block"
    return Conf(stack[0])


def render(text: str, env: dict[str, str]) -> str:
    """What the nginx image's envsubst does: replace ${VAR} for variables set in the environment only."""
    return re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), m.group(0)), text)


@pytest.fixture(scope="module")
def replicas() -> dict[str, Any]:
    with REPLICAS.open(encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    assert isinstance(data, dict)
    return data


def _default_model(service: dict[str, Any], env: dict[str, str]) -> str:
    value = str(service["environment"]["GGUF_DEFAULT_MODEL"])
    m = re.fullmatch(r"\$\{(\w+)(?::?[-?](.*))?\}", value)
    assert m, value
    return env.get(m.group(1)) or (m.group(2) or "")


def test_parser() -> None:
    conf = parse_nginx('upstream u { server a:1 max_fails=1; } # c\nmap $x $y { default "";  "k;" v; }\n')
    (upstream,) = conf.children("upstream")
    assert upstream.args == ["u"] and upstream.children("server")[0].args == ["a:1", "max_fails=1"]
    assert [(d.name, d.args) for d in conf.children("map")[0].block or []] == [("default", [""]), ("k;", ["v"])]
    with pytest.raises(AssertionError):
        parse_nginx("server { listen 80 }")
    with pytest.raises(AssertionError):
        parse_nginx("server { listen 80;")


def test_routes_each_model_to_replicas_serving_it(replicas: dict[str, Any]) -> None:
    env = {"GGUF_MODEL_A": "model-a", "GGUF_MODEL_B": "model-b"}
    nginx_env = {k: re.sub(r"\$\{(\w+)(?::?[-?].*)?\}", lambda m: env[m.group(1)], v) for k, v in replicas["services"]["nginx"]["environment"].items()}
    text = NGINX_CONF.read_text(encoding="utf-8")
    template_vars = set(re.findall(r"\$\{(\w+)\}", text))
    assert template_vars <= set(nginx_env), f"nginx.conf uses {template_vars}: give them to the nginx service"
    conf = parse_nginx(render(text, nginx_env))

    services = replicas["services"]
    upstreams: dict[str, set[str]] = {}
    for upstream in conf.children("upstream"):
        models = set()
        for server in upstream.children("server"):
            host, _, port = server.args[0].partition(":")
            assert host in services and host != "nginx", f"upstream server {host} is not a replica"
            assert port == str(services[host]["environment"]["GGUF_PORT"])
            assert any(a.startswith("max_fails=") for a in server.args) and any(a.startswith("fail_timeout=") for a in server.args)
            models.add(_default_model(services[host], env))
        assert len(models) == 1, f"upstream {upstream.args[0]} mixes models {models}"
        upstreams[upstream.args[0]] = models
    assert len(upstreams) >= 2
    served = set().union(*upstreams.values())
    assert served == {_default_model(s, env) for n, s in services.items() if n != "nginx"}

    maps = conf.children("map")
    assert len(maps) >= 2, "a map from the X-Model header and one from the /m/<model>/ path"
    assert {m.args[0] for m in maps} >= {"$http_x_model"}
    for m in maps:
        entries = {d.name: d.args[0] for d in m.block or []}
        for model, pool in entries.items():
            if model == "default":
                assert pool == "" or pool in upstreams
                continue
            assert "${" not in model, f"{model}: not rendered"
            assert upstreams[pool] == {model}, f"map {m.args[0]}: {model} routed to {pool}, which serves {upstreams[pool]}"
        assert set(served) <= set(entries), f"map {m.args[0]} misses a model"


def test_fails_over_on_errors_and_503() -> None:
    conf = parse_nginx(render(NGINX_CONF.read_text(encoding="utf-8"), {"GGUF_MODEL_A": "a", "GGUF_MODEL_B": "b"}))
    (server,) = conf.children("server")
    settings = {d.name: d.args for d in server.block or [] if d.block is None}
    assert {"error", "timeout", "http_503"} <= set(settings["proxy_next_upstream"])
    assert settings["proxy_buffering"] == ["off"], "streamed completions must not be buffered"
    assert settings["listen"] == ["8080"]
    proxies = [d.args[0] for loc in server.children("location") for d in loc.block or [] if d.name == "proxy_pass"]
    assert proxies and all(p.startswith("http://$pool_by_") for p in proxies)
