"""deploy/k8s/inference-gateway/: the InferencePool, its route and the llm-d router's endpoint picker.

The InferencePool is validated against the CRD schema of Gateway API Inference Extension release v1.4.0
(``gaie-v1.4.0-schema.json``, converted by ``vendor_schemas.py --gaie``), the picker's configuration
against the llm-d router's ``EndpointPickerConfig`` types (``llm-d-router-config-schema.json``, written by
``vendor_schemas.py --llm-d-router`` from the router's Go types; each file names its sources: repository,
path, commit), the picker's Deployment, Service, ConfigMap and RBAC against the strict Kubernetes schemas
(``k8s-schema.json``). The HTTPRoute (Gateway API, another project) has no vendored schema here: its
references are checked instead. Then the pieces are checked against each other and against the server:
the pool selects the server's pods on its port, the pods' ``llm-d.ai/engine-type`` label names the
engine config, whose metric names are the gauges ``service.api.metrics`` exports (and, slow, a real
server's ``/metrics`` scraped the way the picker scrapes it: no key, the configured path).
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

from service.api import metrics as server_metrics
from tests.prom import families, samples

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
GATEWAY = ROOT / "deploy" / "k8s" / "inference-gateway"
K8S = ROOT / "deploy" / "k8s"
GAIE = json.loads((HERE / "gaie-v1.4.0-schema.json").read_text(encoding="utf-8"))
LLMD = json.loads((HERE / "llm-d-router-config-schema.json").read_text(encoding="utf-8"))
CORE = json.loads((HERE / "k8s-schema.json").read_text(encoding="utf-8"))
POOL_GROUP = "inference.networking.k8s.io"
POOL_KEY = f"{POOL_GROUP}/v1/InferencePool"
# The group that held InferenceObjective (and the v1alpha2 InferencePool) before the extension dropped it.
EXPERIMENTAL_GROUP = "inference.networking.x-k8s.io"
COMMIT = re.compile(r"^[0-9a-f]{40}$")


def _docs(folder: Path, pattern: str = "*.yaml") -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(folder.glob(pattern)):
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


def _config_errors(config: dict[str, Any]) -> list[str]:
    schema = {**LLMD["config"], "$schema": LLMD["$schema"]}
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in jsonschema.Draft202012Validator(schema).iter_errors(config)]


@pytest.mark.parametrize("name,doc", DOCS, ids=[f"{n}:{d['kind']}" for n, d in DOCS])
def test_manifest_is_valid(name: str, doc: dict[str, Any]) -> None:
    if doc["kind"] == "HTTPRoute":
        assert doc["apiVersion"] == "gateway.networking.k8s.io/v1"
        return  # no vendored Gateway API schema: test_the_pool_selects_the_server_pods_on_its_port checks it
    assert _errors(doc) == []


def test_no_inference_objective_remains() -> None:
    """The extension no longer defines InferenceObjective: no manifest, no group of it, no right to read it."""
    everything = _docs(K8S, "**/*.yaml")
    assert DOCS and {n for n, _ in DOCS} <= {n for n, _ in everything}
    for name, doc in everything:
        assert doc["kind"] not in ("InferenceObjective", "InferenceModel"), name
        assert not doc["apiVersion"].startswith(EXPERIMENTAL_GROUP + "/"), f"{name}: {doc['kind']}"
    role = _one("Role")
    for rule in role["rules"]:
        assert EXPERIMENTAL_GROUP not in rule["apiGroups"] and "llm-d.ai" not in rule["apiGroups"], rule
        assert not {"inferenceobjectives", "inferencemodels"} & set(rule["resources"]), rule
    assert set(GAIE["kinds"]) == {POOL_KEY}, "only the pool is vendored: nothing else is deployed"


def test_the_vendored_schemas_are_pinned_and_strict() -> None:
    assert GAIE["version"] == "v1.4.0"
    assert COMMIT.match(GAIE["source"]["commit"]) and GAIE["source"]["path"].endswith("_inferencepools.yaml")
    assert all(COMMIT.match(s["commit"]) and s["repo"] and s["path"] for s in LLMD["sources"].values())
    pool = _one("InferencePool")
    for mutate in (
        lambda p: p["spec"].update(targetPortNumber=8000),                        # v1alpha2's field, gone in v1
        lambda p: p["spec"]["endpointPickerRef"].pop("port"),                      # kind Service needs a port
        lambda p: p["spec"].pop("endpointPickerRef"),                              # required in v1.4.0
        lambda p: p["spec"].update(targetPorts=[{"number": 8000}, {"number": 8000}]),  # CEL: unique numbers
        lambda p: p["spec"].update(targetPorts=[{"number": 8000 + i} for i in range(9)]),  # eight at most
        lambda p: p["spec"].update(targetPorts=[]),
        lambda p: p["spec"].update(appProtocol="grpc"),
        lambda p: p["spec"]["endpointPickerRef"].update(failureMode="FailSometimes"),
        lambda p: p["spec"]["selector"]["matchLabels"].update({"bad": "-x-"}),
        lambda p: p["spec"]["selector"].update(matchLabels={}),                    # selects nothing: refused
    ):
        bad = copy.deepcopy(pool)
        mutate(bad)
        assert _errors(bad), "the schema must reject it"
    # What v1.4.0 allows that v1.0.0 did not, and the CEL rule's other side: no port unless kind is Service.
    ok = copy.deepcopy(pool)
    ok["spec"].update(targetPorts=[{"number": 8000}, {"number": 8001}], appProtocol="kubernetes.io/h2c")
    ok["spec"]["endpointPickerRef"] = {"name": "x", "kind": "EndpointPicker", "group": "example.com"}
    assert _errors(ok) == []
    ok["spec"]["endpointPickerRef"] = {"name": "x"}
    assert _errors(ok), "kind defaults to Service, which needs a port"

    config = _picker_config()
    assert _config_errors(config) == []
    for mutate in (
        lambda c: c.update(apiVersion=f"{EXPERIMENTAL_GROUP}/v1alpha1"),          # the deprecated group
        lambda c: c.update(parser={"pluginRef": "openai-parser"}),                 # not in the v1 types
        lambda c: c.update(saturationDetector={}),                                 # moved under flowControl
        lambda c: c["schedulingProfiles"][0]["plugins"].append({"weight": 1}),     # no pluginRef
        lambda c: c["dataLayer"]["sources"][0].pop("extractors"),
        lambda c: _plugin(c, "core-metrics-extractor")["parameters"]["engineConfigs"][0].update(kvUsage="x"),
        lambda c: _plugin(c, "core-metrics-extractor")["parameters"]["engineConfigs"][0].pop("name"),
        lambda c: _plugin(c, "metrics-data-source")["parameters"].update(metricsPort=8000),
        lambda c: _plugin(c, "metrics-data-source")["parameters"].update(path="metrics"),
        lambda c: c["plugins"].append({"name": "no-type"}),
    ):
        bad = copy.deepcopy(config)
        mutate(bad)
        assert _config_errors(bad), "the schema must reject it"


def _epp() -> dict[str, Any]:
    return _one("Deployment", component="endpoint-picker")


def _epp_args() -> dict[str, str]:
    (container,) = _epp()["spec"]["template"]["spec"]["containers"]
    args: dict[str, str] = {}
    argv = list(container["args"])
    while argv:
        arg = argv.pop(0)
        assert arg.startswith("--"), arg
        name, eq, val = arg[2:].partition("=")
        args[name] = val if eq else argv.pop(0)
    return args


def _picker_config() -> dict[str, Any]:
    """The EndpointPickerConfig the picker reads: the ConfigMap key mounted at its --config-file."""
    epp = _epp()
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    config_dir, _, config_key = _epp_args()["config-file"].rpartition("/")
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == config_dir)
    volume = next(v for v in epp["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    config_map = _one("ConfigMap", component="endpoint-picker")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    config = yaml.safe_load(config_map["data"][config_key])
    assert isinstance(config, dict)
    return config


def _plugin(config: dict[str, Any], plugin_type: str) -> dict[str, Any]:
    (plugin,) = [p for p in config["plugins"] if p["type"] == plugin_type]
    return plugin


def _engine_config() -> tuple[str, dict[str, Any]]:
    """The pod label key the extractor reads, and the one engine config this project defines."""
    params = _plugin(_picker_config(), "core-metrics-extractor").get("parameters") or {}
    (engine,) = params["engineConfigs"]
    return params.get("engineLabelKey") or LLMD["engineLabelKey"], engine


def _server() -> dict[str, Any]:
    return _one("Deployment", _docs(K8S))


def test_the_picker_config_is_complete_and_consistent() -> None:
    config = _picker_config()
    assert _config_errors(config) == []
    names = [p.get("name") or p["type"] for p in config["plugins"]]
    assert len(names) == len(set(names)), "a plugin name twice stops the router"
    assert {p["type"] for p in config["plugins"]} <= set(LLMD["pluginTypes"]), "a type the router registers"
    # One profile (the single-profile handler takes no more), whose scorers read the two gauges.
    (profile,) = config["schedulingProfiles"]
    refs = [p["pluginRef"] for p in profile["plugins"]]
    assert set(refs) <= set(names)
    by_name = {p.get("name") or p["type"]: p["type"] for p in config["plugins"]}
    assert {"queue-scorer", "kv-cache-utilization-scorer"} <= {by_name[r] for r in refs}
    assert "single-profile-handler" in by_name.values()
    # The metrics source feeds the extractor that holds the engine config.
    (source,) = config["dataLayer"]["sources"]
    assert by_name[source["pluginRef"]] == "metrics-data-source"
    assert [by_name[e["pluginRef"]] for e in source["extractors"]] == ["core-metrics-extractor"]


_SPEC = re.compile(r"^\s*([^{}\s]+)\s*(?:\{([^{}]*)\})?\s*$")


def metric_spec(text: str) -> tuple[str, dict[str, str]] | None:
    """A metric spec as the router reads it (extractor/metrics/spec.go ``parseStringToSpec``: a PromQL
    selector, ``name`` or ``name{label=value,...}``, quotes optional); empty: the metric is not read."""
    if text.strip() == "":
        return None
    m = _SPEC.match(text)
    assert m, f"not a metric spec: {text!r}"
    labels = {}
    for pair in filter(None, (p.strip() for p in (m.group(2) or "").split(","))):
        key, _, val = pair.partition("=")
        assert key.strip() and val.strip(), pair
        labels[key.strip()] = val.strip().strip('"')
    return m.group(1), labels


# The engine config's specs and the server's Model Server Protocol gauge each must name.
SPEC_GAUGES = {"queuedRequestsSpec": server_metrics.QUEUED_REQUESTS, "runningRequestsSpec": server_metrics.RUNNING_REQUESTS,
               "kvUsageSpec": server_metrics.KV_CACHE_USAGE}


def test_metric_spec_parser() -> None:
    assert metric_spec("vllm:num_requests_waiting") == ("vllm:num_requests_waiting", {})
    assert metric_spec("nv_trt_llm_request_metrics{request_type=waiting}") == ("nv_trt_llm_request_metrics",
                                                                              {"request_type": "waiting"})
    assert metric_spec('x{a="b"}') == ("x", {"a": "b"})
    assert metric_spec("") is None
    with pytest.raises(AssertionError):
        metric_spec("a{b}")


def test_the_engine_config_names_the_gauges_the_server_exports() -> None:
    """Each spec names this server's own gauge for that quantity (service/api/metrics.py), not vLLM's alias;
    the specs the server has nothing for are empty (not read)."""
    _, engine = _engine_config()
    assert set(SPEC_GAUGES) <= set(engine)
    exported = {own for own, _, _ in server_metrics.MSP_GAUGES}
    for key, (own, vllm_alias, _) in SPEC_GAUGES.items():
        spec = metric_spec(engine[key])
        assert spec is not None, f"{key} must be read"
        name, labels = spec
        assert name == own and name in exported, f"{key}={engine[key]}: the server's gauge is {own}"
        assert name != vllm_alias
        assert set(labels) <= {"model_name"}, f"{key}: the gauges carry model_name only"
    for key in ("loraSpec", "cacheInfoSpec", "loraLoadedSpec", "loraGPULoadedSpec", "loraGPUSlotsSpec",
                "cacheBlockSizeSpec", "cacheNumBlocksSpec"):
        assert metric_spec(engine.get(key, "")) is None, f"{key}: the server exports no such metric"
    assert not engine.get("customMetrics")


def test_the_engine_type_label_on_the_server_pods_names_the_engine_config() -> None:
    label_key, engine = _engine_config()
    assert label_key == LLMD["engineLabelKey"], "the router's default key, which the docs and guides use"
    labels = _server()["spec"]["template"]["metadata"]["labels"]
    assert labels.get(label_key) == engine["name"], f"the server pods' {label_key} must name the engine config"
    assert engine["name"] != LLMD["defaultEngine"], "a name of its own: the default engine reads vLLM's names"
    assert label_key not in _epp()["spec"]["template"]["metadata"]["labels"]
    # Every pod the pool selects carries it: the pool selects the server Deployment's pods and no others.
    selector = _one("InferencePool")["spec"]["selector"]["matchLabels"]
    for name, doc in _docs(K8S, "**/*.yaml"):
        if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            pod_labels = doc["spec"]["template"]["metadata"]["labels"]
            if selector.items() <= pod_labels.items():
                assert pod_labels.get(label_key) == engine["name"], f"{name}: {doc['metadata']['name']}"


def test_the_pool_selects_the_server_pods_on_its_port() -> None:
    pool = _one("InferencePool")
    server = _server()
    pod = server["spec"]["template"]
    (server_container,) = pod["spec"]["containers"]
    # The pool selects the server's pods, not the picker's, on the port the server listens on.
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert server["spec"]["selector"]["matchLabels"].items() <= pool["spec"]["selector"]["matchLabels"].items()
    epp = _epp()
    assert not pool["spec"]["selector"]["matchLabels"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    (port,) = pool["spec"]["targetPorts"]
    assert port["number"] in {p["containerPort"] for p in server_container["ports"]}
    env = {e["name"]: e.get("value") for e in server_container["env"]}
    assert int(env["GGUF_PORT"]) == port["number"], "the port the server binds"
    assert server_container["readinessProbe"]["httpGet"]["path"] == "/ready", "a pod joins the pool when its model is loaded"
    assert pool["spec"].get("appProtocol", "http") == "http", "the server speaks HTTP/1.1"
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
    assert args.get("pool-group", POOL_GROUP) == POOL_GROUP
    for probe in ("livenessProbe", "readinessProbe"):
        assert epp_container[probe]["grpc"]["port"] == int(args["grpc-health-port"])
    # The llm-d router's picker, at a release (not a moving tag).
    image, _, tag = epp_container["image"].rpartition(":")
    assert image == "ghcr.io/llm-d/llm-d-router-endpoint-picker" and re.fullmatch(r"v\d+\.\d+\.\d+", tag)
    # Its identity may read the pool and the pods.
    account = _one("ServiceAccount")
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
    binding, role = _one("RoleBinding"), _one("Role")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert {"kind": "ServiceAccount", "name": account["metadata"]["name"]}.items() <= binding["subjects"][0].items()
    readable = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
                if {"get", "list", "watch"} <= set(rule["verbs"])}
    assert {(POOL_GROUP, "inferencepools"), ("", "pods")} <= readable
    # The route sends everything to the pool.
    route = _one("HTTPRoute")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends and all((b["group"], b["kind"], b["name"]) == (POOL_GROUP, "InferencePool", pool["metadata"]["name"])
                            for b in backends)
    assert route["spec"]["parentRefs"][0]["kind"] == "Gateway"


def test_the_server_lets_the_picker_scrape_without_a_key() -> None:
    """The picker sends no key: the server's settings open /metrics (only), and the key Secret stays mounted;
    the picker scrapes the pool's target port over plain HTTP at the path the server serves."""
    server = _server()
    (container,) = server["spec"]["template"]["spec"]["containers"]
    maps = {c["metadata"]["name"]: c["data"] for _, c in _docs(K8S) if c["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in container["envFrom"]:
        env.update(maps[source["configMapRef"]["name"]])
    assert env["GGUF_METRICS_PUBLIC"] == "true"
    assert any(e["name"] == "GGUF_API_KEY_FILE" for e in container["env"])
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    params = _plugin(_picker_config(), "metrics-data-source").get("parameters") or {}
    assert params.get("scheme", "http") == "http"
    assert params.get("path", "/metrics") == "/metrics"
    (port,) = _one("InferencePool")["spec"]["targetPorts"]
    assert params.get("port", 0) in (0, port["number"]), "the server serves /metrics on its one port"
    # The old picker's metric flags stop the router: the engine config replaces them.
    assert not set(_epp_args()) & set(LLMD["rejectedFlags"])


@pytest.mark.slow
def test_the_engine_config_names_gauges_a_real_server_exports(service_factory: Callable[..., Any]) -> None:
    """A real server configured as in deploy/k8s (a key, /metrics public), scraped as the picker scrapes it."""
    svc = service_factory(GGUF_API_KEYS="a-key", GGUF_METRICS_PUBLIC="true", GGUF_CONFIRM_LOADS="false",
                          GGUF_CONTEXT_LENGTH="2048")
    svc.wait_ready()
    params = _plugin(_picker_config(), "metrics-data-source").get("parameters") or {}
    with httpx.Client(base_url=svc.url, timeout=30) as picker:  # no key, like the picker
        r = picker.get(params.get("path", "/metrics"))
    assert r.status_code == 200, r.text
    text = r.text
    types = families(text)
    got = samples(text)
    _, engine = _engine_config()
    for key in SPEC_GAUGES:
        spec = metric_spec(engine[key])
        assert spec is not None
        name, labels = spec
        assert types.get(name) == "gauge", f"{key}={engine[key]}: the server exports no gauge {name}"
        matching = [v for (n, ls), v in got.items() if n == name and labels.items() <= dict(ls).items()]
        assert matching, f"{key}: no {name} series with {labels}"
        if key == "kvUsageSpec":
            assert all(0 <= v <= 1 for v in matching), "a fraction, from 0 to 1"
    assert not any(n.startswith(("vllm:lora", "gguf_lora")) for n in types), "no adapters: loraSpec stays empty"
    assert httpx.get(svc.url + "/v1/models", timeout=30).status_code == 401, "the rest still needs the key"
    svc.stop()
