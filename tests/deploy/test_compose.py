"""docker-compose.yml, deploy/compose.replicas.yml and deploy/compose.workers.yml: the Compose Specification schema,
then what this service needs.

The schema is vendored: ``compose-spec.json`` here is the Compose Specification
JSON schema exactly as the PyPI package ``docker-compose==1.29.2`` ships it
(``compose/config/compose_spec.json``); ``vendor_schemas.py`` rebuilds it. The
files are validated as written and again after ``${VAR:-default}``
interpolation, which the tests do the way Compose does. The workers' command and
healthcheck are also run for real (``python -m service worker`` on loopback).
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import TypeAdapter

from service.settings import Settings
from tests.deploy.conftest import running_worker, worker_args, worker_ports

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
COMPOSE = ROOT / "docker-compose.yml"
REPLICAS = ROOT / "deploy" / "compose.replicas.yml"
WORKERS = ROOT / "deploy" / "compose.workers.yml"
FILES = [COMPOSE, REPLICAS, WORKERS]
FILE_IDS = ["docker-compose", "replicas", "workers"]

# Settings the brief of this deployment assumes before they land in service/settings.py.
PENDING_SETTINGS = {"api_key_file": None, "drain_timeout_s": 30, "rpc_workers": None}
# Settings the container fixes, whatever the service's own default (a path inside the image, a bind address).
CONTAINER_VALUES = {
    "host": "0.0.0.0",
    "models_dir": "/models",
    "embedded_model_dir": "/cache/embedded",
    "prompt_cache_dir": "/cache/prompts",
    "api_key_file": "/run/secrets/gguf_api_key",
}


class InterpolationError(Exception):
    pass


_VAR = re.compile(r"\$(?:(\$)|\{(\w+)(?:(:?[-?])((?:[^}])*))?\}|(\w+))")


def interpolate_str(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: ${V}, $V, ${V:-d}, ${V-d}, ${V:?e}, ${V?e}, $$."""

    def sub(m: re.Match[str]) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        op, arg = m.group(3), m.group(4)
        value = env.get(name)
        if op == ":-":
            return value if value else arg
        if op == "-":
            return value if value is not None else arg
        if op in (":?", "?") and (value is None or (op == ":?" and value == "")):
            raise InterpolationError(f"{name}: {arg}")
        return value or ""

    return _VAR.sub(sub, text)


def interpolate(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate_str(node, env)
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate(item, env) for item in node]
    return node


