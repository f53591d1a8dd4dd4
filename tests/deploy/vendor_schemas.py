"""Rebuild the vendored schemas in this folder (run by hand; not a test).

The tests must run offline, so the schemas they validate against live here:

- ``compose-spec.json``: the Compose Specification JSON schema exactly as the
  PyPI package ``docker-compose==1.29.2`` ships it
  (``compose/config/compose_spec.json``, Apache-2.0).
- ``k8s-schema.json``: the kinds this project deploys (Deployment, Service,
  PersistentVolumeClaim, ConfigMap, the endpoint picker's ServiceAccount and RBAC kinds, and the
  workers' StatefulSet and NetworkPolicy once rebuilt: see ``K8S_KINDS``) cut from the strict Kubernetes v1.37.0
  schemas that the PyPI package ``kubernetes-validate==1.37.0`` ships
  (``kubernetes-json-schema/v1.37.0-local-strict``, Apache-2.0): each kind's
  top-level schema plus every definition it reaches, descriptions dropped.
- ``gaie-v1.4.0-schema.json``: the InferencePool (``inference.networking.k8s.io/v1``) of the Gateway
  API Inference Extension that ``deploy/k8s/inference-gateway/pool.yaml`` uses, converted from the
  ``openAPIV3Schema`` of the CRD of release bundle v1.4.0 (Apache-2.0): the file
  ``deploy/components/crds-gie/bases/inference.networking.k8s.io_inferencepools.yaml`` that
  llm-d/llm-d-inference-scheduler keeps, commit c370d14124526b604776ba10e2170999e889fa24, annotated
  ``inference.networking.k8s.io/bundle-version: v1.4.0`` (see ``GAIE_SOURCE``). The project no longer
  defines InferenceObjective, so no other kind is converted. The conversion (``crd_to_json_schema``)
  closes every object that lists its properties (the API server prunes unknown fields and ``kubectl
  --validate=strict`` rejects them) and turns each CEL rule of that release into JSON Schema
  (``CEL_RULES``); an unknown CEL rule stops it. Release v1.5.0 (what llm-d-router's go.mod pins) only
  made ``endpointPickerRef`` optional (kubernetes-sigs/gateway-api-inference-extension#2898); its CRD
  text was not found to vendor, and a pool that names its picker, as ours does, is valid under both.
  (The file here was converted from a copy of that CRD read through a code search, its ``description``
  strings left out: the conversion drops them anyway.)
- ``llm-d-router-config-schema.json``: the llm-d router's (endpoint picker's) ``EndpointPickerConfig``
  and the parameters of the two plugins that read a model server's metrics, as JSON Schema, written
  from the Go types of llm-d/llm-d-router (``LLMD_ROUTER_SOURCES``: repository, path, commit of each):
  the config is no Kubernetes resource and ships no schema, so ``LLMD_ROUTER_CONFIG`` below is the
  transcription (field names from the ``json`` tags, ``required`` from ``+required``), plus the
  metric flags the router refuses since engine configs replaced them and the plugin types used here.
  Precise prefix-cache routing adds the parameters of ``token-producer``, ``precise-prefix-cache-producer``
  and ``prefix-cache-scorer`` (``endpoint-notification-source`` takes none), closed the same way, and the
  KV-event facts the producer relies on (``LLMD_KV_EVENTS``: how it reaches a pod, the topic it parses,
  its defaults), each read from the sources named with it.

Usage (needs the two wheels, e.g. ``pip download --no-deps docker-compose==1.29.2
kubernetes-validate==1.37.0``, and the InferencePool CRD of the pinned release, e.g. the file
``GAIE_SOURCE`` names)::

    python tests/deploy/vendor_schemas.py DOCKER_COMPOSE_WHEEL KUBERNETES_VALIDATE_WHEEL
    python tests/deploy/vendor_schemas.py --gaie CRDS_YAML
    python tests/deploy/vendor_schemas.py --llm-d-router
"""

from __future__ import annotations

