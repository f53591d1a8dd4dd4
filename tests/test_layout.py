"""The folder map of docs/architecture.md, enforced: what each folder may import, no module importing another's
underscore names, no import circles. Read from the source (``ast``): a module added anywhere is checked without
anyone listing it."""

from __future__ import annotations

import ast
import os
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PURE = ("sizing/model", "sizing/memory", "sizing/plan", "sizing/units.py", "sizing/errors.py")
"""Values in, values out: no I/O, no heavy imports (tests/sizing/test_import_purity.py loads them all)."""

SIZING_MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "sizing.units": (),
    "sizing.errors": (),
    "sizing.model": ("sizing.model", "sizing.units", "sizing.errors"),
    "sizing.memory": ("sizing.memory", "sizing.model", "sizing.units", "sizing.errors"),
    "sizing.plan": ("sizing.plan", "sizing.memory", "sizing.model", "sizing.units", "sizing.errors"),
    "sizing.probe": ("sizing.probe", "sizing.plan.device", "sizing.model", "sizing.units", "sizing.errors"),
    "sizing.testing": ("sizing",),
    "sizing.__main__": ("sizing",),
    "sizing": ("sizing",),
}
"""Longest prefix first: a sizing module may import only these (and never ``service``)."""

SERVICE_SIZING_SURFACES = ("sizing.model", "sizing.memory", "sizing.plan", "sizing.probe", "sizing.units",
                           "sizing.errors")
"""What the service imports of sizing: each subpackage's ``__init__`` (its public surface), units and errors."""


def modules_under(rel: str) -> list[str]:
    """Dotted names of the modules in a folder (or the one file) under the repository root."""
    path = ROOT / rel
    files = [path] if path.is_file() else sorted(path.rglob("*.py"))
    out = []
    for f in files:
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        out.append(name[: -len(".__init__")] if name.endswith(".__init__") else name)
    return out


@lru_cache(maxsize=1)
def _imports() -> dict[str, list[tuple[str, str, bool, str]]]:
    """Per project module, for every import in it: (the module imported: ``X.Y`` for ``from X import Y`` when Y is a
    module, else X; the name, or "" for a module; whether at module level, ``if TYPE_CHECKING:`` included; the module written after ``from``)."""
    files = {m: ROOT / (m.replace(".", "/") + ".py") for top in ("sizing", "service") for m in modules_under(top)}
    for m in list(files):
        if not files[m].exists():
            files[m] = ROOT / m.replace(".", "/") / "__init__.py"
    known = set(files)
    out: dict[str, list[tuple[str, str, bool, str]]] = {}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_pkg = path.name == "__init__.py"
        top_level = {id(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
        for n in tree.body:  # imports for the type checker only are edges too: they hide circles otherwise
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                top_level |= {id(m) for m in ast.walk(n) if isinstance(m, (ast.Import, ast.ImportFrom))}
        found: list[tuple[str, str, bool, str]] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    found.append((sub if sub in known else target, a.name if sub not in known else "",
                                  id(node) in top_level, target))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    found.append((a.name, "", id(node) in top_level, a.name))
        out[mod] = found
    return out


def _rule(mod: str) -> tuple[str, ...]:
    for prefix in sorted(SIZING_MAY_IMPORT, key=len, reverse=True):
        if mod == prefix or mod.startswith(prefix + "."):
            return SIZING_MAY_IMPORT[prefix]
    raise AssertionError(f"{mod}: no rule in SIZING_MAY_IMPORT")


def _under(target: str, prefixes: tuple[str, ...]) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def test_sizing_imports_nothing_of_the_service_and_keeps_its_folders_directions() -> None:
    bad = []
    for mod, imports in _imports().items():
        if not mod.startswith("sizing"):
            continue
        allowed = _rule(mod)
        for target, _, _, _ in imports:
            if target.startswith("service") or (target.startswith("sizing") and not _under(target, allowed)):
                bad.append(f"{mod} imports {target}")
    assert not bad, "\n".join(bad)


def test_nothing_in_the_product_imports_the_test_data_builders() -> None:
    """``sizing.testing`` (GGUF builders) and ``service.testing`` (the fake engine) are for tests and benchmarks."""
    fakes = ("sizing.testing", "service.testing")
    bad = [f"{mod} imports {t}" for mod, imports in _imports().items() if not _under(mod, fakes)
           for t, _, _, _ in imports if _under(t, fakes)]
    assert not bad, "\n".join(bad)


def test_the_service_imports_sizing_through_its_public_surfaces() -> None:
    bad = [f"{mod} imports {written}" for mod, imports in _imports().items() if mod.startswith("service")
           for _, _, _, written in imports if written.startswith("sizing") and written not in SERVICE_SIZING_SURFACES]
    assert not bad, "\n".join(bad)


def test_no_module_imports_another_modules_underscore_names() -> None:
    bad = [f"{mod} imports {name} from {t}" for mod, imports in _imports().items()
           for t, name, _, _ in imports if name.startswith("_") and t != mod and t.startswith(("sizing", "service"))]
    assert not bad, "\n".join(bad)


THIRD_PARTY_PRIVATE = {"os._exit", "llama_cpp.llama_cpp._lib", "self._bits._legacy_seeding", "transport._pool"}
"""Underscore members of other packages the product reads, each for a reason given where it is read."""


def test_no_module_reads_another_modules_underscore_members() -> None:
    """``x._name`` on anything but ``self`` or ``cls`` only where the module itself defines ``_name`` (a method,
    an attribute it assigns, a function): a part that needs another's state asks through a public member."""
    bad = []
    for top in ("sizing", "service"):
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            own: set[str] = set()
            for n in ast.walk(tree):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    own.add(n.name)
                elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                    own.add(n.attr)
                elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    own.add(n.id)
            for n in ast.walk(tree):
                if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__") \
                        and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")) \
                        and n.attr not in own and ast.unparse(n) not in THIRD_PARTY_PRIVATE:
                    bad.append(f"{path.relative_to(ROOT)}:{n.lineno}: {ast.unparse(n)}")
    assert not bad, "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circles() -> None:
    """Module-level imports between project modules, those for the type checker included, form no cycle (imports
    inside functions are how a module defers a heavy dependency, and are not edges here)."""
    graph = {mod: {t for t, _, top, _ in imports if top and t in _imports() and t != mod}
             for mod, imports in _imports().items()}
    cycles = _cycles(graph)
    assert not cycles, cycles


