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

Precise prefix-cache routing: the picker's ``precise-prefix-cache-producer`` subscribes to each server pod's
KV events (``service.residency.kv_events``) and its ``token-producer`` asks the server's render routes
(``service.api.render``) for a request's token ids. Checked against the server's own settings and code: the
producer's block size is the server's default ``kv_events_block_size``, the port it dials is the container
port the server binds (``GGUF_KV_EVENTS_ENDPOINT``), the topic the server publishes (``GGUF_KV_EVENTS_TOPIC``
as Kubernetes expands it, then formatted by the server's publisher) starts with the producer's topic filter
and names the pod as the picker names the pool's endpoint, every medium the server publishes has a weight,
and only the picker may reach the events port (the NetworkPolicy, validated with ``test_k8s``'s stand-in).
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
from service.api import render as server_render
from service.residency import kv_events as server_kv_events
from service.settings import Settings
from tests.deploy.test_k8s import STAND_INS
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
    if "/" not in group_version or group_version.split("/")[0] in ("apps", "rbac.authorization.k8s.io",
                                                                    "networking.k8s.io"):
        # NetworkPolicy: test_k8s's strict stand-in until k8s-schema.json is rebuilt with it.
        top = CORE["kinds"].get(doc["kind"], STAND_INS.get(doc["kind"]))
        assert top is not None, f"no vendored schema for {doc['kind']}"
        return jsonschema.Draft202012Validator({**top, "$defs": CORE["$defs"]})
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
        # precise prefix-cache routing
        lambda c: _producer(c)["tokenProcessorConfig"].update(blockSize=0),
        lambda c: _producer(c)["tokenProcessorConfig"].update(blockSizeToken=16),          # misspelt
        lambda c: _producer(c)["tokenProcessorConfig"].update(hashAlgorithm="sha256"),
        lambda c: _producer(c)["indexerConfig"].update(tokenizersPoolConfig={"modelName": "m"}),  # refused
        lambda c: _producer(c)["indexerConfig"]["kvCacheBackendConfigs"].append({"name": "disk"}),
        lambda c: _producer(c)["kvEventsConfig"].update(zmqEndpoints="tcp://*:5557"),
        lambda c: _producer(c)["kvEventsConfig"].update(engineType="llama.cpp"),
        lambda c: _producer(c)["kvEventsConfig"].update(concurrency=0),
        lambda c: _producer(c)["kvEventsConfig"]["podDiscoveryConfig"].update(socketPort="5557"),
        lambda c: _producer(c)["kvEventsConfig"]["podDiscoveryConfig"].update(port=5557),
        lambda c: _producer(c).update(speculativeTTL="2 seconds"),
        lambda c: _plugin(c, "token-producer")["parameters"].pop("modelName"),
        lambda c: _plugin(c, "token-producer")["parameters"].update(estimate={}),
        lambda c: _plugin(c, "token-producer")["parameters"].update(udsTokenizerConfig={"socketFile": "/s"}),
        lambda c: _plugin(c, "token-producer")["parameters"]["vllm"].update(endpointDiscovery={}),
        lambda c: _plugin(c, "token-producer")["parameters"]["vllm"].update(url="gguf-fit-server:80"),
        lambda c: _plugin(c, "token-producer")["parameters"]["vllm"].update(timeout="5"),
        lambda c: _plugin(c, "token-producer").pop("parameters"),
        lambda c: _plugin(c, "prefix-cache-scorer")["parameters"].update(prefixLengthWeight=0.5),  # no maxModelLen
        lambda c: _plugin(c, "prefix-cache-scorer")["parameters"].update(producerName="x"),
        lambda c: _plugin(c, "endpoint-notification-source").update(parameters={}),
    ):
        bad = copy.deepcopy(config)
        mutate(bad)
        assert _config_errors(bad), "the schema must reject it"
    # What the sources allow besides: the new name of the block size, a length-weighted score with its
    # maximum length, speculative indexing with a Go duration, discovery instead of one render URL.
    for mutate in (
        lambda c: _producer(c)["tokenProcessorConfig"].update(blockSizeTokens=16),
        lambda c: _plugin(c, "prefix-cache-scorer")["parameters"].update(prefixLengthWeight=0.5, maxModelLen=4096),
        lambda c: _producer(c).update(speculativeIndexing=True, speculativeTTL="1m30s"),
        lambda c: _plugin(c, "token-producer")["parameters"].update(vllm={"endpointDiscovery": {}}),
    ):
        ok_config = copy.deepcopy(config)
        mutate(ok_config)
        assert _config_errors(ok_config) == []


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


def _producer(config: dict[str, Any]) -> dict[str, Any]:
    """The precise-prefix-cache-producer's parameters."""
    params = _plugin(config, "precise-prefix-cache-producer").get("parameters")
    assert isinstance(params, dict)
    return params


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
    # The metrics source feeds the extractor that holds the engine config; the endpoint notifications feed
    # the precise prefix-cache producer (its per-pod subscriptions).
    sources = {by_name[s["pluginRef"]]: [by_name[e["pluginRef"]] for e in s["extractors"]]
               for s in config["dataLayer"]["sources"]}
    assert sources == {"metrics-data-source": ["core-metrics-extractor"],
                       "endpoint-notification-source": ["precise-prefix-cache-producer"]}
    # The prefix scorer reads what the producer publishes, by the producer's name, and is weighted.
    scorer = _plugin(config, "prefix-cache-scorer")
    (producer,) = [n for n, t in by_name.items() if t == "precise-prefix-cache-producer"]
    assert scorer["parameters"]["prefixMatchInfoProducerName"] == producer
    weights = {by_name[p["pluginRef"]]: p.get("weight", 1) for p in profile["plugins"]}
    assert weights["prefix-cache-scorer"] > 0
    # The producer needs real token ids: a token-producer with the render backend (not the estimate one the
    # router would create in its place).
    tokens = _plugin(config, "token-producer")["parameters"]
    assert "vllm" in tokens and "udsTokenizerConfig" not in tokens


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


# Precise prefix-cache routing: the picker's producer against the server's KV events and render routes.

KV = LLMD["kvEvents"]


def _server_container() -> dict[str, Any]:
    (container,) = _server()["spec"]["template"]["spec"]["containers"]
    return container


def _server_settings_env() -> dict[str, str]:
    """The GGUF_* environment a server pod gets: the ConfigMaps of its envFrom, then its env values."""
    container = _server_container()
    maps = {c["metadata"]["name"]: c["data"] for _, c in _docs(K8S) if c["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]])
    env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
    return env


_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _expanded_env(pod_ip: str) -> dict[str, str]:
    """The container's env as Kubernetes sets it: each $(NAME) replaced by the value of a variable defined
    earlier in the list (the downward API's status.podIP being ``pod_ip``); every reference must resolve,
    or the literal $(NAME) would reach the server."""
    env: dict[str, str] = {}
    for entry in _server_container()["env"]:
        if "value" in entry:
            value = entry["value"]
            unresolved = [n for n in _REF.findall(value) if n not in env]
            assert not unresolved, f"{entry['name']}: $({unresolved[0]}) is not defined before it"
            env[entry["name"]] = _REF.sub(lambda m: env[m.group(1)], value)
        elif entry["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[entry["name"]] = pod_ip
    return env


def _server_settings(monkeypatch: pytest.MonkeyPatch, pod_ip: str) -> Settings:
    """The server's settings in a pod whose IP is ``pod_ip``."""
    import os

    for var in [k for k in os.environ if k.startswith("GGUF_")]:
        monkeypatch.delenv(var)
    for var, value in {**_server_settings_env(), **_expanded_env(pod_ip)}.items():
        if var.startswith("GGUF_"):
            monkeypatch.setenv(var, value)
    return Settings()


def _effective_block_size(params: dict[str, Any]) -> int:
    """The producer's block size as the router resolves it (token_processor.go): blockSizeTokens, else the
    deprecated blockSize, else the default."""
    tp = params.get("tokenProcessorConfig") or {}
    return tp.get("blockSizeTokens") or tp.get("blockSize") or KV["defaultBlockSize"]


def _kv_events() -> dict[str, Any]:
    return _producer(_picker_config()).get("kvEventsConfig") or {}


def _discovery() -> dict[str, Any]:
    return _kv_events().get("podDiscoveryConfig") or {}


def test_the_block_size_is_the_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer hashes events and requests in blocks of the size the server publishes them in."""
    size = _effective_block_size(_producer(_picker_config()))
    assert size == Settings.model_fields["kv_events_block_size"].default, "the server's default block size"
    assert "GGUF_KV_EVENTS_BLOCK_SIZE" not in _server_settings_env(), "the pods keep the default"
    assert _server_settings(monkeypatch, "10.1.2.3").kv_events_block_size == size


def test_the_picker_dials_the_port_the_server_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = _kv_events()
    assert kv.get("discoverPods", True) is True, "per pod: the server binds, the picker connects"
    assert "zmqEndpoint" not in kv, "the picker binds no socket of its own for the server to connect to"
    port = _discovery().get("socketPort", KV["defaultSocketPort"])
    ports = {p["name"]: p for p in _server_container()["ports"]}
    assert ports["kv-events"]["containerPort"] == port and ports["kv-events"].get("protocol", "TCP") == "TCP"
    endpoint = _server_settings(monkeypatch, "10.1.2.3").kv_events_endpoint
    assert endpoint is not None, "GGUF_KV_EVENTS_ENDPOINT: the server publishes nothing without it"
    m = re.fullmatch(r"tcp://(\*|0\.0\.0\.0|\[::\]):(\d+)", endpoint)
    assert m, f"{endpoint}: the pod's every interface (the picker dials the pod IP)"
    assert int(m.group(2)) == port
    # Beyond loopback the server starts only when told (issue 54): the picker's subscriber has no CURVE, so the
    # pods say GGUF_KV_EVENTS_ALLOW_PUBLIC, and the NetworkPolicy admits the picker alone to the port.
    settings = _server_settings(monkeypatch, "10.1.2.3")
    assert settings.kv_events_allow_public and server_kv_events.check_settings(settings) is None
    monkeypatch.delenv("GGUF_KV_EVENTS_ALLOW_PUBLIC")
    with pytest.raises(server_kv_events.KvEventsRefused, match="GGUF_KV_EVENTS_ALLOW_PUBLIC"):
        server_kv_events.check_settings(Settings())
    # One target port, so rank 0: the picker dials socketPort itself.
    assert len(_one("InferencePool")["spec"]["targetPorts"]) == 1
    # The server binds it for real (the publisher reports where it listens).
    publisher = server_kv_events.KvEventPublisher("tcp://127.0.0.1:0", block_size=16, topic="kv@x@{model}")
    try:
        assert publisher.endpoint.startswith("tcp://127.0.0.1:")
    finally:
        publisher.close()


@pytest.mark.parametrize("pod_ip", ["10.1.2.3", "fd00:10:244::7"])
def test_the_topic_names_the_pod_as_the_picker_does(monkeypatch: pytest.MonkeyPatch, pod_ip: str) -> None:
    """The server's topic for a model, as the pod's env makes it and the server's publisher formats it, passes
    the producer's topic filter and parses (kv@<pod-id>@<model>) into the pool endpoint's "<address>:<port>"
    and the model the token producer renders for."""
    settings = _server_settings(monkeypatch, pod_ip)
    model = _server_settings_env()["GGUF_DEFAULT_MODEL"]
    publisher = server_kv_events.KvEventPublisher("tcp://127.0.0.1:0", block_size=settings.kv_events_block_size,
                                                  topic=settings.kv_events_topic)
    try:
        topic = publisher.topic_of(model).decode("utf-8")
    finally:
        publisher.close()
    assert topic.startswith(_kv_events().get("topicFilter", KV["defaultTopicFilter"])), topic
    parts = topic.split(KV["topicSeparator"])
    assert len(parts) == 3 and parts[0] == "kv", topic
    (target,) = _one("InferencePool")["spec"]["targetPorts"]
    assert parts[1] == KV["topic"].split("@")[1].format(address=pod_ip, port=target["number"])
    assert parts[2] == model == _plugin(_picker_config(), "token-producer")["parameters"]["modelName"]
    # The server's default topic names the host, which the picker cannot tie to an endpoint.
    assert Settings.model_fields["kv_events_topic"].default != settings.kv_events_topic


def _selector(text: str) -> dict[str, str]:
    """An equality-only label selector (k=v,k2=v2) as a dict."""
    out = {}
    for term in text.split(","):
        key, eq, value = term.partition("=")
        assert eq and key and value and not value.startswith("="), f"{term}: equality terms only here"
        out[key.strip()] = value.strip()
    return out


def test_the_producer_subscribes_to_the_pool_pods_only() -> None:
    selector = _selector(_discovery().get("podLabelSelector", KV["defaultPodLabelSelector"]))
    pod_labels = _server()["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items(), "the server's pods get a subscription"
    assert selector.items() >= _one("InferencePool")["spec"]["selector"]["matchLabels"].items()
    assert not selector.items() <= _epp()["spec"]["template"]["metadata"]["labels"].items()


def test_every_medium_the_server_publishes_has_its_weight() -> None:
    """Blocks in a slot count most, then host memory, then disk (a medium without a weight would count as
    much as a slot)."""
    configured = (_producer(_picker_config()).get("indexerConfig") or {}).get("kvCacheBackendConfigs")
    weights = {b["name"]: b["weight"] for b in configured} if configured else KV["defaultMediumWeights"]
    media = {m.lower() for m in server_kv_events.MEDIA.values()}
    assert media == {"gpu", "cpu", "storage"}
    assert media <= set(weights), f"no weight for {media - set(weights)}"
    assert weights["gpu"] > weights["cpu"] > weights["storage"] > 0


def test_the_token_producer_renders_on_the_server() -> None:
    """The token producer posts to the server's render routes through its Service, for the pool's model,
    and can authenticate with the server's own key."""
    params = _plugin(_picker_config(), "token-producer")["parameters"]
    url = re.fullmatch(r"http://([a-z0-9-]+)(?::(\d+))?", params["vllm"]["url"])
    assert url, params["vllm"]["url"]
    service = next(d for _, d in _docs(K8S) if d["kind"] == "Service" and d["metadata"]["name"] == url.group(1))
    (port,) = service["spec"]["ports"]
    assert int(url.group(2) or 80) == port["port"]
    assert service["spec"]["selector"].items() <= _server()["spec"]["template"]["metadata"]["labels"].items()
    assert port["targetPort"] in {p["name"] for p in _server_container()["ports"]} | {8000}
    routes = {r.path for r in server_render.router.routes}
    assert {"/v1/completions/render", "/v1/chat/completions/render"} <= routes
    assert params["modelName"] == _server_settings_env()["GGUF_DEFAULT_MODEL"]
    # The warm-up probe's key: the server's Secret, optional so that the picker starts without it.
    (container,) = _epp()["spec"]["template"]["spec"]["containers"]
    (key,) = [e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == "VLLM_API_KEY"]
    volumes = {v["name"]: v for v in _server()["spec"]["template"]["spec"]["volumes"]}
    secret = volumes["api-key"]["secret"]
    assert key["name"] == secret["secretName"] and key["key"] in {i["key"] for i in secret["items"]}
    assert key.get("optional") is True


def test_only_the_picker_reaches_the_events_port() -> None:
    """The events carry the held prompts' token ids: a NetworkPolicy admits the events port from the
    picker's pods only, and the HTTP port from everywhere (the gateway, scrapers)."""
    policy = _one("NetworkPolicy")
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == _one("InferencePool")["spec"]["selector"]["matchLabels"]
    assert "Ingress" in spec["policyTypes"]
    container = _server_container()
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    events, http_port = _discovery().get("socketPort", KV["defaultSocketPort"]), named["http"]
    epp_labels = _epp()["spec"]["template"]["metadata"]["labels"]
    open_ports: set[int] = set()
    picker_ports: set[int] = set()
    for rule in spec["ingress"]:
        ports = {named.get(p["port"], p["port"]) for p in rule["ports"]}
        assert all(p.get("protocol", "TCP") == "TCP" for p in rule["ports"])
        if not rule.get("from"):
            open_ports |= ports
            continue
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"} and peer["podSelector"]["matchLabels"]
            assert peer["podSelector"]["matchLabels"].items() <= epp_labels.items(), "the picker's pods"
            assert not peer["podSelector"]["matchLabels"].items() <= \
                _server()["spec"]["template"]["metadata"]["labels"].items()
        picker_ports |= ports
    assert open_ports == {http_port} and picker_ports == {events}
    assert set(named.values()) == {http_port, events}, "a port the policy does not name would be closed"
    bad = copy.deepcopy(policy)
    bad["spec"]["ingress"][1]["from"][0]["podSelecter"] = {}
    assert _errors(bad), "the stand-in is strict"