import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
K8S_DIR = "kubernetes_validate/kubernetes-json-schema/v1.37.0-local-strict/"
K8S_KINDS = {
    "Deployment": "deployment-apps-v1.json",
    "Service": "service-v1.json",
    "PersistentVolumeClaim": "persistentvolumeclaim-v1.json",
    "ConfigMap": "configmap-v1.json",
    # The endpoint picker's identity and rights (deploy/k8s/inference-gateway/).
    "ServiceAccount": "serviceaccount-v1.json",
    "Role": "role-rbac-v1.json",
    "RoleBinding": "rolebinding-rbac-v1.json",
    "ClusterRole": "clusterrole-rbac-v1.json",
    "ClusterRoleBinding": "clusterrolebinding-rbac-v1.json",
    # The workers (deploy/k8s/workers.yaml). Not yet in k8s-schema.json: until a rebuild adds them,
    # tests/deploy/test_k8s.py validates these two kinds with hand-written stand-ins (STAND_INS there).
    "StatefulSet": "statefulset-apps-v1.json",
    "NetworkPolicy": "networkpolicy-networking-v1.json",
}
_REF = re.compile(r'"\$ref": "(?:/api/_definitions\.json)?#/\$defs/([^"]+)"')


def _strip(node: Any, in_properties: bool = False) -> Any:
    """Drop schema ``description`` strings (not properties that happen to be named so)."""
    if isinstance(node, dict):
        return {
            key: _strip(value, in_properties=(key in ("properties", "$defs") and not in_properties))
            for key, value in node.items()
            if in_properties or not (key == "description" and isinstance(value, str))
        }
    if isinstance(node, list):
        return [_strip(item) for item in node]
    return node


def _relink(node: Any) -> Any:
    """Point every reference into the one vendored file's ``$defs``."""
    text = json.dumps(node).replace('"$ref": "/api/_definitions.json#/$defs/', '"$ref": "#/$defs/')
    return json.loads(text)


def vendor_k8s(wheel: Path) -> dict[str, Any]:
    with zipfile.ZipFile(wheel) as zf:
        defs = json.loads(zf.read(K8S_DIR + "_definitions.json"))["$defs"]
        kinds = {kind: json.loads(zf.read(K8S_DIR + name)) for kind, name in K8S_KINDS.items()}
    seen: set[str] = set()
    todo = set().union(*(_REF.findall(json.dumps(s)) for s in kinds.values()))
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo |= set(_REF.findall(json.dumps(defs[name]))) - seen
    for schema in kinds.values():
        schema.pop("$schema", None)
        schema.pop("$id", None)
    out = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": "Cut from kubernetes-validate==1.37.0 v1.37.0-local-strict by tests/deploy/vendor_schemas.py",
        "kinds": kinds,
        "$defs": {name: defs[name] for name in sorted(seen)},
    }
    return _relink(_strip(out))


GAIE_VERSION = "v1.4.0"
GAIE_FILE = f"gaie-{GAIE_VERSION}-schema.json"
GAIE_SOURCE = {
    "repo": "llm-d/llm-d-inference-scheduler",
    "path": "deploy/components/crds-gie/bases/inference.networking.k8s.io_inferencepools.yaml",
    "commit": "c370d14124526b604776ba10e2170999e889fa24",
}
GAIE_KINDS = {("inference.networking.k8s.io", "v1", "InferencePool")}
# The CEL rules (x-kubernetes-validations) of the vendored release, as JSON Schema. A rule not listed
# here stops the conversion: each must be translated by hand, and tested (tests/deploy/test_inference_gateway.py).
CEL_RULES = {
    # endpointPickerRef: port is required when kind is 'Service' or unspecified (kind defaults to Service).
    "self.kind != 'Service' || has(self.port)": {
        "if": {"anyOf": [{"not": {"required": ["kind"]}}, {"properties": {"kind": {"const": "Service"}}}]},
        "then": {"required": ["port"]},
    },
    # targetPorts: no port number twice. Exact as uniqueItems because an item holds its number and nothing
    # else (the conversion closes it: additionalProperties false), so equal items are equal numbers.
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))": {"uniqueItems": True},
}
_DROPPED = {"description", "default", "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type"}


