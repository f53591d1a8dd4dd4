"""docs/configuration.md is generated from ``Settings.model_fields`` and must match it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings

from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "docs" / "gen_config.py"
DOC = ROOT / "docs" / "configuration.md"


def _gen_config() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config", GEN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_doc_is_up_to_date() -> None:
    expected = _gen_config().generate()
    current = DOC.read_text(encoding="utf-8")
    assert current == expected, "docs/configuration.md is out of date: run `python docs/gen_config.py` and commit it"


def test_every_setting_is_documented_with_env_var_and_description() -> None:
    doc = DOC.read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip(" `"): line for line in doc.splitlines() if line.startswith("| `")}
    assert set(rows) == set(Settings.model_fields)
    for name, field in Settings.model_fields.items():
        assert f"`GGUF_{name.upper()}`" in rows[name]
        assert field.description, f"Settings.{name} needs a description"
        assert " ".join(field.description.split()).replace("|", "\\|") in rows[name]


def test_render_rows() -> None:
    class Demo(BaseSettings):
        alpha: int = Field(3, description="Three | of them.")
        beta: str | None = Field(None, description="Maybe.")
        mode: Literal["on", "off"] = Field("on", description="A switch.")
        flag: bool = Field(False, description="A flag.")
        items: list[str] = Field(default_factory=lambda: ["x"], description="Listed.")

    text = _gen_config().render(dict(Demo.model_fields), env_prefix="APP_")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows == [
        "| `alpha` | `APP_ALPHA` | int | `3` | Three \\| of them. |",
        "| `beta` | `APP_BETA` | str or unset | unset | Maybe. |",
        "| `mode` | `APP_MODE` | one of on, off | `on` | A switch. |",
        "| `flag` | `APP_FLAG` | bool | `false` | A flag. |",
        "| `items` | `APP_ITEMS` | list | `['x']` | Listed. |",
    ]


def test_check_mode(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(GEN), "--check"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    gen = _gen_config()
    gen.OUTPUT = tmp_path / "configuration.md"
    gen.OUTPUT.write_text("# stale\n", encoding="utf-8")
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0
    assert gen.main(["--check"]) == 0
    assert gen.OUTPUT.read_text(encoding="utf-8") == gen.generate()