def seconds(duration: str) -> float:
    """A Compose duration (``40s``, ``1m30s``, ``10m``) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def load(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = json.loads((HERE / "compose-spec.json").read_text(encoding="utf-8"))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load(COMPOSE)


@pytest.fixture(scope="module")
def replicas() -> dict[str, Any]:
    return load(REPLICAS)


@pytest.fixture(scope="module")
def workers() -> dict[str, Any]:
    return load(WORKERS)


def _is_worker(name: str) -> bool:
    """The worker services (by name: that they run the worker is what the tests check)."""
    return name.startswith("gguf-worker")


def _servers(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in data["services"].items() if n != "router" and not _is_worker(n)}


SAMPLE_ENV = {"GGUF_MODEL_B": "qwen3-14b-q4_k_m"}


def _errors(validator: jsonschema.protocols.Validator, data: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(data)]


@pytest.mark.parametrize("path", FILES, ids=FILE_IDS)
def test_valid_compose_specification(validator: jsonschema.protocols.Validator, path: Path) -> None:
    data = load(path)
    assert _errors(validator, data) == []
    assert _errors(validator, interpolate(data, SAMPLE_ENV)) == []


def test_schema_rejects_what_compose_rejects(validator: jsonschema.protocols.Validator, compose: dict[str, Any]) -> None:
    """The vendored schema is live: a misspelt key or a bad reservation fails."""
    bad = copy.deepcopy(compose)
    bad["services"]["gguf"]["restart_policy"] = "always"
    assert any("restart_policy" in e for e in _errors(validator, bad))
    bad = copy.deepcopy(compose)
    bad["services"]["gguf"]["deploy"]["resources"]["reservations"]["devices"][0]["gpus"] = 1
    assert _errors(validator, bad)


def test_interpolation_like_compose() -> None:
    env = {"A": "x", "E": ""}
    assert interpolate_str("${A:-d} ${B:-d} ${E:-d} ${E-d} ${B-d} $A $$A", env) == "x d d  d x $A"
    with pytest.raises(InterpolationError):
        interpolate_str("${B:?set B}", env)


def _gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def test_gpu_service_reserves_nvidia_gpus(compose: dict[str, Any]) -> None:
    gguf = compose["services"]["gguf"]
    assert "profiles" not in gguf, "the GPU service is the default one"
    assert gguf["build"]["target"] == "cuda"
    (device,) = _gpu_devices(gguf)
    assert device["driver"] == "nvidia"
    assert "gpu" in device["capabilities"]
    assert "count" in device or "device_ids" in device
    count = interpolate(device.get("count"), {})
    assert count == "all" or int(count) >= 1


def test_cpu_profile_builds_the_cpu_target_without_gpus(compose: dict[str, Any]) -> None:
    services = [s for s in compose["services"].values() if "cpu" in s.get("profiles", [])]
    assert len(services) == 1
    (cpu,) = services
    assert cpu["build"]["target"] == "cpu"
    assert _gpu_devices(cpu) == []
    assert cpu["environment"] == compose["services"]["gguf"]["environment"]


def test_vulkan_profile_passes_the_render_nodes_through(compose: dict[str, Any]) -> None:
    """AMD and Intel cards: the Vulkan image with the host's /dev/dri and its render group, no NVIDIA reservation,
    the same settings as the default service; only with its profile (`up -d` still starts the CUDA service)."""
    vk = compose["services"]["gguf-vulkan"]
    assert vk["profiles"] == ["vulkan"] and vk["build"]["target"] == "vulkan"
    assert _gpu_devices(vk) == []
    assert "/dev/dri:/dev/dri" in vk["devices"]
    groups = [interpolate(str(g), {}) for g in vk["group_add"]]
    assert "video" in groups and interpolate(str(vk["group_add"][-1]), {"DEPLOY_RENDER_GID": "992"}) == "992"
    assert vk["environment"] == compose["services"]["gguf"]["environment"]


def test_build_targets_are_dockerfile_stages(compose: dict[str, Any], replicas: dict[str, Any],
                                             workers: dict[str, Any]) -> None:
    stages = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE | re.IGNORECASE))
    for data in (compose, replicas, workers):
        for name, service in data["services"].items():
            if "build" in service:
                assert service["build"]["target"] in stages, name


def _settings_defaults() -> dict[str, tuple[Any, Any]]:
    """Field name -> (annotation, default), with the settings still pending in service/settings.py."""
    fields = {name: (f.annotation, f.default) for name, f in Settings.model_fields.items()}
    for name, default in PENDING_SETTINGS.items():
        fields.setdefault(name, (int | None if default is not None else str | None, default))
    return fields


def test_every_setting_is_passed_from_the_environment_with_its_default(compose: dict[str, Any]) -> None:
    env = compose["services"]["gguf"]["environment"]
    assert isinstance(env, dict)
    missing = [f"GGUF_{n.upper()}" for n in _settings_defaults() if f"GGUF_{n.upper()}" not in env]
    assert not missing, f"add {missing} to x-gguf-environment in docker-compose.yml (see docs/configuration.md)"
    for name, (annotation, default) in _settings_defaults().items():
        var = f"GGUF_{name.upper()}"
        value = env[var]
        if name in CONTAINER_VALUES:
            assert interpolate(value, {}) == CONTAINER_VALUES[name], var
            continue
        if value is None:
            assert default is None, f"{var}: a bare key leaves the setting unset, but its default is {default!r}"
            continue
        m = re.fullmatch(rf"\$\{{{var}:?-(.*)\}}", str(value))
        assert m, f"{var}: expected ${{{var}:-<default>}}, got {value!r}"
        parsed = TypeAdapter(annotation).validate_python(m.group(1), strict=False) if m.group(1) != "" else None
        assert parsed == default, f"{var}: compose default {m.group(1)!r}, settings default {default!r}"


def test_no_unknown_settings_in_the_environment(compose: dict[str, Any], replicas: dict[str, Any],
                                                workers: dict[str, Any]) -> None:
    known = {f"GGUF_{n.upper()}" for n in _settings_defaults()}
    for data in (compose, replicas, workers):
        for name, service in data["services"].items():
            if name == "router":
                continue
            unknown = {k for k in service.get("environment", {}) if k.startswith("GGUF_")} - known
            assert not unknown, f"{name}: {unknown} are not settings (service/settings.py)"


def test_container_wiring(compose: dict[str, Any]) -> None:
    for env_vars in ({}, {"GGUF_MODELS_DIR": "/srv/gguf", "GGUF_PORT": "9000"}):
        data = interpolate(compose, env_vars)
        for name in ("gguf", "gguf-cpu"):
            service = data["services"][name]
            env = service["environment"]
            mounts = {v["target"]: v for v in service["volumes"]}
            models = mounts[env["GGUF_MODELS_DIR"]]
            assert models["type"] == "bind" and models["read_only"] is True, "models mounted read-only"
            cache = [v for v in service["volumes"] if env["HF_HOME"].startswith(v["target"].rstrip("/") + "/")]
            assert cache and cache[0]["type"] == "volume" and cache[0]["source"] in data["volumes"], "HF_HOME on a named volume"
            assert env["GGUF_EMBEDDED_MODEL_DIR"].startswith(cache[0]["target"])
            assert env["GGUF_PROMPT_CACHE_DIR"].startswith(cache[0]["target"] + "/"), "prompts outlive the container"
            (port,) = service["ports"]
            address, host_port, container_port = port.split(":")
            assert address == "127.0.0.1", "published on loopback by default"
            assert container_port == env["GGUF_PORT"]
            secret_targets = {s["target"] for s in service["secrets"]}
            assert env["GGUF_API_KEY_FILE"].startswith("/run/secrets/")
            assert env["GGUF_API_KEY_FILE"].removeprefix("/run/secrets/") in secret_targets
            for secret in service["secrets"]:
                assert "file" in data["secrets"][secret["source"]]
            assert "GGUF_API_KEY" not in env, "the key comes from the secret, not the environment"


def _drain_s() -> float:
    field = Settings.model_fields.get("drain_timeout_s")
    return float(field.default) if field is not None else float(PENDING_SETTINGS["drain_timeout_s"])


@pytest.mark.parametrize("path", FILES, ids=FILE_IDS)
def test_lifecycle(path: Path, ready_server) -> None:  # type: ignore[no-untyped-def]
    data = interpolate(load(path), SAMPLE_ENV)
    servers = _servers(data)
    assert servers
    for name, service in servers.items():
        assert service["restart"] == "unless-stopped", name
        assert seconds(service["stop_grace_period"]) >= _drain_s() + 5, f"{name}: stop_grace_period below the drain time"
        check = service["healthcheck"]
        assert seconds(check["start_period"]) >= 300, f"{name}: a model load takes minutes"
        assert check["test"][0] == "CMD"
        argv = check["test"][1:]
        assert any("/ready" in a for a in argv)
        ready_server.status = 200
        assert ready_server.run_check(argv) == 0, name
        ready_server.status = 503
        assert ready_server.run_check(argv) != 0, name


def test_replicas_share_models_and_reserve_gpus(replicas: dict[str, Any]) -> None:
    data = interpolate(replicas, SAMPLE_ENV)
    servers = {n: s for n, s in data["services"].items() if n != "router"}
    by_model: dict[str, list[str]] = {}
    for name, service in servers.items():
        by_model.setdefault(service["environment"]["GGUF_DEFAULT_MODEL"], []).append(name)
        (device,) = _gpu_devices(service)
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert any(v["target"] == "/models" and v.get("read_only") for v in service["volumes"])
        assert "ports" not in service, "replicas are reached through the router only"
    assert max(len(v) for v in by_model.values()) >= 2, "several replicas of one model"
    assert len(by_model) >= 2, "at least two models to route between"
    embedded_dirs = [s["environment"]["GGUF_EMBEDDED_MODEL_DIR"] for s in servers.values()]
    assert len(set(embedded_dirs)) == len(embedded_dirs), "replicas sharing the cache volume must not share this directory"
    with pytest.raises(InterpolationError):
        interpolate(replicas, {})  # GGUF_MODEL_B is required: no silent duplicate route

    router = data["services"]["router"]
    assert set(router["depends_on"]) == set(servers)
    (mount,) = router["volumes"]
    assert (REPLICAS.parent / mount["source"]).resolve() == ROOT / "deploy" / "haproxy.cfg"
    assert mount["target"] == "/usr/local/etc/haproxy/haproxy.cfg", "where the haproxy image reads its configuration"
    assert mount["read_only"] is True
    assert router["ports"][0].startswith("127.0.0.1:")


def test_the_service_accepts_the_compose_environment(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment the container gets (no GGUF_* set on the host) parses into Settings as intended."""
    for var in [k for k in os.environ if k.startswith("GGUF_")]:
        monkeypatch.delenv(var)
    env = interpolate(compose["services"]["gguf"]["environment"], {})
    for var, value in env.items():
        if value is not None:  # a bare key is absent from the container
            monkeypatch.setenv(var, str(value))
    settings = Settings()
    assert settings.host == "0.0.0.0"
    assert settings.models_dir == "/models"
    for name, field in Settings.model_fields.items():
        if name not in CONTAINER_VALUES:
            assert getattr(settings, name) == field.default, name