def crd_to_json_schema(node: Any, path: str = "") -> Any:
    """A CRD's structural ``openAPIV3Schema`` as a JSON Schema that rejects what the API server would not keep."""
    if isinstance(node, list):
        return [crd_to_json_schema(n, path) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key == "x-kubernetes-validations":
            rules = [CEL_RULES.get(v["rule"]) for v in value]
            if None in rules:
                raise SystemExit(f"{path}: no JSON Schema for CEL rule(s) {[v['rule'] for v in value]}: add them to CEL_RULES")
            out.setdefault("allOf", []).extend(rules)
        elif key == "properties":
            out[key] = {name: crd_to_json_schema(sub, f"{path}.{name}") for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = crd_to_json_schema(value, f"{path}[]")
        else:
            out[key] = value
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def vendor_gaie(crds_yaml: Path) -> dict[str, Any]:
    import yaml

    kinds: dict[str, Any] = {}
    for doc in yaml.safe_load_all(crds_yaml.read_text(encoding="utf-8")):
        if not doc or doc.get("kind") != "CustomResourceDefinition":
            continue
        bundle = (doc["metadata"].get("annotations") or {}).get("inference.networking.k8s.io/bundle-version")
        if bundle != GAIE_VERSION:
            raise SystemExit(f"{doc['metadata']['name']}: bundle-version {bundle}, expected {GAIE_VERSION}")
        group, kind = doc["spec"]["group"], doc["spec"]["names"]["kind"]
        for version in doc["spec"]["versions"]:
            if (group, version["name"], kind) in GAIE_KINDS:
                schema = crd_to_json_schema(version["schema"]["openAPIV3Schema"], kind)
                kinds[f"{group}/{version['name']}/{kind}"] = schema
    missing = {f"{g}/{v}/{k}" for g, v, k in GAIE_KINDS} - set(kinds)
    if missing:
        raise SystemExit(f"{crds_yaml}: no schema for {sorted(missing)}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": f"Gateway API Inference Extension {GAIE_VERSION} InferencePool CRD (release bundle, as "
        f"{GAIE_SOURCE['repo']} keeps it: {GAIE_SOURCE['path']} at commit {GAIE_SOURCE['commit']}), "
        "openAPIV3Schema converted by tests/deploy/vendor_schemas.py --gaie; keys: group/version/kind",
        "version": GAIE_VERSION,
        "source": GAIE_SOURCE,
        "kinds": kinds,
    }


LLMD_ROUTER_FILE = "llm-d-router-config-schema.json"
# Where each part of LLMD_ROUTER_CONFIG was read (repository, path, commit). llm-d/llm-d-router is the
# project's repository; its index held the v1alpha1 config types only, so the v1 types come from
# red-hat-data-services/llm-d-router, its downstream mirror, at the commit whose loader converts
# v1alpha1 into v1 (pkg/epp/config/loader/conversion.go there).
LLMD_ROUTER_SOURCES = {
    "config-v1alpha1": ("llm-d/llm-d-router", "apix/config/v1alpha1/endpointpickerconfig_types.go",
                        "98f9aa0d59529a4720e7881cb8e1bbd6f45cc785"),
    "config-v1": ("red-hat-data-services/llm-d-router", "apix/config/v1/endpointpickerconfig_types.go",
                  "e0412de546de2fd766ceafa41a20524a45df3aa5"),
    "v1alpha1-to-v1": ("red-hat-data-services/llm-d-router", "pkg/epp/config/loader/conversion.go",
                       "e0412de546de2fd766ceafa41a20524a45df3aa5"),
    "strict-decoding": ("llm-d/llm-d-router", "pkg/epp/config/loader/configloader.go",
                        "98f9aa0d59529a4720e7881cb8e1bbd6f45cc785"),
    "metrics-data-source": ("llm-d/llm-d-router", "pkg/epp/framework/plugins/datalayer/source/metrics/datasource.go",
                            "0d4a9c10b7dde84769c9ae63f4d441d550439917"),
    "core-metrics-extractor": ("llm-d/llm-d-router",
                               "pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go",
                               "08cbacc83054c7dfbea810f1d9518e5c22632d60"),
    "metric-spec": ("llm-d/llm-d-router", "pkg/epp/framework/plugins/datalayer/extractor/metrics/spec.go",
                    "45c38549346873fd356a6417bc0575d2a615f504"),
    "rejected-flags": ("llm-d/llm-d-router", "pkg/epp/server/options.go", "03fdf9197a30892cac458515df5139b4267d4c40"),
    "plugin-types": ("llm-d/llm-d-router", "config/charts/routerlib/templates/_config.yaml",
                     "00bacf3afcccedca310fad8cec229ba54736094c"),
    "plugin-types-2": ("llm-d/llm-d-router", "deploy/config/epp-config.yaml", "39404814aa90b4ef260fbfd42c712feedd1f5e18"),
    # Precise prefix-cache routing. The producer (PluginConfig; refuses indexerConfig.tokenizersPoolConfig)
    # replaced the all-in-one precise-prefix-cache-scorer, now a deprecated wrapper (llm-d/llm-d-router#1112,
    # #1121); the generic prefix-cache-scorer reads what it publishes (prefixMatchInfoProducerName).
    "precise-prefix-cache-producer": (
        "llm-d/llm-d-router", "pkg/epp/framework/plugins/requestcontrol/dataproducer/preciseprefixcache/producer.go",
        "953be86fc9f443e25834ff945f90f11dbf74dfd2"),
    # Its parameters (sessionManager too) and "block keys are recomputed by the EPP from TokenizedPrompt ...
    # the engine's own block hashes serve only as opaque keys": the events' token_ids are what count.
    "precise-prefix-cache-producer-readme": (
        "llm-d/llm-d-router", "pkg/epp/framework/plugins/requestcontrol/dataproducer/preciseprefixcache/README.md",
        "0539d49a06867609f1dea495945e0c8fca439ec7"),
    # Per-pod discovery: SUB connects to tcp://<endpoint address>:<socketPort + rank>; the events are indexed
    # under the endpoint "<address>:<port>" (its source endpoint); podLabelSelector filters the endpoints.
    "precise-prefix-cache-discovery": (
        "llm-d/llm-d-router", "pkg/epp/framework/plugins/requestcontrol/dataproducer/preciseprefixcache/extractor.go",
        "0854a27dfafc990cc41b6c627ee681a089c0685c"),
    # kvEventsConfig and podDiscoveryConfig (json tags, defaults: topicFilter kv@, concurrency 4, discoverPods,
    # socketPort 5557, podLabelSelector llm-d.ai/inference-serving=true); a source endpoint overrides the
    # topic's pod id; AllBlocksCleared clears every entry of the pod; media are lower-cased.
    "kv-events-config": ("llm-d/llm-d-router", "pkg/kvevents/pool.go", "0557f29683fa67cf493aa5a4bf29f915809ff92c"),
    # Topic "kv@<pod-id>@<model-name>"; events as positional arrays or, since vllm-project/vllm#42892, maps
    # tagged by "type".
    "kv-events-vllm-adapter": ("llm-d/llm-d-router", "pkg/kvevents/engineadapter/vllm_adapter.go",
                               "0854a27dfafc990cc41b6c627ee681a089c0685c"),
    # tokenProcessorConfig: blockSize (deprecated) / blockSizeTokens (default 16), hashSeed, hashAlgorithm.
    "token-processor": ("llm-d/llm-d-router", "pkg/kvcache/kvblock/token_processor.go",
                        "140f7906662fd566c296bcb7823d50c4743bdee3"),
    # indexerConfig: kvBlockIndexConfig, kvCacheBackendConfigs, kvCacheDefaultBackendWeight, tokenizersPoolConfig.
    "indexer-config": ("llm-d/llm-d-router", "pkg/kvcache/indexer.go", "36da54d72db3fcd728d0a4b5c9a77a5bc7fc78ba"),
    # Medium weights {name, weight}: gpu 1.0, cpu 0.8 by default ...
    "backend-weights": ("llm-d/llm-d-router", "pkg/kvcache/backend.go", "36da54d72db3fcd728d0a4b5c9a77a5bc7fc78ba"),
    # ... and 1.0 (DefaultBackendWeight) for a medium not listed.
    "block-scorer": ("llm-d/llm-d-router", "pkg/kvcache/kvblock_scorer.go", "7624171c9331358bd5d841863e872b03634ccd9b"),
    "prefix-cache-scorer": ("llm-d/llm-d-router", "pkg/epp/framework/plugins/scheduling/scorer/prefix/plugin.go",
                            "068b68d08c44a311012602f9e051276c689ef9c3"),
    # modelName (required), vllm, udsTokenizerConfig (deprecated; not with vllm).
    "token-producer": ("llm-d/llm-d-router",
                       "pkg/epp/framework/plugins/requestcontrol/dataproducer/tokenizer/tokenizer.go",
                       "00e706e30f091db5101cf8228b9b45533eb52675"),
    # vllm.* parameters; /v1/completions/render and /v1/chat/completions/render; the request's Authorization
    # header is forwarded; VLLM_API_KEY authenticates the warmup probe.
    "token-producer-readme": ("llm-d/llm-d-router",
                              "pkg/epp/framework/plugins/requestcontrol/dataproducer/tokenizer/README.md",
                              "04c854a6dc0ff688e2c2884788e3375a5383b140"),
    # endpoint-notification-source: no parameters.
    "endpoint-notification-source": ("llm-d/llm-d-router",
                                     "pkg/epp/framework/plugins/datalayer/source/notifications/factory.go",
                                     "683100dc9f29744f61209af5d42336f15d228bdc"),
    # A producer + scorer + token-producer configuration of the router's own.
    "precise-prefix-cache-sample": ("llm-d/llm-d-router", "deploy/config/sim-epp-tokenizer-vllm-http-config.yaml",
                                    "03b2c3800bbfdb9473e8c8c5f31e00164d68fcb2"),
    # llm-d's guide: the router side (weights queue 2, KV 2, prefix 3; endpoint-notification-source feeding the
    # precise plugin) and the model-server side (topic kv@$(POD_IP):$(POD_PORT)@<model>, POD_IP from the
    # downward API, the ZMQ port declared as a container port named kv-events).
    "precise-routing-guide-router": ("llm-d/llm-d",
                                     "guides/precise-prefix-cache-routing/router/precise-prefix-cache-routing.values.yaml",
                                     "076e65dcd894907839be68cac7a4b235a1406166"),
    "precise-routing-guide-modelserver": (
        "llm-d/llm-d", "guides/precise-prefix-cache-routing/modelserver/gpu/vllm/base/patch-vllm.yaml",
        "34272a6415a3535960d205ff22d7dbac7e8c3e36"),
}
_STR = {"type": "string"}
_REF_LIST = {"type": "array", "items": {"type": "object", "additionalProperties": False, "required": ["pluginRef"],
                                        "properties": {"pluginRef": {"type": "string", "minLength": 1}}}}
# The EndpointPickerConfig the router reads with --config-file, decoded strictly (serializer.EnableStrict: an
# unknown field is an error). Top-level fields: those that apix/config v1alpha1 and v1 both have, so a config
# valid here loads in the releases before and after the v1 types. Plugin parameters are decoded by each
# plugin's factory; the two whose parameters this project sets are spelled out, closed (a misspelt key the
# router would silently ignore is an error here).
LLMD_ROUTER_CONFIG: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "plugins", "schedulingProfiles"],
    "properties": {
        # llm-d.ai/v1alpha1 (converted to v1 by the newer loader), llm-d.ai/v1; the old
        # inference.networking.x-k8s.io/v1alpha1 group is deprecated.
        "apiVersion": {"enum": ["llm-d.ai/v1alpha1", "llm-d.ai/v1"]},
        "kind": {"const": "EndpointPickerConfig"},
        "featureGates": {"type": "array", "items": _STR},
        "plugins": {"type": "array", "items": {"$ref": "#/$defs/plugin"}},
        "schedulingProfiles": {"type": "array", "items": {"$ref": "#/$defs/schedulingProfile"}},
        "dataLayer": {"$ref": "#/$defs/dataLayer"},
        "flowControl": {"type": "object"},
    },
    "$defs": {
        "plugin": {
            "type": "object",
            "additionalProperties": False,
            "required": ["type"],
            "properties": {"name": _STR, "type": {"type": "string", "minLength": 1}, "parameters": {"type": "object"}},
            "allOf": [
                {"if": {"properties": {"type": {"const": "metrics-data-source"}}},
                 "then": {"properties": {"parameters": {"$ref": "#/$defs/metricsDataSourceParameters"}}}},
                {"if": {"properties": {"type": {"const": "core-metrics-extractor"}}},
                 "then": {"properties": {"parameters": {"$ref": "#/$defs/coreMetricsExtractorParameters"}}}},
                {"if": {"properties": {"type": {"const": "token-producer"}}},
                 "then": {"required": ["parameters"],
                          "properties": {"parameters": {"$ref": "#/$defs/tokenProducerParameters"}}}},
                {"if": {"properties": {"type": {"const": "precise-prefix-cache-producer"}}},
                 "then": {"properties": {"parameters": {"$ref": "#/$defs/precisePrefixCacheProducerParameters"}}}},
                {"if": {"properties": {"type": {"const": "prefix-cache-scorer"}}},
                 "then": {"properties": {"parameters": {"$ref": "#/$defs/prefixCacheScorerParameters"}}}},
                # Its factory reads no parameters.
                {"if": {"properties": {"type": {"const": "endpoint-notification-source"}}},
                 "then": {"not": {"required": ["parameters"]}}},
            ],
        },
        "schedulingProfile": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "plugins"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "plugins": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False, "required": ["pluginRef"],
                    "properties": {"pluginRef": {"type": "string", "minLength": 1}, "weight": {"type": "number"}}}},
            },
        },
        "dataLayer": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "injectDefaults": {"type": "boolean"},
                "sources": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False, "required": ["pluginRef", "extractors"],
                    "properties": {"pluginRef": {"type": "string", "minLength": 1}, "extractors": _REF_LIST}}},
            },
        },
        "metricsDataSourceParameters": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "scheme": {"enum": ["http", "https"]},
                "path": {"type": "string", "pattern": "^/"},
                "port": {"type": "integer", "minimum": 0, "maximum": 65535},
                "insecureSkipVerify": {"type": "boolean"},
                "caCertPath": _STR,
                "clientCertPath": _STR,
                "clientKeyPath": _STR,
                "interval": _STR,
            },
        },
        "coreMetricsExtractorParameters": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "engineLabelKey": _STR,
                "defaultEngine": _STR,
                "engineConfigs": {"type": "array", "items": {"$ref": "#/$defs/engineConfig"}},
            },
        },
        # A metric spec is a PromQL instant vector selector, name or name{label=value,...}; empty: not read.
        "engineConfig": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                **{key: _STR for key in (
                    "queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "loraLoadedSpec",
                    "loraGPULoadedSpec", "loraGPUSlotsSpec", "cacheInfoSpec", "cacheBlockSizeLabelName",
                    "cacheNumBlocksLabelName", "cacheBlockSizeSpec", "cacheNumBlocksSpec")},
                "customMetrics": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False, "required": ["attributeKey", "metricSpec"],
                    "properties": {"attributeKey": _STR, "metricSpec": _STR}}},
            },
        },
        # token-producer (tokenizer.go, README.md): modelName is required; the vllm backend posts to a server's
        # /v1/completions/render and /v1/chat/completions/render, at one url or at the endpoints discovery
        # supplies (not both); udsTokenizerConfig is the deprecated sidecar backend, not with vllm. No estimate
        # backend here: its pseudo-tokens never match an engine's blocks.
        "tokenProducerParameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["modelName"],
            "properties": {
                "modelName": {"type": "string", "minLength": 1},
                "vllm": {"$ref": "#/$defs/vllmRenderer"},
                "udsTokenizerConfig": {"type": "object"},
            },
            "not": {"required": ["vllm", "udsTokenizerConfig"]},
        },
        "vllmRenderer": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "url": {"type": "string", "pattern": "^https?://[^/]+$"},
                "endpointDiscovery": {"type": "object"},
                "messagesRenderMode": {"enum": ["auto", "native", "legacy"]},
                "prefillOnly": {"type": "boolean"},
                "timeout": {"$ref": "#/$defs/duration"},
                "mmTimeout": {"$ref": "#/$defs/duration"},
                "caCertPath": _STR,
                "clientCertPath": _STR,
                "clientKeyPath": _STR,
                "insecureSkipVerify": {"type": "boolean"},
            },
            "not": {"required": ["url", "endpointDiscovery"]},
        },
        # A Go duration string (time.ParseDuration), e.g. 2s, 500ms, 1m30s.
        "duration": {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"},
        # precise-prefix-cache-producer (producer.go, README.md): tokens-only, so indexerConfig takes no
        # tokenizersPoolConfig (the factory refuses it).
        "precisePrefixCacheProducerParameters": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "sessionManager": {"type": "string", "minLength": 1},
                "tokenProcessorConfig": {"$ref": "#/$defs/tokenProcessorConfig"},
                "indexerConfig": {"$ref": "#/$defs/indexerConfig"},
                "kvEventsConfig": {"$ref": "#/$defs/kvEventsConfig"},
                "speculativeIndexing": {"type": "boolean"},
                "speculativeTTL": {"$ref": "#/$defs/duration"},
            },
        },
        # token_processor.go: blockSize is the deprecated name of blockSizeTokens (which wins when both are
        # set); 0 or absent means 16.
        "tokenProcessorConfig": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "blockSize": {"type": "integer", "minimum": 1},
                "blockSizeTokens": {"type": "integer", "minimum": 1},
                "hashSeed": _STR,
                "hashAlgorithm": {"enum": ["cbor-fnv", "xxh64"]},
            },
        },
        # indexer.go, backend.go: the medium weights are {name, weight}, name the event's medium lower-cased.
        "indexerConfig": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "kvBlockIndexConfig": {"type": "object"},
                "kvCacheBackendConfigs": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False, "required": ["name", "weight"],
                    "properties": {"name": {"type": "string", "pattern": "^[a-z0-9-]+$"},
                                   "weight": {"type": "number", "minimum": 0}}}},
                "kvCacheDefaultBackendWeight": {"type": "number", "minimum": 0},
            },
        },
        # pool.go: Config and PodDiscoveryConfig.
        "kvEventsConfig": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "zmqEndpoint": {"type": "string", "pattern": "^tcp://"},
                "topicFilter": _STR,
                "concurrency": {"type": "integer", "minimum": 1},
                "engineType": {"enum": ["vllm", "sglang"]},
                "tracing": {"type": "boolean"},
                "discoverPods": {"type": "boolean"},
                "podDiscoveryConfig": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "podLabelSelector": _STR,
                        "podNamespace": _STR,
                        "socketPort": {"type": "integer", "minimum": 1, "maximum": 65535},
                        "replaySocketPort": {"type": "integer", "maximum": 65535},
                    },
                },
            },
        },
        # prefix/plugin.go: prefixLengthWeight in [0, 1], and above 0 it needs maxModelLen (> 0).
        "prefixCacheScorerParameters": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "prefixMatchInfoProducerName": {"type": "string", "minLength": 1},
                "prefixLengthWeight": {"type": "number", "minimum": 0, "maximum": 1},
                "maxModelLen": {"type": "integer", "minimum": 1},
            },
            "if": {"required": ["prefixLengthWeight"],
                   "properties": {"prefixLengthWeight": {"exclusiveMinimum": 0}}},
            "then": {"required": ["maxModelLen"]},
        },
    },
}
# The extractor's defaults (factories.go): the pod label that names the engine, and the engine read when
# a pod has none.
LLMD_ENGINE_LABEL_KEY = "llm-d.ai/engine-type"
LLMD_DEFAULT_ENGINE = "vllm"
# Metric flags of the old endpoint picker, "deprecated and cannot be used; configure metrics via
# engineConfigs" (options.go, Validate): setting one stops the router.
LLMD_REJECTED_FLAGS = ["total-queued-requests-metric", "total-running-requests-metric",
                       "kv-cache-usage-percentage-metric", "lora-info-metric", "cache-info-metric"]
