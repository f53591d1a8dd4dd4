"""KV events in vLLM's format, decoded by vLLM's own definitions (``vllm/distributed/kv_events.py`` of the vLLM
0.34.0 wheel, read from the wheel ``tools/fetch-vllm-events`` keeps in pip's cache, never installed): what a
subscriber rebuilds from them equals what the server holds (``GET /api/kv-cache``) after a scripted sequence of
requests, a slot's prompt moving to host memory and disk, a runner killed for real and its restart; the token ids
the events name are the ones the render route gives; and a scorer that knows only the events sends a request to
the replica that holds its prefix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from service.engine.base import CachedPrompt
from service.residency.kv_events import KvEventPublisher, held_blocks
from tests.conftest import EMBEDDED_NAME, ROOT, ServiceProcess, free_port

BLOCK = 16
STORY = ("The keeper of the lighthouse on the northern cape wrote in his log every evening. He noted the wind, the "
         "height of the waves, the ships that passed and the birds that rested on the rail. ")


def _vllm_events() -> types.ModuleType:
    """vLLM 0.34.0's kv_events module, executed from its wheel with its four vLLM imports stubbed (configuration,
    logging and networking helpers the decoding does not use; ``ExternalBlockHash`` as vLLM defines it)."""
    out = subprocess.run(["bash", str(ROOT / "tools" / "fetch-vllm-events"), sys.executable], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    wheel = out.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as z:
        source = z.read("vllm/distributed/kv_events.py").decode()
    stubs = {
        "vllm.config.kv_events": {"KVEventsConfig": type("KVEventsConfig", (), {})},
        "vllm.logger": {"init_logger": lambda name: __import__("logging").getLogger(name)},
        "vllm.utils.network_utils": {n: (lambda *a, **k: None) for n in
                                     ("get_ip", "get_tcp_uri", "is_valid_ipv6_address", "split_zmq_path")},
        "vllm.v1.core.kv_cache_utils": {"ExternalBlockHash": bytes | int},
    }
    saved = {k: sys.modules.get(k) for k in ["vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core", *stubs]}
    try:
        for name in saved:
            mod = types.ModuleType(name)
            mod.__dict__.update(stubs.get(name, {}))
            sys.modules[name] = mod
        module = types.ModuleType("vllm_kv_events")
        sys.modules[module.__name__] = module  # msgspec resolves the events' annotations through it
        exec(compile(source, f"{wheel}!vllm/distributed/kv_events.py", "exec"), module.__dict__)
        return module
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


@pytest.fixture(scope="module")
def vllm() -> types.ModuleType:
    return _vllm_events()


class Subscriber:
    """A consumer of one server's events: vLLM's decoder, and the blocks it believes each topic holds."""

    def __init__(self, vllm: types.ModuleType, endpoint: str) -> None:
        import msgspec
        import zmq

        self.vllm = vllm
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=vllm.KVEventBatch)
        self.state: dict[bytes, dict[str, dict[Any, tuple[Any, tuple[int, ...]]]]] = {}
        self.seqs: list[int] = []
        self.kinds: list[str] = []
        self.media: set[str] = set()

    def drain(self, wait_s: float = 0.0) -> None:
        import zmq

        deadline = time.monotonic() + wait_s
        while True:
            if not self.sub.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                return
            topic, seq, payload = self.sub.recv_multipart(zmq.NOBLOCK)
            self.seqs.append(int.from_bytes(seq, "big"))
            batch = self.decoder.decode(payload)
            held = self.state.setdefault(topic, {})
            for e in batch.events:
                self.kinds.append(type(e).__name__)
                if isinstance(e, self.vllm.AllBlocksCleared):
                    held.clear()
                elif isinstance(e, self.vllm.BlockRemoved):
                    for h in e.block_hashes:
                        del held.setdefault(e.medium, {})[h]  # a removal names a block it stored
                elif isinstance(e, self.vllm.BlockStored):
                    assert e.block_size == BLOCK and len(e.token_ids) == BLOCK * len(e.block_hashes)
                    self.media.add(e.medium)
                    medium = held.setdefault(e.medium, {})
                    assert e.parent_block_hash is None or e.parent_block_hash in medium, "a parent before its child"
                    parent = e.parent_block_hash
                    for i, h in enumerate(e.block_hashes):
                        medium[h] = (parent, tuple(e.token_ids[i * BLOCK:(i + 1) * BLOCK]))
                        parent = h

    def blocks(self, topic: bytes) -> dict[str, set[Any]]:
        return {m: set(b) for m, b in self.state.get(topic, {}).items() if b}

    def chains(self, topic: bytes, medium: str) -> list[list[int]]:
        """Each held chain's tokens, from a root to a leaf."""
        held = self.state.get(topic, {}).get(medium, {})
        parents = {p for p, _ in held.values()}
        out = []
        for h in held:
            if h in parents:
                continue
            tokens: list[int] = []
            while h is not None:
                p, t = held[h]
                tokens[:0] = t
                h = p
            out.append(tokens)
        return out

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


