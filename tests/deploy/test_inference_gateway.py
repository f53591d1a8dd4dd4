"""deploy/k8s/inference-gateway/: the Gateway API Inference Extension's resources for this server.

The InferencePool and InferenceObjective are validated against the CRD schemas of the pinned release
(``gaie-v1.0.0-schema.json``, converted by ``vendor_schemas.py --gaie`` from the v1.0.0 CRDs), the
picker's Deployment, Service, ConfigMap and RBAC against the strict Kubernetes schemas
(``k8s-schema.json``). The HTTPRoute (Gateway API, another project) has no vendored schema here: its
references are checked instead. Then the pieces are checked against each other and against the
server's manifests, and (slow) the picker's metric flags against a real server's ``/metrics``, scraped
the way the picker scrapes it: no key, the path of its flag.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, Callable

import httpx
import jsonschema
import pytest
import yaml

from tests.prom import families, samples

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
GATEWAY = ROOT / "deploy" / "k8s" / "inference-gateway"
K8S = ROOT / "deploy" / "k8s"
GAIE = json.loads((HERE / "gaie-v1.0.0-schema.json").read_text(encoding="utf-8"))
CORE = json.loads((HERE / "k8s-schema.json").read_text(encoding="utf-8"))
POOL_GROUP = "inference.networking.k8s.io"


def _docs(folder: Path) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(folder.glob("*.yaml")):
        with path.open(encoding="utf-8") as fh:
            out += [(path.name, d) for d in yaml.safe_load_all(fh) if d is not None]
    return out


DOCS = _docs(GATEWAY)


def _one(kind: str, docs: list[tuple[str, dict[str, Any]]] = DOCS, **labels: str) -> dict[str, Any]:
    """The one ``kind`` whose labels include ``app.kubernetes.io/<key>: value`` for each of ``labels``."""
    wanted = {f"app.kubernetes.io/{k}": v for k, v in labels.items()}
    found = [d for _, d in docs if d["kind"] == kind
             and wanted.items() <= (d["metadata"].get("labels") or {}).items()]
    assert len(found) == 1, f"{kind} {labels}: {len(found)} found"
    return found[0]


def _validator(doc: dict[str, Any]) -> jsonschema.protocols.Validator | None:
    group_version = doc["apiVersion"]
    key = f"{group_version}/{doc['kind']}"
    if key in GAIE["kinds"]:
        return jsonschema.Draft202012Validator(GAIE["kinds"][key])
    if "/" not in group_version or group_version.split("/")[0] in ("apps", "rbac.authorization.k8s.io"):
        assert doc["kind"] in CORE["kinds"], f"no vendored schema for {doc['kind']}"
        return jsonschema.Draft202012Validator({**CORE["kinds"][doc["kind"]], "$defs": CORE["$defs"]})
    return None


def _errors(doc: dict[str, Any]) -> list[str]:
    validator = _validator(doc)
    assert validator is not None, doc["kind"]
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.mark.parametrize("name,doc", DOCS, ids=[f"{n}:{d['kind']}" for n, d in DOCS])
def test_manifest_is_valid(name: str, doc: dict[str, Any]) -> None:
    if doc["kind"] == "HTTPRoute":
        assert doc["apiVersion"] == "gateway.networking.k8s.io/v1"
        return  # no vendored Gateway API schema: test_references_between_the_pieces checks it
    assert _errors(doc) == []


def test_the_vendored_schemas_are_the_pinned_release_and_strict() -> None:
    assert GAIE["version"] == "v1.0.0"
    assert set(GAIE["kinds"]) == {"inference.networking.k8s.io/v1/InferencePool",
                                  "inference.networking.x-k8s.io/v1alpha2/InferenceObjective"}
    pool = _one("InferencePool")
    for mutate in (
        lambda p: p["spec"].update(targetPortNumber=8000),                       # v1alpha2's field, gone in v1
        lambda p: p["spec"]["endpointPickerRef"].pop("port"),                     # kind Service needs a port
        lambda p: p["spec"].update(targetPorts=[{"number": 8000}, {"number": 8001}]),  # one port at most
        lambda p: p["spec"]["endpointPickerRef"].update(failureMode="FailSometimes"),
        lambda p: p["spec"]["selector"]["matchLabels"].update({"bad": "-x-"}),
    ):
        bad = copy.deepcopy(pool)
        mutate(bad)
        assert _errors(bad), "the schema must reject it"
    # The CEL rule, translated: a port is required when kind is Service or absent, not otherwise.
    ref = copy.deepcopy(pool)
    ref["spec"]["endpointPickerRef"] = {"name": "x"}
    assert _errors(ref)
    ref["spec"]["endpointPickerRef"] = {"name": "x", "kind": "EndpointPicker", "group": "example.com"}
    assert _errors(ref) == []
    objective = copy.deepcopy(_one("InferenceObjective"))
    objective["spec"]["criticality"] = "Critical"  # InferenceModel's field, not the objective's
    assert _errors(objective)


def _epp_args() -> dict[str, str]:
    (container,) = _one("Deployment", component="endpoint-picker")["spec"]["template"]["spec"]["containers"]
    args: dict[str, str] = {}
    argv = list(container["args"])
    while argv:
        arg = argv.pop(0)
        assert arg.startswith("--"), arg
        name, eq, val = arg[2:].partition("=")
        args[name] = val if eq else argv.pop(0)
    return args


def _server() -> dict[str, Any]:
    return _one("Deployment", _docs(K8S))


def test_references_between_the_pieces() -> None:
    pool = _one("InferencePool")
    server = _server()
    pod = server["spec"]["template"]
    (server_container,) = pod["spec"]["containers"]
    # The pool selects the server's pods, not the picker's, on the port the server listens on.
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    epp = _one("Deployment", component="endpoint-picker")
    assert not pool["spec"]["selector"]["matchLabels"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    (port,) = pool["spec"]["targetPorts"]
    assert port["number"] in {p["containerPort"] for p in server_container["ports"]}
    assert server_container["readinessProbe"]["httpGet"]["path"] == "/ready", "a pod joins the pool when its model is loaded"
    # The pool's picker is this Service, which reaches the picker's gRPC port.
    ref = pool["spec"]["endpointPickerRef"]
    service = _one("Service", component="endpoint-picker")
    assert (ref.get("kind", "Service"), ref["name"]) == ("Service", service["metadata"]["name"])
    (svc_port,) = service["spec"]["ports"]
    assert ref["port"]["number"] == svc_port["port"]
    assert service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    (epp_container,) = epp["spec"]["template"]["spec"]["containers"]
    epp_ports = {p["name"]: p["containerPort"] for p in epp_container["ports"]}
    args = _epp_args()
    assert epp_ports[svc_port["targetPort"]] == int(args["grpc-port"])
    assert args["pool-name"] == pool["metadata"]["name"]
    assert epp_container["image"].endswith(":" + GAIE["version"]), "the picker of the release whose CRDs are vendored"
    # Its plugin configuration is the ConfigMap key mounted at --config-file.
    config_dir, _, config_key = args["config-file"].rpartition("/")
    mount = next(m for m in epp_container["volumeMounts"] if m["mountPath"] == config_dir)
    volume = next(v for v in epp["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    plugins_map = _one("ConfigMap", component="endpoint-picker")
    assert volume["configMap"]["name"] == plugins_map["metadata"]["name"]
    plugins = yaml.safe_load(plugins_map["data"][config_key])
    declared = {p["type"] for p in plugins["plugins"]}
    (profile,) = plugins["schedulingProfiles"]
    assert {p["pluginRef"] for p in profile["plugins"]} <= declared
    assert {"queue-scorer", "kv-cache-utilization-scorer"} <= declared, "the two gauges the server exports"
    # Its identity may read the pool, the objectives and the pods.
    account = _one("ServiceAccount")
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
    binding, role = _one("RoleBinding"), _one("Role")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert {"kind": "ServiceAccount", "name": account["metadata"]["name"]}.items() <= binding["subjects"][0].items()
    readable = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
                if {"get", "list", "watch"} <= set(rule["verbs"])}
    assert {(POOL_GROUP, "inferencepools"), ("inference.networking.x-k8s.io", "inferenceobjectives"), ("", "pods")} <= readable
    # The route and the objective name the pool.
    route = _one("HTTPRoute")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends and all((b["group"], b["kind"], b["name"]) == (POOL_GROUP, "InferencePool", pool["metadata"]["name"])
                            for b in backends)
    assert route["spec"]["parentRefs"][0]["kind"] == "Gateway"
    objective = _one("InferenceObjective")
    assert objective["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    assert objective["spec"]["poolRef"].get("group", POOL_GROUP) == POOL_GROUP


def test_the_server_lets_the_picker_scrape_without_a_key() -> None:
    """The picker sends no key: the server's settings open /metrics (only), and the key Secret stays mounted."""
    server = _server()
    (container,) = server["spec"]["template"]["spec"]["containers"]
    maps = {c["metadata"]["name"]: c["data"] for _, c in _docs(K8S) if c["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in container["envFrom"]:
        env.update(maps[source["configMapRef"]["name"]])
    assert env["GGUF_METRICS_PUBLIC"] == "true"
    assert any(e["name"] == "GGUF_API_KEY_FILE" for e in container["env"])
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    args = _epp_args()
    assert args.get("model-server-metrics-scheme", "http") == "http"
    # The picker scrapes the pool's target port unless told otherwise (the flag is deprecated after v1.0).
    assert "model-server-metrics-port" not in args


_SPEC = re.compile(r"^\s*([^{}\s]+)\s*(?:\{([^{}]*)\})?\s*$")


def metric_spec(text: str) -> tuple[str, dict[str, str]] | None:
    """A metric flag as the picker reads it (pkg/epp/backend/metrics/metrics_spec.go ``stringToMetricSpec``):
    ``name`` or ``name{label=value,...}``; empty disables the metric."""
    if text.strip() == "":
        return None
    m = _SPEC.match(text)
    assert m, f"not a metric spec: {text!r}"
    labels = {}
    for pair in filter(None, (p.strip() for p in (m.group(2) or "").split(","))):
        key, _, val = pair.partition("=")
        assert key.strip() and val.strip(), pair
        labels[key.strip()] = val.strip()
    return m.group(1), labels


METRIC_FLAGS = ("total-queued-requests-metric", "total-running-requests-metric", "kv-cache-usage-percentage-metric",
                "lora-info-metric", "cache-info-metric")


def test_metric_spec_parser() -> None:
    assert metric_spec("vllm:num_requests_waiting") == ("vllm:num_requests_waiting", {})
    assert metric_spec("nv_trt_llm_request_metrics{request_type=waiting}") == ("nv_trt_llm_request_metrics",
                                                                              {"request_type": "waiting"})
    assert metric_spec("") is None
    with pytest.raises(AssertionError):
        metric_spec("a{b}")


@pytest.mark.slow
def test_the_picker_flags_name_gauges_the_server_exports(service_factory: Callable[..., Any]) -> None:
    """A real server configured as in deploy/k8s (a key, /metrics public), scraped as the picker scrapes it."""
    svc = service_factory(GGUF_API_KEYS="a-key", GGUF_METRICS_PUBLIC="true", GGUF_CONFIRM_LOADS="false",
                          GGUF_CONTEXT_LENGTH="2048")
    svc.wait_ready()
    args = _epp_args()
    with httpx.Client(base_url=svc.url, timeout=30) as picker:  # no key, like the picker
        r = picker.get(args.get("model-server-metrics-path", "/metrics"))
    assert r.status_code == 200, r.text
    text = r.text
    types = families(text)
    got = samples(text)
    named = {flag: metric_spec(args[flag]) for flag in METRIC_FLAGS if flag in args}
    assert {"total-queued-requests-metric", "kv-cache-usage-percentage-metric"} <= {f for f, s in named.items() if s}
    for flag, spec in named.items():
        if spec is None:  # disabled: the server must indeed have nothing of the kind
            assert not any(n.startswith(("vllm:lora", "gguf_lora")) for n in types), flag
            continue
        name, labels = spec
        assert types.get(name) == "gauge", f"--{flag}={args[flag]}: the server exports no gauge {name}"
        matching = [v for (n, ls), v in got.items() if n == name and labels.items() <= dict(ls).items()]
        assert matching, f"--{flag}: no {name} series with {labels}"
        if flag == "kv-cache-usage-percentage-metric":
            assert all(0 <= v <= 1 for v in matching), "a fraction, from 0 to 1"
    # The picker's defaults (vLLM's names) are there too, for a picker left unconfigured.
    for default in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert types.get(default) == "gauge", default
    assert httpx.get(svc.url + "/v1/models", timeout=30).status_code == 401, "the rest still needs the key"
    svc.stop()
