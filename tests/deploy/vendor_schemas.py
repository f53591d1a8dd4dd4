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
- ``gaie-v1.0.0-schema.json``: the Gateway API Inference Extension's custom resources that
  ``deploy/k8s/inference-gateway.yaml`` uses (InferencePool ``inference.networking.k8s.io/v1``,
  InferenceObjective ``inference.networking.x-k8s.io/v1alpha2``), converted from the
  ``openAPIV3Schema`` of the CRDs of release v1.0.0 (``config/crd`` of
  kubernetes-sigs/gateway-api-inference-extension at tag v1.0.0, Apache-2.0; the text used was the
  ``kubectl kustomize`` output that istio/istio keeps in
  ``tests/integration/pilot/testdata/gateway-api-inference-extension-crd.yaml``, commit
  0e89fc80e42b600216a19bea314b08e944bb16ac, annotated ``bundle-version: v1.0.0``). The conversion
  (``crd_to_json_schema``) closes every object that lists its properties (the API server prunes
  unknown fields and ``kubectl --validate=strict`` rejects them) and turns the one CEL rule of that
  release into JSON Schema; an unknown CEL rule stops it.

Usage (needs the two wheels, e.g. ``pip download --no-deps docker-compose==1.29.2
kubernetes-validate==1.37.0``, and the CRDs, e.g. ``kubectl kustomize
"https://github.com/kubernetes-sigs/gateway-api-inference-extension/config/crd/?ref=v1.0.0"``)::

    python tests/deploy/vendor_schemas.py DOCKER_COMPOSE_WHEEL KUBERNETES_VALIDATE_WHEEL
    python tests/deploy/vendor_schemas.py --gaie CRDS_YAML
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


GAIE_VERSION = "v1.0.0"
GAIE_FILE = f"gaie-{GAIE_VERSION}-schema.json"
GAIE_KINDS = {("inference.networking.k8s.io", "v1", "InferencePool"),
              ("inference.networking.x-k8s.io", "v1alpha2", "InferenceObjective")}
# The CEL rules (x-kubernetes-validations) of the vendored release, as JSON Schema. A rule not listed
# here stops the conversion: each must be translated by hand, and tested (tests/deploy/test_inference_gateway.py).
CEL_RULES = {
    # endpointPickerRef: port is required when kind is 'Service' or unspecified (kind defaults to Service).
    "self.kind != 'Service' || has(self.port)": {
        "if": {"anyOf": [{"not": {"required": ["kind"]}}, {"properties": {"kind": {"const": "Service"}}}]},
        "then": {"required": ["port"]},
    },
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
        bundle = doc["metadata"].get("annotations", {}).get("inference.networking.k8s.io/bundle-version")
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
        "$comment": f"Gateway API Inference Extension {GAIE_VERSION} CRDs (config/crd at tag {GAIE_VERSION}), "
        "openAPIV3Schema converted by tests/deploy/vendor_schemas.py --gaie; keys: group/version/kind",
        "version": GAIE_VERSION,
        "kinds": kinds,
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["--gaie"]:
        out = vendor_gaie(Path(argv[1]))
        (HERE / GAIE_FILE).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        return 0
    compose_wheel, k8s_wheel = (Path(a) for a in argv)
    with zipfile.ZipFile(compose_wheel) as zf:
        (HERE / "compose-spec.json").write_bytes(zf.read("compose/config/compose_spec.json"))
    (HERE / "k8s-schema.json").write_text(json.dumps(vendor_k8s(k8s_wheel), indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