# Plugin types registered by the router that this project's config may name (seen in the router's own
# configs: the chart's default config and deploy/config/epp-config.yaml).
LLMD_PLUGIN_TYPES = ["queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer", "max-score-picker",
                     "single-profile-handler", "metrics-data-source", "core-metrics-extractor",
                     # precise prefix-cache routing (precise-prefix-cache-sample, precise-routing-guide-router)
                     "token-producer", "precise-prefix-cache-producer", "endpoint-notification-source"]
# What the precise-prefix-cache-producer expects of a model server's KV events, and its defaults (sources:
# precise-prefix-cache-discovery, kv-events-config, kv-events-vllm-adapter, token-processor, backend-weights,
# block-scorer).
LLMD_KV_EVENTS = {
    # The producer dials tcp://<endpoint address>:<socketPort + rank index> (rank 0 for a pool with one target
    # port) and indexes what arrives under "<endpoint address>:<endpoint port>"; a version without that source
    # endpoint takes the pod id from the topic instead, so the topic names the same "<pod IP>:<port>".
    "topic": "kv@{address}:{port}@{model}",
    "topicSeparator": "@",
    "defaultTopicFilter": "kv@",
    "defaultSocketPort": 5557,
    "defaultConcurrency": 4,
    "defaultBlockSize": 16,
    # Endpoints whose labels this selector does not match get no subscriber.
    "defaultPodLabelSelector": "llm-d.ai/inference-serving=true",
    # Media as indexed: the event's medium lower-cased ("" counts as gpu).
    "defaultMediumWeights": {"gpu": 1.0, "cpu": 0.8},
    "defaultUnlistedMediumWeight": 1.0,
}


