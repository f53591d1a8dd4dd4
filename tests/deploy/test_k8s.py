"""deploy/k8s/*.yaml: strict Kubernetes schemas, then how the pieces refer to each other.

``k8s-schema.json`` here is cut from the strict Kubernetes v1.37.0 schemas that
the PyPI package ``kubernetes-validate==1.37.0`` ships (each kind this folder
uses plus every definition it reaches; ``vendor_schemas.py`` rebuilds it), so
the test runs offline and rejects unknown fields as ``kubectl --validate=strict``
does.

The workers' StatefulSet and NetworkPolicy (``workers.yaml``) are not in that cut yet: ``vendor_schemas.py``
lists them, and until it is rerun with the wheel (not possible offline) they are validated by ``STAND_INS``
below, hand-written top levels in the same strict form that refer to the vendored definitions for
everything under them (the pod template, label selectors, object metadata). Then the worker command is run
for real and its probes asked.
"""

from __future__ import annotations

import copy
import json
import os
import re
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from service.settings import Settings
from tests.deploy.conftest import running_worker, worker_args, worker_ports

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
K8S = ROOT / "deploy" / "k8s"
PENDING_SETTINGS = {"api_key_file": None, "drain_timeout_s": 30, "rpc_workers": None}
WORKERS = K8S / "workers.yaml"
WORKER_NODE_LABEL = "gguf-fit-server/worker"


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        with path.open(encoding="utf-8") as fh:
            docs += [(path.name, d) for d in yaml.safe_load_all(fh) if d is not None]
    return docs


@pytest.fixture(scope="module")
def schemas() -> dict[str, Any]:
    return json.loads((HERE / "k8s-schema.json").read_text(encoding="utf-8"))


def _nullable(kind: str) -> list[str]:
    return [kind, "null"]


_INT32 = {"format": "int32", "type": _nullable("integer")}
_STR = {"type": _nullable("string")}
_SELECTOR = {"$ref": "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector"}
_INT_OR_STRING = {"$ref": "#/$defs/io.k8s.apimachinery.pkg.util.intstr.IntOrString"}


def _closed(properties: dict[str, Any], required: tuple[str, ...] = (), top: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"additionalProperties": False, "properties": properties,
                           "type": "object" if top else _nullable("object")}
    if required:
        out["required"] = list(required)
    return out