def test_a_subscriber_rebuilds_what_the_publisher_holds(vllm: types.ModuleType) -> None:
    pub = KvEventPublisher("tcp://127.0.0.1:*", block_size=BLOCK, topic="kv@{host}@{model}")
    sub = Subscriber(vllm, pub.endpoint)
    try:
        time.sleep(0.3)  # ZeroMQ's slow joiner: a PUB drops what it sends before the SUB is connected
        a = tuple(range(1, 70))
        steps = [
            (1, [CachedPrompt("GPU", "", a)]),  # 4 whole blocks of 69 tokens
            (1, [CachedPrompt("GPU", "", a + (7,) * 40)]),  # the same prompt grew: 2 more blocks
            (1, [CachedPrompt("GPU", "", a[:20] + (9,) * 30), CachedPrompt("CPU", "", a + (7,) * 40),
                 CachedPrompt("DISK", "", a)]),  # the slot took another prompt sharing a block; the first moved
            (1, [CachedPrompt("GPU", "other-key", a)]),  # another scope: other names for the same tokens
            (2, [CachedPrompt("DISK", "", a)]),  # a restart: only the disk's survived
        ]
        topic = pub.topic_of("m")
        for incarnation, prompts in steps:
            pub.update("m", (incarnation,), prompts)
            sub.drain(1.0)
            want = {m: set(b) for m, b in held_blocks(prompts, BLOCK).items() if b}
            assert sub.blocks(topic) == want
        # One AllBlocksCleared, the process's first batch (llm-d clears every model of the pod on it); a restart's
        # losses are BlockRemoved.
        assert sub.kinds.count("AllBlocksCleared") == 1 and sub.kinds[0] == "AllBlocksCleared"
        assert "BlockRemoved" in sub.kinds
        assert sub.media == {"GPU", "CPU", "STORAGE"}
        assert sub.chains(topic, "STORAGE") == [list(a[:64])]
        pub.gone("m")
        sub.drain(1.0)
        assert sub.blocks(topic) == {} and sub.seqs == list(range(len(sub.seqs)))
    finally:
        sub.close()
        pub.close()


def _runner_pid(svc: ServiceProcess) -> int:
    models = {m["name"]: m for m in svc.client.get("/api/models").json()["models"]}
    return int(models[EMBEDDED_NAME]["runner"]["pid"])


def _server_blocks(svc: ServiceProcess) -> dict[str, set[int]]:
    (model,) = svc.client.get("/api/kv-cache").json()["models"]
    out: dict[str, set[int]] = {}
    for p in model["prompts"]:
        if p["block_hashes"]:
            out.setdefault(p["medium"], set()).update(p["block_hashes"])
    return out