def _worker_services(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in data["services"].items() if _is_worker(n)}


def test_workers_serve_this_machine_over_rpc(workers: dict[str, Any]) -> None:
    """Each worker runs the worker module on the ports it publishes, on loopback unless told, with a cache
    volume and a /status healthcheck; the GPU one is the default, the CPU one a profile."""
    for env_vars in ({}, {"DEPLOY_WORKER_PUBLISH_ADDR": "10.0.0.12", "DEPLOY_WORKER_MEMORY_MIB": "24000"}):
        data = interpolate(workers, env_vars)
        services = _worker_services(data)
        assert set(services) == {"gguf-worker", "gguf-worker-cpu"}
        for name, service in services.items():
            args = worker_args(service["command"])
            host, _, _ = args["--listen"].rpartition(":")
            # Inside the container: without --allow-public the worker refuses any address but loopback.
            assert host == "0.0.0.0" and args.get("--allow-public") is True, name
            rpc, status = worker_ports(args)
            memory = float(args["--memory-mib"])
            assert memory > 0 and memory == float(env_vars.get("DEPLOY_WORKER_MEMORY_MIB", memory)), name

            published = [p.split(":") for p in service["ports"]]
            assert all(len(p) == 3 for p in published), f"{name}: publish as ADDRESS:HOST:CONTAINER"
            assert {a for a, _, _ in published} == {env_vars.get("DEPLOY_WORKER_PUBLISH_ADDR", "127.0.0.1")}, \
                f"{name}: published on loopback unless DEPLOY_WORKER_PUBLISH_ADDR names the private address"
            # The server reads /status on the RPC port + 1 of the address it was given: the host keeps the offset.
            assert sorted((int(h), int(c)) for _, h, c in published) == [(rpc, rpc), (status, status)], name
            assert status == rpc + 1, f"{name}: GGUF_RPC_WORKERS names the RPC port; the server reads the next one"

            cache = [v for v in service["volumes"] if args["--cache-dir"].startswith(v["target"].rstrip("/") + "/")]
            assert cache and cache[0]["type"] == "volume" and cache[0]["source"] in data["volumes"], \
                f"{name}: ggml-rpc's cache on a named volume"

            check = service["healthcheck"]
            assert check["test"][0] == "CMD"
            assert any(f":{status}/status" in a for a in check["test"][1:]), f"{name}: the healthcheck asks /status"
            assert seconds(check["start_period"]) >= 30, f"{name}: a CUDA backend takes seconds to start"
            assert service["restart"] == "unless-stopped"
            assert service.get("init") is True, f"{name}: as PID 1 the worker ignores SIGTERM; an init forwards it"

        gpu, cpu = services["gguf-worker"], services["gguf-worker-cpu"]
        assert gpu["command"] == cpu["command"]
        assert "profiles" not in gpu, "`up -d` on a worker machine starts the GPU worker"
        assert gpu["build"]["target"] == "cuda"
        (device,) = _gpu_devices(gpu)
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert cpu["profiles"] == ["cpu"] and cpu["build"]["target"] == "cpu" and _gpu_devices(cpu) == []