def _top(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _closed({"apiVersion": {"enum": [api_version], "type": _nullable("string")},
                    "kind": {"enum": [kind], "type": _nullable("string")},
                    "metadata": {"$ref": "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"},
                    "spec": spec}, ("spec",), top=True)


_PEER = _closed({"ipBlock": _closed({"cidr": {"type": "string"}, "except": {"items": _STR, "type": _nullable("array")}},
                                    ("cidr",)),
                 "namespaceSelector": _SELECTOR, "podSelector": _SELECTOR})
_NP_PORT = _closed({"endPort": _INT32, "port": _INT_OR_STRING,
                    "protocol": {"enum": ["TCP", "UDP", "SCTP"], "type": _nullable("string")}})
# Hand-written stand-ins for the kinds the vendored cut lacks (see the module's docstring): the fields of
# apps/v1 StatefulSetSpec and networking.k8s.io/v1 NetworkPolicySpec, closed like the strict schemas, with the
# enums the API server enforces; no status (a manifest has none). serviceName is required, as in v1.30's schema.
STAND_INS: dict[str, dict[str, Any]] = {
    "StatefulSet": _top("apps/v1", "StatefulSet", _closed({
        "minReadySeconds": _INT32,
        "ordinals": _closed({"start": _INT32}),
        "persistentVolumeClaimRetentionPolicy": _closed({"whenDeleted": {"enum": ["Retain", "Delete"], **_STR},
                                                         "whenScaled": {"enum": ["Retain", "Delete"], **_STR}}),
        "podManagementPolicy": {"enum": ["OrderedReady", "Parallel"], **_STR},
        "replicas": _INT32,
        "revisionHistoryLimit": _INT32,
        "selector": _SELECTOR,
        "serviceName": _STR,
        "template": {"$ref": "#/$defs/io.k8s.api.core.v1.PodTemplateSpec"},
        "updateStrategy": _closed({
            "rollingUpdate": _closed({"maxUnavailable": _INT_OR_STRING, "partition": _INT32}),
            "type": {"enum": ["RollingUpdate", "OnDelete"], **_STR},
        }),
        "volumeClaimTemplates": {"items": _closed({
            "apiVersion": _STR, "kind": _STR,
            "metadata": {"$ref": "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"},
            "spec": {"$ref": "#/$defs/io.k8s.api.core.v1.PersistentVolumeClaimSpec"},
        }), "type": _nullable("array")},
    }, ("selector", "template", "serviceName"))),
    "NetworkPolicy": _top("networking.k8s.io/v1", "NetworkPolicy", _closed({
        "egress": {"items": _closed({"ports": {"items": _NP_PORT, "type": _nullable("array")},
                                     "to": {"items": _PEER, "type": _nullable("array")}}),
                   "type": _nullable("array")},
        "ingress": {"items": _closed({"from": {"items": _PEER, "type": _nullable("array")},
                                      "ports": {"items": _NP_PORT, "type": _nullable("array")}}),
                    "type": _nullable("array")},
        "podSelector": _SELECTOR,
        "policyTypes": {"items": {"enum": ["Ingress", "Egress"], "type": "string"}, "type": _nullable("array")},
    })),
}


def _validator(schemas: dict[str, Any], kind: str) -> jsonschema.protocols.Validator:
    top = schemas["kinds"].get(kind, STAND_INS.get(kind))
    assert top is not None, f"no vendored schema for {kind}: add it in vendor_schemas.py"
    schema = {**top, "$defs": schemas["$defs"]}
    return jsonschema.Draft202012Validator(schema)


def _errors(schemas: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _validator(schemas, doc["kind"]).iter_errors(doc)]


@pytest.fixture(scope="module")
def by_kind() -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for _, doc in _manifests():
        out.setdefault(doc["kind"], []).append(doc)
    return out


@pytest.mark.parametrize("name,doc", _manifests(), ids=[f"{n}:{d['kind']}" for n, d in _manifests()])
def test_manifest_is_valid(schemas: dict[str, Any], name: str, doc: dict[str, Any]) -> None:
    assert _errors(schemas, doc) == []


def test_schema_is_strict(schemas: dict[str, Any], by_kind: dict[str, list[dict[str, Any]]]) -> None:
    bad = copy.deepcopy(by_kind["Deployment"][0])
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/ready"
    assert _errors(schemas, bad), "an unknown field must be rejected"
    bad = copy.deepcopy(by_kind["Deployment"][0])
    bad["spec"]["replicas"] = "one"
    assert _errors(schemas, bad)


def test_kinds_present(by_kind: dict[str, list[dict[str, Any]]]) -> None:
    assert {"Deployment", "Service", "PersistentVolumeClaim", "StatefulSet", "NetworkPolicy"} <= set(by_kind)
    assert len(by_kind["Deployment"]) == 1


def test_stand_ins_refer_to_vendored_definitions_and_are_strict(schemas: dict[str, Any],
                                                                by_kind: dict[str, list[dict[str, Any]]]) -> None:
    refs = set(re.findall(r'"\$ref": "#/\$defs/([^"]+)"', json.dumps(STAND_INS)))
    assert refs and refs <= set(schemas["$defs"]), refs - set(schemas["$defs"])
    (sts,) = by_kind["StatefulSet"]
    (policy,) = by_kind["NetworkPolicy"]
    for doc, path, value in [
        (sts, ("spec", "replica"), 2),  # misspelt
        (sts, ("spec", "replicas"), "two"),
        (sts, ("spec", "podManagementPolicy"), "parallel"),
        (sts, ("spec", "template", "spec", "containers", 0, "livenessProbe", "httpGet", "paht"), "/status"),
        (sts, ("spec", "template", "spec", "hostNetwrok"), True),
        (policy, ("spec", "ingress", 0, "from", 0, "podSelecter"), {}),
        (policy, ("spec", "ingress", 0, "ports", 0, "protocol"), "tcp"),
        (policy, ("spec", "policyTypes"), ["ingress"]),
        (policy, ("spec", "podSelector", "matchLabel"), {}),
    ]:
        bad = copy.deepcopy(doc)
        node: Any = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert _errors(schemas, bad), f"{doc['kind']} {path}={value!r} must be rejected"


def _named(by_kind: dict[str, list[dict[str, Any]]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in by_kind[kind] if d["metadata"]["name"] == name]
    return doc


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def test_deployment_gpu_probes_and_port(by_kind: dict[str, list[dict[str, Any]]]) -> None:
    (deployment,) = by_kind["Deployment"]
    container = _container(deployment)
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = _env(container)
    assert env["GGUF_HOST"] == "0.0.0.0"
    assert ports["http"] == int(env["GGUF_PORT"])
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        if probe in container:
            assert container[probe]["httpGet"]["port"] in (ports["http"], "http")
    if "startupProbe" in container:
        assert container["startupProbe"]["httpGet"]["path"] == "/health", "readiness, not startup, waits for the model"


def test_models_pvc_and_api_key_secret(by_kind: dict[str, list[dict[str, Any]]]) -> None:
    (deployment,) = by_kind["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    env = _env(container)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}

    models_mount = mounts[env["GGUF_MODELS_DIR"]]
    assert models_mount.get("readOnly") is True
    claim = volumes[models_mount["name"]]["persistentVolumeClaim"]["claimName"]
    assert claim in {p["metadata"]["name"] for p in by_kind["PersistentVolumeClaim"]}

    key_file = env["GGUF_API_KEY_FILE"]
    key_dir, _, key_name = key_file.rpartition("/")
    secret_volume = volumes[mounts[key_dir]["name"]]["secret"]
    assert secret_volume["secretName"]
    assert key_name in {item["path"] for item in secret_volume["items"]}
    assert "GGUF_API_KEY" not in env, "the key comes from the Secret, not a plain env value"

    hf_home = env["HF_HOME"]
    assert any(hf_home.startswith(path.rstrip("/") + "/") and not m.get("readOnly") for path, m in mounts.items())


def test_security_and_shutdown(by_kind: dict[str, list[dict[str, Any]]]) -> None:
    (deployment,) = by_kind["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    users = set(re.findall(r"^USER\s+(\d+)", dockerfile, re.MULTILINE))
    assert users == {str(pod["securityContext"]["runAsUser"])}, "the pod's user is the image's"
    drain = Settings.model_fields.get("drain_timeout_s")
    drain_s = drain.default if drain is not None else PENDING_SETTINGS["drain_timeout_s"]
    assert pod["terminationGracePeriodSeconds"] >= drain_s + 5


def test_service_selects_the_pods(by_kind: dict[str, list[dict[str, Any]]]) -> None:
    (deployment,) = by_kind["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    container_ports = {p["name"]: p["containerPort"] for p in _container(deployment)["ports"]}
    service = _named(by_kind, "Service", deployment["metadata"]["name"])
    assert service["spec"]["selector"].items() <= labels.items()
    for port in service["spec"]["ports"]:
        target = port["targetPort"]
        assert target in container_ports or target in container_ports.values()


def test_configmap_holds_settings(by_kind: dict[str, list[dict[str, Any]]]) -> None:
    known = {f"GGUF_{n.upper()}" for n in [*Settings.model_fields, *PENDING_SETTINGS]}
    (deployment,) = by_kind["Deployment"]
    refs = {e["configMapRef"]["name"] for e in _container(deployment).get("envFrom", []) if "configMapRef" in e}
    maps = {c["metadata"]["name"]: c for c in by_kind.get("ConfigMap", [])}
    assert refs <= set(maps)
    for name in refs:
        unknown = set(maps[name]["data"]) - known
        assert not unknown, f"ConfigMap {name}: {unknown} are not settings"
        assert all(isinstance(v, str) for v in maps[name]["data"].values())
        # A setting the pod fixes (paths, bind address) must not be overridable from the ConfigMap by accident.
        assert not set(maps[name]["data"]) & set(_env(_container(deployment)))


def test_the_service_accepts_the_pod_environment(by_kind: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [k for k in os.environ if k.startswith("GGUF_")]:
        monkeypatch.delenv(var)
    (deployment,) = by_kind["Deployment"]
    container = _container(deployment)
    maps = {c["metadata"]["name"]: c["data"] for c in by_kind.get("ConfigMap", [])}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]])
    env.update(_env(container))  # env wins over envFrom, as in Kubernetes
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    settings = Settings()
    assert (settings.host, settings.port, settings.models_dir) == ("0.0.0.0", 8000, "/models")


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels and matchExpressions) selects these labels; empty selects all."""
    if not (selector.get("matchLabels") or {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _workers(by_kind: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The worker StatefulSet and its one container."""
    (sts,) = by_kind["StatefulSet"]
    return sts, _container(sts)


def _worker_argv(container: dict[str, Any]) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def _pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def _port_number(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port (a number or a container port's name) as a number."""
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    return named[port] if isinstance(port, str) else port


def test_workers_run_the_worker_on_the_ports_they_declare(by_kind: dict[str, list[dict[str, Any]]]) -> None:
    _, container = _workers(by_kind)
    args = worker_args(_worker_argv(container))
    host, _, _ = args["--listen"].rpartition(":")
    assert host == "0.0.0.0" and args.get("--allow-public") is True, "reachable from the server's pods"
    rpc, status = worker_ports(args)
    ports = {p["containerPort"]: p for p in container["ports"]}
    assert set(ports) == {rpc, status}
    assert all(p.get("protocol", "TCP") == "TCP" for p in ports.values())
    assert status == rpc + 1, "GGUF_RPC_WORKERS names the RPC port; the server reads /status on the next"
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/status", probe
        assert _port_number(container, get["port"]) == status, f"{probe}: the status port"
    assert "startupProbe" not in container or container["startupProbe"]["httpGet"]["path"] == "/status"

    # /proc/meminfo in a container is the node's: the budget must stay under the container's limit.
    limit = container["resources"]["limits"]["memory"]
    m = re.fullmatch(r"(\d+)(Gi|Mi)", limit)
    assert m, f"memory limit {limit}: expected Gi or Mi"
    limit_mib = int(m.group(1)) * (1024 if m.group(2) == "Gi" else 1)
    assert 0 < float(args["--memory-mib"]) <= limit_mib - 1024, "--memory-mib leaves 1 GiB of the limit to the process"

    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    cache = [path for path in mounts if args["--cache-dir"].startswith(path.rstrip("/") + "/")]
    assert cache and not mounts[cache[0]].get("readOnly"), "--cache-dir on a writable volume"


def test_one_worker_per_labelled_node_with_a_stable_name(by_kind: dict[str, list[dict[str, Any]]]) -> None:
    sts, container = _workers(by_kind)
    labels = _pod_labels(sts)
    assert _matches(sts["spec"]["selector"], labels)
    pod = sts["spec"]["template"]["spec"]
    assert pod["nodeSelector"][WORKER_NODE_LABEL] == "true"
    assert not pod.get("hostNetwork"), "on the pod network, where the NetworkPolicy applies"
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and _matches(term["labelSelector"], labels), \
        "two workers on one node would lend its devices twice"

    # The headless Service that names each pod: <statefulset>-<i>.<serviceName>.
    service = _named(by_kind, "Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert _matches({"matchLabels": service["spec"]["selector"]}, labels)
    args = worker_args(_worker_argv(container))
    rpc, status = worker_ports(args)
    assert {_port_number(container, p["targetPort"]) for p in service["spec"]["ports"]} == {rpc, status}

    # Neither the server's Service nor its Deployment's selector (nor the InferencePool's) picks up workers.
    (deployment,) = by_kind["Deployment"]
    server_service = _named(by_kind, "Service", deployment["metadata"]["name"])
    assert not _matches({"matchLabels": server_service["spec"]["selector"]}, labels)
    assert not _matches(deployment["spec"]["selector"], labels)
    pool_docs = yaml.safe_load_all((K8S / "inference-gateway" / "pool.yaml").read_text(encoding="utf-8"))
    pools = [d for d in pool_docs if d and d["kind"] == "InferencePool"]
    assert pools and not any(_matches(p["spec"]["selector"], labels) for p in pools)

    assert pod["securityContext"]["runAsNonRoot"] is True
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    assert {str(pod["securityContext"]["runAsUser"])} == set(re.findall(r"^USER\s+(\d+)", dockerfile, re.MULTILINE))
    assert int(container["resources"]["limits"].get("nvidia.com/gpu", 0)) >= 1 or container["image"].endswith(":cpu"), \
        "the CUDA image needs a card"


def test_network_policy_admits_only_the_server(by_kind: dict[str, list[dict[str, Any]]]) -> None:
    sts, container = _workers(by_kind)
    (policy,) = by_kind["NetworkPolicy"]
    spec = policy["spec"]
    worker_labels = _pod_labels(sts)
    (deployment,) = by_kind["Deployment"]
    server_labels = _pod_labels(deployment)
    # Every other pod of this application (the endpoint picker of deploy/k8s/inference-gateway/, ...).
    workloads = [d for path in K8S.rglob("*.yaml") for d in yaml.safe_load_all(path.read_text(encoding="utf-8"))
                 if d and d.get("kind") in ("Deployment", "StatefulSet")]
    others = [_pod_labels(d) for d in workloads if _pod_labels(d) not in (server_labels, worker_labels)]
    assert others, "the endpoint picker's pods, at least"

    assert _matches(spec["podSelector"], worker_labels) and spec["podSelector"], "selects the workers"
    assert not _matches(spec["podSelector"], server_labels)
    assert "Ingress" in spec["policyTypes"]
    rpc, status = worker_ports(worker_args(_worker_argv(container)))
    admitted: set[int] = set()
    assert spec["ingress"], "without an ingress rule not even the server reaches the workers"
    for rule in spec["ingress"]:
        assert rule.get("from"), "a rule without from admits every source"
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, "pods of this namespace only: no namespaceSelector, no ipBlock"
            assert peer["podSelector"], "an empty podSelector admits every pod of the namespace"
            assert _matches(peer["podSelector"], server_labels), "the server's pods"
            assert not _matches(peer["podSelector"], worker_labels)
            assert not any(_matches(peer["podSelector"], o) for o in others), "only the server's pods"
        assert rule.get("ports"), "a rule without ports admits every port"
        for port in rule["ports"]:
            assert port.get("protocol", "TCP") == "TCP"
            admitted.add(_port_number(container, port["port"]))
    assert admitted == {rpc, status}, "the RPC port and /status, nothing else"


def test_configmap_example_names_the_worker_pods(by_kind: dict[str, list[dict[str, Any]]]) -> None:
    """GGUF_RPC_WORKERS stays commented in the ConfigMap (no workers unless deployed); its example names the
    StatefulSet's pods by their stable names (ordinals from 0), with the RPC port."""
    sts, container = _workers(by_kind)
    text = (K8S / "configmap.yaml").read_text(encoding="utf-8")
    (line,) = re.findall(r"^\s*#\s*GGUF_RPC_WORKERS:\s*(\S+)\s*$", text, re.MULTILINE)
    rpc, _ = worker_ports(worker_args(_worker_argv(container)))
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    entries = line.split(",")
    assert entries == [f"{name}-{i}.{service}:{rpc}" for i in range(len(entries))]


def test_the_worker_container_runs_and_answers_its_probes(by_kind: dict[str, list[dict[str, Any]]],
                                                          tmp_path: Path) -> None:
    """The container's command as written starts the real worker; each probe's path answers 200 on the port the
    probe names (moved to loopback)."""
    _, container = _workers(by_kind)
    argv = _worker_argv(container)
    _, status = worker_ports(worker_args(argv))
    with running_worker(argv, tmp_path / "rpc") as (_, live_status):
        for probe in ("readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert _port_number(container, get["port"]) == status
            with urllib.request.urlopen(f"http://127.0.0.1:{live_status}{get['path']}", timeout=5) as r:
                assert r.status == 200, probe
