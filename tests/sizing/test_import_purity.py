"""The pure sizing core imports none of the heavy or I/O packages: every module under the pure folders
(``sizing/model``, ``sizing/memory``, ``sizing/plan``) and ``sizing/units.py``, ``sizing/errors.py``, found by walking
them, so that a module added there is checked without anyone listing it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PURE = ("sizing/model", "sizing/memory", "sizing/plan", "sizing/units.py", "sizing/errors.py")
FORBIDDEN = ["llama_cpp", "fastapi", "numpy", "gguf", "pynvml", "httpx"]


def pure_modules() -> list[str]:
    out = []
    for rel in PURE:
        path = ROOT / rel
        for f in [path] if path.is_file() else sorted(path.rglob("*.py")):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            out.append(name.removesuffix(".__init__"))
    return out


def test_core_loads_no_heavy_module() -> None:
    core = pure_modules()
    assert len(core) >= 20 and "sizing.memory.estimate" in core and "sizing.plan.residency" in core
    code = (
        "import importlib, json, sys\n"
        f"for m in {core!r}: importlib.import_module(m)\n"
        f"print(json.dumps([m for m in {FORBIDDEN!r} if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(out.stdout) == []
