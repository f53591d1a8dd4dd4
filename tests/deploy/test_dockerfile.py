"""The Dockerfile, parsed (no Docker engine needed): stages, user, entry, healthcheck, and the install commands.

The image must be built with the commands README.md documents under "Install by
hand", and with the llama-cpp-python that pyproject.toml pins (the sizing core
mirrors that llama.cpp).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

DOCKERFILE = ROOT / "Dockerfile"
RUNTIME_STAGES = {"cpu": "cpu-build", "cuda": "cuda-build", "vulkan": "vulkan-build"}


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"stage {self.name!r} has no {keyword}"
        return found[-1]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise AssertionError(f"no stage named {name!r}; stages: {[s.name for s in self.stages]}")


def parse_dockerfile(text: str) -> Dockerfile:
    """Instructions with continuation lines joined and comments dropped, grouped by FROM."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        logical.append((pending + line).strip())
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"

    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        args = args.strip()
        if keyword == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args, re.IGNORECASE)
            assert m, f"unparsed FROM: {args}"
            stages.append(Stage(base=m.group(1), name=m.group(2) or str(len(stages))))
        elif not stages:
            assert keyword == "ARG", f"only ARG may come before the first FROM, not {keyword}"
            name, _, default = args.partition("=")
            global_args[name] = default.strip('"')
        else:
            stages[-1].instructions.append((keyword, args))
    return Dockerfile(global_args, stages)


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], text)


def pip_installs(run_args: str) -> list[list[str]]:
    """The argument lists of every ``pip install`` in one RUN (flags and options dropped)."""
    found = []
    for command in re.split(r"&&|;|\|\|", run_args):
        words = shlex.split(command)
        for i in range(len(words) - 1):
            if words[i].endswith("pip") and words[i + 1] == "install":
                targets, skip = [], False
                for word in words[i + 2 :]:
                    if skip:
                        skip = False
                    elif word in ("-r", "-c", "--index-url", "-i", "--extra-index-url", "-t", "--target"):
                        skip = True
                    elif not word.startswith("-"):
                        targets.append(word)
                found.append(targets)
    return found


def pyproject_pin(package: str) -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for dep in project["dependencies"]:
        m = re.fullmatch(rf"{re.escape(package)}\s*==\s*(\S+)", dep.strip())
        if m:
            return m.group(1)
    raise AssertionError(f"pyproject.toml does not pin {package} with ==")


def project_spec(target: str) -> str | None:
    """``.``, ``.[test]``, ``-e .`` style targets name the project: return its path, else None."""
    m = re.fullmatch(r"(\.{1,2}(?:/[^\[\]]*)?)(?:\[[\w,-]+\])?", target)
    return m.group(1).rstrip("/") if m else None


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse_dockerfile(DOCKERFILE.read_text(encoding="utf-8"))


def test_parser_reads_continuations_and_stages() -> None:
    parsed = parse_dockerfile(
        "ARG V=1\nFROM a:${V} AS one\n# comment\nRUN x \\\n    # inner\n    && y\nFROM b AS two\nUSER 5\n"
    )
    assert parsed.global_args == {"V": "1"}
    assert [(s.base, s.name) for s in parsed.stages] == [("a:${V}", "one"), ("b", "two")]
    assert parsed.stage("one").instructions == [("RUN", "x && y")]
    assert pip_installs("a && CMAKE_ARGS='-x' pip install --no-cache-dir llama-cpp-python==1 && pip install -e '.[test]'") == [
        ["llama-cpp-python==1"],
        [".[test]"],
    ]