def test_the_server_names_the_workers(workers: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    data = interpolate(workers, {})
    (server,) = _servers(data).values()
    assert server["profiles"] == ["server"], "a worker machine's `up -d` starts no server"
    assert server["build"]["target"] == "cpu" and _gpu_devices(server) == [], \
        "the serving machine's cards are lent by its worker: the server holding them too would count them twice"
    env = server["environment"]
    entries = env["GGUF_RPC_WORKERS"].split(",")
    rpc_ports = {n: worker_ports(worker_args(s["command"]))[0] for n, s in _worker_services(data).items()}
    for entry in entries:
        host, _, port = entry.rpartition(":")
        assert host in rpc_ports, f"{entry}: not a worker service of this file"
        assert int(port) == rpc_ports[host], f"{entry}: GGUF_RPC_WORKERS names the RPC port, not /status"
        assert server["depends_on"][host]["condition"] == "service_healthy"
    assert set(server["depends_on"]) <= set(rpc_ports)
    # The other machines' workers come from the shell.
    given = "gguf-worker:50052,10.0.0.12:50052"
    assert interpolate(workers, {"GGUF_RPC_WORKERS": given})["services"]["gguf"]["environment"]["GGUF_RPC_WORKERS"] == given

    # The same wiring as the main file: models read-only, the key from a secret, published on loopback.
    mounts = {v["target"]: v for v in server["volumes"]}
    assert mounts[env["GGUF_MODELS_DIR"]]["read_only"] is True
    assert env["GGUF_API_KEY_FILE"].removeprefix("/run/secrets/") in {s["target"] for s in server["secrets"]}
    assert all(p.startswith("127.0.0.1:") for p in server["ports"])

    for var in [k for k in os.environ if k.startswith("GGUF_")]:
        monkeypatch.delenv(var)
    for var, value in env.items():
        if value is not None:
            monkeypatch.setenv(var, str(value))
    settings = Settings()
    if "rpc_workers" in Settings.model_fields:
        assert settings.rpc_workers == "gguf-worker:50052"  # type: ignore[attr-defined]


def _run(argv: list[str]) -> int:
    argv = [sys.executable if a == "python" else a for a in argv]
    return subprocess.run(argv, capture_output=True, timeout=30).returncode


def test_the_worker_command_and_healthcheck_run(workers: dict[str, Any], tmp_path: Path) -> None:
    """The command as written starts the real worker (its options parse, its cache folder is made), and the
    healthcheck passes against its /status, then fails once it is gone."""
    service = interpolate(workers, {})["services"]["gguf-worker-cpu"]
    _, status = worker_ports(worker_args(service["command"]))
    check = service["healthcheck"]["test"][1:]
    with running_worker(service["command"], tmp_path / "rpc") as (_, live_status):
        argv = [a.replace(f":{status}/", f":{live_status}/") for a in check]
        assert argv != check, "the healthcheck names the status port"
        assert _run(argv) == 0
        assert (tmp_path / "rpc").is_dir(), "--cache-dir made"
    assert _run(argv) != 0