def _folder(mod: str) -> str:
    path = ROOT / mod.replace(".", "/")
    return mod if (path / "__init__.py").exists() else mod.rsplit(".", 1)[0]


def test_no_folder_cycles() -> None:
    """Folders depend one way: no two folders import each other, however indirectly, by any import (deferred ones
    inside functions too: they are still a dependency). A package's loose modules (errors, settings) are its own
    folder's; its ``__main__`` is the command line, which imports the whole tree and is imported by none, and is
    left out."""
    graph: dict[str, set[str]] = {}
    why: dict[tuple[str, str], str] = {}
    for mod, imports in _imports().items():
        if mod.endswith(".__main__"):
            continue
        for t, _, _, _ in imports:
            if t in _imports() and _folder(t) != _folder(mod):
                graph.setdefault(_folder(mod), set()).add(_folder(t))
                why.setdefault((_folder(mod), _folder(t)), f"{mod} imports {t}")
    cycles = _cycles(graph)
    detail = [f"{a} -> {b}: {why[(a, b)]}" for c in cycles for a in c for b in c if (a, b) in why]
    assert not cycles, "\n".join(detail)


def test_chat_rendering_imports_neither_the_web_framework_nor_llama_cpp() -> None:
    bad = [f"{mod} imports {t}" for mod, imports in _imports().items() if mod.startswith("service.chat")
           for t, _, _, _ in imports if _under(t, ("fastapi", "starlette", "llama_cpp", "uvicorn"))]
    assert not bad, "\n".join(bad)


def test_the_api_layer_reaches_the_engine_only_through_its_values() -> None:
    """Routes speak to an engine through the ``Engine`` protocol and its values (``service.engine.base``), never its
    internals: the one that loads llama.cpp, its scheduler, its runner process (``service.runner``)."""
    bad = [f"{mod} imports {t}" for mod, imports in _imports().items() if mod.startswith("service.api")
           for t, _, _, _ in imports if _under(t, ("service.engine", "service.runner")) and t != "service.engine.base"]
    assert not bad, "\n".join(bad)


def test_the_folder_map_in_the_architecture_doc_names_every_folder() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert doc.split("\n## ")[1].startswith("Folder map"), "the doc opens with the folder map"
    head = doc.split("\n## ")[1]
    folders = {str(p.relative_to(ROOT)) + "/" for top in ("sizing", "service") for p in [ROOT / top, *(ROOT / top).rglob("*")]
               if p.is_dir() and (p / "__init__.py").exists()}
    missing = sorted(f for f in folders if f"`{f}`" not in head)
    assert not missing, f"docs/architecture.md's folder map does not name {missing}"


def test_every_sizing_module_has_a_rule_and_the_pure_folders_exist() -> None:
    for mod in _imports():
        if mod.startswith("sizing"):
            _rule(mod)
    for rel in PURE:
        assert (ROOT / rel).exists(), rel
    assert os.path.isdir(ROOT / "sizing" / "testing")


def test_test_folders_mirror_the_packages() -> None:
    """Each folder under tests/sizing/ and tests/service/ tests the product folder of the same path."""
    stray = [str(d.relative_to(ROOT)) for top in ("sizing", "service") for d in (ROOT / "tests" / top).rglob("*")
             if d.is_dir() and d.name != "__pycache__" and not (ROOT / d.relative_to(ROOT / "tests")).is_dir()]
    assert not stray, f"test folders naming no product folder: {stray}"