def test_multi_stage_with_cuda_default_and_cpu_target(dockerfile: Dockerfile) -> None:
    names = [s.name for s in dockerfile.stages]
    assert {"cpu-build", "cpu", "cuda-build", "cuda"} <= set(names)
    assert names[-1] == "cuda", "a plain `docker build .` must give the CUDA image"
    bases = {s.name: expand(s.base, dockerfile.global_args) for s in dockerfile.stages}
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-devel-ubuntu[\d.]+", bases["cuda-build"]), bases["cuda-build"]
    assert bases["cuda"] == bases["cuda-build"].replace("-devel-", "-runtime-"), "runtime must match the devel image"
    assert bases["cpu"] == bases["cpu-build"] == "python:3.11-slim"


@pytest.mark.parametrize("stage_name", sorted(RUNTIME_STAGES))
def test_runtime_stage_runs_the_service_as_non_root(dockerfile: Dockerfile, stage_name: str) -> None:
    stage = dockerfile.stage(stage_name)
    user = stage.last("USER").split(":")[0]
    assert user not in ("root", "0"), f"{stage_name} runs as root"
    assert user.isdigit(), "a numeric USER lets Kubernetes' runAsNonRoot verify it"
    assert f"--uid {user}" in " ".join(stage.all("RUN")), "the USER must be created in the stage"
    assert stage.last("CMD") == '["python", "-m", "service"]'
    assert "8000" in stage.last("EXPOSE").split()
    env = " ".join(stage.all("ENV"))
    assert re.search(r"\bGGUF_HOST=0\.0\.0\.0\b", env)
    assert re.search(r"\bGGUF_PORT=8000\b", env)
    assert f"--from={RUNTIME_STAGES[stage_name]}" in " ".join(stage.all("COPY"))


@pytest.mark.parametrize("stage_name", sorted(RUNTIME_STAGES))
def test_healthcheck_hits_ready(dockerfile: Dockerfile, stage_name: str, ready_server) -> None:  # type: ignore[no-untyped-def]
    check = dockerfile.stage(stage_name).last("HEALTHCHECK")
    options, sep, command = check.partition("CMD ")
    assert sep, "HEALTHCHECK needs CMD"
    assert "--start-period=" in options
    assert command.startswith("["), "exec form: no shell needed in the container"
    argv = json.loads(command)
    assert argv[:2] == ["python", "-c"], "a python one-liner: the image has no curl"
    assert ready_server.run_check(argv) == 0
    ready_server.status = 503
    assert ready_server.run_check(argv) != 0, "503 from /ready must fail the healthcheck"
    assert ready_server.paths == ["/ready", "/ready"]


@pytest.mark.parametrize("build_stage", sorted(RUNTIME_STAGES.values()))
def test_build_installs_the_pinned_llama_cpp_python_then_the_project(dockerfile: Dockerfile, build_stage: str) -> None:
    pin = pyproject_pin("llama-cpp-python")
    runs = dockerfile.stage(build_stage).all("RUN")
    installs = [(run, targets) for run in runs for targets in pip_installs(run)]
    assert [targets for _, targets in installs] == [[f"llama-cpp-python=={pin}"], ["."]], installs
    cmake_args = re.search(r"""CMAKE_ARGS=["']([^"']*)["']""", installs[0][0])
    assert cmake_args, "CMAKE_ARGS chooses llama.cpp's build"
    assert "-DGGML_NATIVE=off" in cmake_args.group(1).split(), "-march=native would tie the image to the build host's CPU"
    if build_stage == "cuda-build":
        assert "-DGGML_CUDA=on" in cmake_args.group(1).split(), "llama.cpp must be built with CUDA"
    if build_stage == "vulkan-build":
        assert "-DGGML_VULKAN=on" in cmake_args.group(1).split(), "llama.cpp must be built with Vulkan"
    assert "-DGGML_RPC=on" in cmake_args.group(1).split(), "the image also serves its devices as a ggml-rpc worker"