def _settle(svc: ServiceProcess, sub: Subscriber, topic: bytes, timeout_s: float = 20) -> dict[str, set[int]]:
    """Wait until the decoded events equal what the server holds (the publisher reads every 0.2 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sub.drain(0.3)
        held = _server_blocks(svc)
        if sub.blocks(topic) == held or time.monotonic() > deadline:
            assert sub.blocks(topic) == held
            return held


@pytest.fixture
def events_service(tmp_path: Path, embedded_model: str) -> Iterator[tuple[ServiceProcess, str]]:
    port = free_port()
    svc = ServiceProcess({"GGUF_MODELS_DIR": str(tmp_path / "models"), "GGUF_CONTEXT_LENGTH": "2048",
                          "GGUF_DEFAULT_MODEL": EMBEDDED_NAME,
                          "GGUF_PARALLEL": "1", "GGUF_KV_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{port}",
                          "GGUF_KV_EVENTS_BLOCK_SIZE": str(BLOCK), "GGUF_PROMPT_CACHE_DIR": str(tmp_path / "pcache"),
                          "GGUF_SPECULATIVE": "off"}, tmp_path / "service.log")
    (tmp_path / "models").mkdir()
    with svc.running(ready=False):
        yield svc, f"tcp://127.0.0.1:{port}"


@pytest.mark.slow
def test_events_follow_the_servers_cache_through_requests_and_a_restart(
        events_service: tuple[ServiceProcess, str], vllm: types.ModuleType) -> None:
    svc, endpoint = events_service
    sub = Subscriber(vllm, endpoint)
    try:
        svc.wait_ready()
        topic = f"kv@{__import__('socket').gethostname()}@{EMBEDDED_NAME}".encode()
        c = svc.client
        first = {"prompt": STORY + "Tonight he wrote:", "max_tokens": 8, "temperature": 0}
        second = {"prompt": "A recipe for bread. " * 6, "max_tokens": 8, "temperature": 0}
        assert c.post("/v1/completions", json=first).status_code == 200
        held = _settle(svc, sub, topic)
        assert "GPU" in held and "CPU" not in held, held
        ids = c.post("/v1/completions/render", json=first).json()[0]["token_ids"]
        (chain,) = sub.chains(topic, "GPU")
        assert chain[:len(ids) // BLOCK * BLOCK] == ids[:len(ids) // BLOCK * BLOCK], "the render route's ids"

        assert c.post("/v1/completions", json=second).status_code == 200  # one slot: the first prompt moves out
        held = _settle(svc, sub, topic)
        assert {"GPU", "CPU"} <= set(held)
        deadline = time.monotonic() + 20  # the disk copy is written behind
        while "STORAGE" not in held and time.monotonic() < deadline:
            held = _settle(svc, sub, topic)
        assert "STORAGE" in held
        ids2 = c.post("/v1/completions/render", json=second).json()[0]["token_ids"]
        (chain,) = sub.chains(topic, "GPU")
        assert chain[:2 * BLOCK] == ids2[:2 * BLOCK], "the slot holds the second prompt now"
        moved = [ch for medium in ("CPU", "STORAGE") for ch in sub.chains(topic, medium)]
        whole = len(ids) // BLOCK * BLOCK
        assert whole >= 2 * BLOCK and any(ch[:whole] == ids[:whole] for ch in moved), [(len(ch), ch[:8]) for ch in moved]

        pid = _runner_pid(svc)
        seen = len(sub.kinds)
        os.kill(pid, signal.SIGKILL)  # the slots and the host memory's cache die with it; the disk's stays
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            models = {m["name"]: m for m in c.get("/api/models").json()["models"]}
            runner = models[EMBEDDED_NAME].get("runner") or {}
            if runner.get("state") == "loaded" and runner.get("pid") != pid:
                break
            time.sleep(0.2)
        held = _settle(svc, sub, topic)
        assert "BlockRemoved" in sub.kinds[seen:] and "AllBlocksCleared" not in sub.kinds[seen:]
        # The new runner holds no slot yet; what it holds came back from disk (warmed into host memory too).
        assert "GPU" not in held and "STORAGE" in held and held.get("CPU", set()) <= held["STORAGE"], held
    finally:
        sub.close()


@pytest.mark.slow
def test_a_scorer_that_knows_only_the_events_routes_to_the_replica_holding_the_prefix(
        tmp_path: Path, embedded_model: str, vllm: types.ModuleType) -> None:
    ports = [free_port(), free_port()]
    replicas = []
    subs = []
    try:
        for i, port in enumerate(ports):
            (tmp_path / f"m{i}").mkdir()
            svc = ServiceProcess({"GGUF_MODELS_DIR": str(tmp_path / f"m{i}"), "GGUF_CONTEXT_LENGTH": "2048",
                                  "GGUF_DEFAULT_MODEL": EMBEDDED_NAME,
                                  "GGUF_PARALLEL": "1", "GGUF_KV_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{port}",
                                  "GGUF_KV_EVENTS_BLOCK_SIZE": str(BLOCK), "GGUF_SPECULATIVE": "off"},
                                 tmp_path / f"r{i}.log")
            replicas.append(svc)
            subs.append(Subscriber(vllm, f"tcp://127.0.0.1:{port}"))
        for svc in replicas:
            svc.wait_healthy()
            svc.wait_ready()
        topic = f"kv@{__import__('socket').gethostname()}@{EMBEDDED_NAME}".encode()
        prompts = [STORY + "The first night:", "A recipe for bread. " * 12]
        for svc, p in zip(replicas, prompts):
            assert svc.client.post("/v1/completions", json={"prompt": p, "max_tokens": 4}).status_code == 200
        for svc, sub in zip(replicas, subs):
            _settle(svc, sub, topic)

        # The scorer: its own keys from the events' token ids alone (as llm-d's indexer), never the server's hashes.
        def keys(tokens: list[int]) -> list[int]:
            out, k = [], 0
            for i in range(0, len(tokens) - BLOCK + 1, BLOCK):
                k = hash((k, tuple(tokens[i:i + BLOCK])))
                out.append(k)
            return out

        index = [{k for medium in ("GPU", "CPU") for ch in sub.chains(topic, medium) for k in keys(ch)}
                 for sub in subs]
        request = {"prompt": STORY + "The second night, a storm:", "max_tokens": 4, "temperature": 0}
        ids = replicas[1].client.post("/v1/completions/render", json=request).json()[0]["token_ids"]
        wanted = keys(ids)

        def score(held: set[int]) -> int:
            n = 0
            while n < len(wanted) and wanted[n] in held:
                n += 1
            return n

        scores = [score(held) for held in index]
        assert scores[0] >= len(STORY) // 8 // BLOCK and scores[1] == 0, scores  # the story's blocks, on replica 0
        assert scores.index(max(scores)) == 0
    finally:
        for sub in subs:
            sub.close()
        for svc in replicas:
            svc.stop()