def vendor_llm_d_router() -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": "The llm-d router's EndpointPickerConfig and the parameters of the metrics and precise "
        "prefix-cache plugins, transcribed from the Go types of the sources listed (repo, path, commit) by "
        "tests/deploy/vendor_schemas.py --llm-d-router",
        "sources": {key: {"repo": r, "path": p, "commit": c} for key, (r, p, c) in LLMD_ROUTER_SOURCES.items()},
        "config": LLMD_ROUTER_CONFIG,
        "engineLabelKey": LLMD_ENGINE_LABEL_KEY,
        "defaultEngine": LLMD_DEFAULT_ENGINE,
        "rejectedFlags": LLMD_REJECTED_FLAGS,
        "pluginTypes": LLMD_PLUGIN_TYPES,
        "kvEvents": LLMD_KV_EVENTS,
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["--gaie"]:
        out = vendor_gaie(Path(argv[1]))
        (HERE / GAIE_FILE).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        return 0
    if argv[:1] == ["--llm-d-router"]:
        (HERE / LLMD_ROUTER_FILE).write_text(json.dumps(vendor_llm_d_router(), indent=1, sort_keys=True) + "\n")
        return 0
    compose_wheel, k8s_wheel = (Path(a) for a in argv)
    with zipfile.ZipFile(compose_wheel) as zf:
        (HERE / "compose-spec.json").write_bytes(zf.read("compose/config/compose_spec.json"))
    (HERE / "k8s-schema.json").write_text(json.dumps(vendor_k8s(k8s_wheel), indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
