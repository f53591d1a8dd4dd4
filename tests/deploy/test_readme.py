"""The README is read in two minutes: about 120 lines at most, its links and picture there, its settings real, and
the figures and caveats it leaves out in the docs it points to (docs/benchmarks.md, docs/models.md)."""

from __future__ import annotations

import re
from pathlib import Path

from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readme_is_short() -> None:
    assert len(README.splitlines()) <= 125


def test_every_link_and_picture_of_the_readme_and_its_new_docs_is_there() -> None:
    for doc, text in (("README.md", README), *((f"docs/{n}", (ROOT / "docs" / n).read_text(encoding="utf-8"))
                                               for n in ("benchmarks.md", "models.md", "page.md"))):
        base = (ROOT / doc).parent
        targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
        assert targets, doc
        for target in targets:
            if target.startswith(("http://", "https://")):
                continue
            assert (base / target).exists(), f"{doc} links {target}, which is not there"
    assert "![" in README and "docs/page-plan.png" in README


def test_the_settings_the_readme_names_are_settings() -> None:
    names = set(re.findall(r"`(GGUF_[A-Z_]+)`", README))
    fields = {f"GGUF_{name.upper()}" for name in Settings.model_fields}
    assert names and names <= fields, sorted(names - fields)


def test_the_figures_moved_out_of_the_readme_are_in_the_docs_with_their_commands() -> None:
    bench = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    models = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    for figure, command in (("14 min 48 s", "make test"), ("12 min 49 s", "make fresh-test"),
                            ("13 min 44 s", "make fresh-test-avx2"), ("28 min 10 s", "TEST_WORKERS=0"),
                            ("1.09x", "bench/serving_bench.py"), ("0.44x", "bench/prompt_cache_bench.py"),
                            ("1.08x", "bench/speculative_bench.py"), ("14-45 s", "bench/probe_bench.py"),
                            ("about 20 minutes on 2 cores", "tools/llama-wheel"), ("239 MB", "tools/fetch-vllm-events")):
        line = next((ln for ln in bench.splitlines() if figure in ln), "")
        assert command in line, (figure, command)
    assert "17 * 23 = 381" in models and "n_ctx_train 8192" in models
