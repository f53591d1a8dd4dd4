"""The deployment and architecture docs name files that exist, and the ports and users the manifests use."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["docs/architecture.md", "docs/deployment.md"]
# Named in the docs but not files of the repository: one the user creates, one a kubectl resource.
NOT_FILES = {"deploy/secrets/api_key", "service/gguf-fit-server"}
_PATH = re.compile(r"\b((?:sizing|service|deploy|docs|tests)/[\w./-]*\w/?|Dockerfile|docker-compose\.yml)\b")


@pytest.mark.parametrize("doc", DOCS)
def test_named_files_exist(doc: str) -> None:
    text = (ROOT / doc).read_text(encoding="utf-8")
    named = set(_PATH.findall(text))
    assert len(named) >= 5, f"{doc} names too few files: {named}"
    missing = sorted(p for p in named - NOT_FILES if not (ROOT / p).exists())
    assert not missing, f"{doc} names files that do not exist: {missing}"


def test_architecture_covers_each_step_and_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert "probe -> plan -> load -> serve" in text
    for module in ("kv.py", "compute.py", "estimate.py", "fit.py", "placement.py", "planner.py", "devices.py",
                   "sizing/probe/", "service/engine/", "service/catalog/models.py", "service/api/"):
        assert module in text, module
    # Bare module names in the picture are the pure core's, under sizing/.
    for bare in set(re.findall(r"(?<![/\w])(\w+\.py)\b", text)):
        assert (ROOT / "sizing" / bare).exists() or list(ROOT.glob(f"*/**/{bare}")), bare
    assert "```" in text, "the picture"


def test_deployment_doc_covers_each_way_and_rpc() -> None:
    text = (ROOT / "docs" / "deployment.md").read_text(encoding="utf-8")
    for heading in ("Docker Compose on NVIDIA GPUs", "`cpu` profile", "Replicas behind HAProxy", "Inference Gateway", "Kubernetes", "RPC"):
        assert re.search(rf"^## .*{re.escape(heading)}", text, re.MULTILINE), heading
    assert "unauthenticated" in text
    assert "--profile cpu" in text