def test_vulkan_image_builds_ggml_vulkan_and_ships_the_loader_and_mesa(dockerfile: Dockerfile) -> None:
    """The Vulkan target (AMD and Intel cards): built where the Vulkan headers are new enough for ggml-vulkan (Debian
    13's 1.4; Debian 12's 1.3.239 lack vk::LayerSettingsCreateInfoEXT), with the shader compiler; its runtime has
    the loader and Mesa's drivers (radv, anv) and none of the build's compilers; not the default target."""
    bases = {s.name: expand(s.base, dockerfile.global_args) for s in dockerfile.stages}
    assert bases["vulkan-build"] == bases["vulkan"] == "python:3.11-slim-trixie"
    build = " ".join(dockerfile.stage("vulkan-build").all("RUN"))
    for package in ("glslc", "libvulkan-dev", "spirv-headers", "cmake"):
        assert re.search(rf"apt-get install[^&]*\b{package}\b", build), package
    assert "libggml-vulkan.so" in build, "the build checks that the Vulkan backend was built"
    runtime = " ".join(dockerfile.stage("vulkan").all("RUN"))
    for package in ("libvulkan1", "mesa-vulkan-drivers", "libgomp1"):
        assert re.search(rf"apt-get install[^&]*\b{package}\b", runtime), package
    assert not re.search(r"\b(build-essential|cmake|glslc)\b", runtime)
    assert [s.name for s in dockerfile.stages][-1] == "cuda"


def readme_install_commands() -> list[list[str]]:
    """The ``pip install`` lines of README.md's fenced block under the "Install by hand" heading."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"^#+\s*Install by hand\s*$(.*?)(?=^#+\s|\Z)", readme, re.MULTILINE | re.DOTALL | re.IGNORECASE)
    assert m, 'README.md has no "Install by hand" section'
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", m.group(1), re.MULTILINE | re.DOTALL)
    assert blocks, 'the "Install by hand" section has no fenced block'
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [targets for line in lines for targets in pip_installs(line.lstrip("$ "))]


def test_dockerfile_installs_what_the_readme_documents(dockerfile: Dockerfile) -> None:
    documented = readme_install_commands()
    documented_projects = {project_spec(t) for targets in documented for t in targets} - {None}
    assert documented_projects == {"."}, f"README installs {documented}: expected the project (pip install .)"
    pin = pyproject_pin("llama-cpp-python")
    for targets in documented:
        for target in targets:
            if target.lower().startswith("llama-cpp-python"):
                assert target == f"llama-cpp-python=={pin}", f"README pins {target}, pyproject.toml {pin}"
    for name in RUNTIME_STAGES.values():
        for run in dockerfile.stage(name).all("RUN"):
            for targets in pip_installs(run):
                for target in targets:
                    # Either the project, installed as the README does, or the pinned llama-cpp-python.
                    assert project_spec(target) in documented_projects or target == f"llama-cpp-python=={pin}", target


def _dockerignore_allows(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; ``!`` re-includes."""
    allowed = True
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/")
        hit = any(fnmatch.fnmatchcase(p, pat) or fnmatch.fnmatchcase(p, pat.replace("**/", "")) for p in prefixes)
        if pat.startswith("**/"):
            hit = hit or any(fnmatch.fnmatchcase(part, pat[3:]) for part in parts)
        if hit:
            allowed = negate
    return allowed


def test_build_context_has_what_copy_needs_and_nothing_private(dockerfile: Dockerfile) -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = []
    for stage in dockerfile.stages:
        for copy in stage.all("COPY"):
            words = [w for w in copy.split() if not w.startswith("--")]
            if "--from=" not in copy:
                sources += words[:-1]
    assert sources, "no COPY from the build context"
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert _dockerignore_allows(source.strip("./") or ".", patterns), f"COPY {source}: excluded by .dockerignore"
    for private in (".venv/bin/python", ".git/config", "models/x.gguf", "deploy/secrets/api_key", "service/__pycache__/a.pyc"):
        assert not _dockerignore_allows(private, patterns), f"{private} would be sent to the Docker daemon"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    readme = project.get("readme")
    if isinstance(readme, str):
        assert readme in sources, f"pyproject.toml names {readme}: `pip install .` in the image needs it copied"
