"""deploy/k8s/*.yaml: strict Kubernetes schemas, then how the pieces refer to each other.

``k8s-schema.json`` here is cut from the strict Kubernetes v1.37.0 schemas that
the PyPI package ``kubernetes-validate==1.37.0`` ships (each kind this folder
uses plus every definition it reaches; ``vendor_schemas.py`` rebuilds it), so
the test runs offline and rejects unknown fields as ``kubectl --validate=strict``
does.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
K8S = ROOT / "deploy" / "k8s"
PENDING_SETTINGS = {"api_key_file": None, "drain_timeout_s": 30}


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        with path.open(encoding="utf-8") as fh:
            docs += [(path.name, d) for d in yaml.safe_load_all(fh) if d is not None]
    return docs


@pytest.fixture(scope="module")
def schemas() -> dict[str, Any]:
    return json.loads((HERE / "k8s-schema.json").read_text(encoding="utf-8"))


def _validator(schemas: dict[str, Any], kind: str) -> jsonschema.protocols.Validator:
    assert kind in schemas["kinds"], f"no vendored schema for {kind}: add it in vendor_schemas.py"
    schema = {**schemas["kinds"][kind], "$defs": schemas["$defs"]}
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
    assert {"Deployment", "Service", "PersistentVolumeClaim"} <= set(by_kind)
    assert len(by_kind["Deployment"]) == 1


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
    (service,) = by_kind["Service"]
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
