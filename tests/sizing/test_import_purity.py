"""The pure sizing core imports none of the heavy or I/O packages."""

from __future__ import annotations

import json
import subprocess
import sys

CORE = ["sizing.arch", "sizing.device", "sizing.reserve", "sizing.gpu", "sizing.measured", "sizing.request", "sizing.sizer",
        "sizing.spec", "sizing.config", "sizing.ggml", "sizing.kv", "sizing.compute", "sizing.graph_alloc", "sizing.memory",
        "sizing.fit", "sizing.placement", "sizing.plan", "sizing.offload", "sizing.speed", "sizing.report", "sizing.repack",
        "sizing.residency"]
FORBIDDEN = ["llama_cpp", "fastapi", "numpy", "gguf", "pynvml"]


def test_core_loads_no_heavy_module() -> None:
    code = (
        "import importlib, json, sys\n"
        f"for m in {CORE!r}: importlib.import_module(m)\n"
        f"print(json.dumps([m for m in {FORBIDDEN!r} if m in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
