"""bench/ on one harness: every bench starts (``--help`` imports all it needs and parses its flags) from any
folder, as a script, without editing ``sys.path``; the shared modules (``harness``, ``llama_server``) import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

BENCH = ROOT / "bench"
SHARED = ("harness", "llama_server")


def scripts() -> list[Path]:
    return sorted(p for p in BENCH.glob("*.py") if p.stem not in SHARED)


def test_no_bench_edits_sys_path() -> None:
    edits = []
    for path in BENCH.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                edits.append(f"{path.name}:{node.lineno}")
    assert not edits, f"bench scripts run with bench/ on the path and the project installed: {edits}"


def test_every_bench_answers_help_from_another_folder(tmp_path: Path) -> None:
    procs = {p.name: subprocess.Popen([sys.executable, str(p), "--help"], cwd=tmp_path, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for p in scripts()}
    assert len(procs) >= 20
    failed = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0 or "usage:" not in out:
            failed[name] = (proc.returncode, err[-2000:])
    assert not failed, failed


def test_the_shared_modules_import() -> None:
    r = subprocess.run([sys.executable, "-c", "import harness, llama_server; print(harness.ROOT)"], cwd=BENCH,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == ROOT
