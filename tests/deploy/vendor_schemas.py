"""Rebuild the vendored schemas in this folder (run by hand; not a test).

The tests must run offline, so the schemas they validate against live here:

- ``compose-spec.json``: the Compose Specification JSON schema exactly as the
  PyPI package ``docker-compose==1.29.2`` ships it
  (``compose/config/compose_spec.json``, Apache-2.0).
- ``k8s-schema.json``: the kinds this project deploys (Deployment, Service,
  PersistentVolumeClaim, ConfigMap) cut from the strict Kubernetes v1.37.0
  schemas that the PyPI package ``kubernetes-validate==1.37.0`` ships
  (``kubernetes-json-schema/v1.37.0-local-strict``, Apache-2.0): each kind's
  top-level schema plus every definition it reaches, descriptions dropped.

Usage (needs the two wheels, e.g. ``pip download --no-deps docker-compose==1.29.2
kubernetes-validate==1.37.0``)::

    python tests/deploy/vendor_schemas.py DOCKER_COMPOSE_WHEEL KUBERNETES_VALIDATE_WHEEL
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


def main(argv: list[str]) -> int:
    compose_wheel, k8s_wheel = (Path(a) for a in argv)
    with zipfile.ZipFile(compose_wheel) as zf:
        (HERE / "compose-spec.json").write_bytes(zf.read("compose/config/compose_spec.json"))
    (HERE / "k8s-schema.json").write_text(json.dumps(vendor_k8s(k8s_wheel), indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
