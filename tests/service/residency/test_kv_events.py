"""KV events in vLLM's format, decoded by vLLM's own definitions (``vllm/distributed/kv_events.py`` of the vLLM
0.34.0 wheel, read from the wheel ``tools/fetch-vllm-events`` keeps in pip's cache, never installed): what a
subscriber rebuilds from them equals what the server holds (``GET /api/kv-cache``) after a scripted sequence of
requests, a slot's prompt moving to host memory and disk, a runner killed for real and its restart; the token ids
the events name are the ones the render route gives; and a scorer that knows only the events sends a request to
the replica that holds its prefix.

Private by default (issue 54): an endpoint beyond loopback stops the start unless CURVE or the operator's opt-in
says otherwise; a subscriber the bind address, the missing server key or a key outside the allow-list keeps out
reads nothing of two API keys' prompts, while the allowed CURVE subscriber decodes them as before; hash-only events
carry the same hashes and no token ids."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from service.engine.base import CachedPrompt
from service.residency.kv_events import (Curve, KvEventPublisher, KvEventsRefused, check_endpoint, check_settings,
                                        held_blocks)
from service.settings import Settings
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

    def __init__(self, vllm: types.ModuleType, endpoint: str, *, curve: tuple[bytes, bytes, bytes] | None = None,
                 hash_only: bool = False) -> None:
        """``curve``: the server's public key, this subscriber's public and secret keys (Z85)."""
        import msgspec
        import zmq

        self.vllm = vllm
        self.hash_only = hash_only
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            self.sub.curve_serverkey, self.sub.curve_publickey, self.sub.curve_secretkey = curve
        self.sub.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=vllm.KVEventBatch)
        self.state: dict[bytes, dict[str, dict[Any, tuple[Any, tuple[int, ...]]]]] = {}
        self.seqs: list[int] = []
        self.kinds: list[str] = []
        self.media: set[str] = set()
        self.stored: list[Any] = []
        """Every ``BlockStored`` decoded, in order."""

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
                    self.stored.append(e)
                    assert e.block_size == BLOCK
                    assert len(e.token_ids) == (0 if self.hash_only else BLOCK * len(e.block_hashes))
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


def _outside_address() -> str:
    """An IPv4 address of this machine that is not loopback (what another host would connect to): there is no
    second host here, so a subscriber connecting to it stands for one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: UDP's connect sends nothing; the kernel picks the source
            addr = s.getsockname()[0]
        except OSError:
            addr = "127.0.0.1"
    if ipaddress.ip_address(addr).is_loopback:
        found = [a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
        addr = next((a for a in found if not ipaddress.ip_address(a).is_loopback), addr)
    if ipaddress.ip_address(addr).is_loopback:
        pytest.skip("this machine has no address but loopback: nothing to connect from beyond it")
    return addr


def _frames(sub: Subscriber, wait_s: float) -> int:
    """How many messages ``sub`` receives within ``wait_s``."""
    n = 0
    deadline = time.monotonic() + wait_s
    while sub.sub.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        sub.sub.recv_multipart()
        n += 1
    return n


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557", "tcp://eth0:5557",
                                      "tcp://10.1.2.3:5557", "tcp://kv.example.com:5557", "udp://127.0.0.1:5557"])
def test_an_endpoint_beyond_loopback_is_refused_unless_told(endpoint: str) -> None:
    with pytest.raises(KvEventsRefused, match="GGUF_KV_EVENTS_ALLOW_PUBLIC") as refused:
        check_endpoint(endpoint, allow_public=False, curve=False)
    assert "\n" not in str(refused.value) and endpoint in str(refused.value)
    check_endpoint(endpoint, allow_public=True, curve=False)  # the operator said so
    check_endpoint(endpoint, allow_public=False, curve=True)  # subscribers must hold a listed key
    with pytest.raises(KvEventsRefused, match="GGUF_KV_EVENTS_ALLOW_PUBLIC"):  # the publisher itself refuses it too
        KvEventPublisher(endpoint.replace("5557", "0"), block_size=BLOCK, topic="t")


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://127.0.0.2:*", "tcp://[::1]:5557",
                                      "tcp://localhost:5557", "ipc:///run/gguf/kv.sock", "inproc://kv"])
def test_a_loopback_or_local_endpoint_needs_nothing(endpoint: str) -> None:
    check_endpoint(endpoint, allow_public=False, curve=False)


def test_a_loopback_publisher_reaches_no_one_beyond_it(vllm: types.ModuleType) -> None:
    """Bound to loopback, as the docs show it: a subscriber connecting to this machine's outside address receives
    nothing while a local one decodes every batch; with the opt-in, the same outside subscriber reads the prompt."""
    outside = _outside_address()
    prompt = CachedPrompt("GPU", "", tuple(range(100, 100 + 3 * BLOCK)))
    for allow_public in (False, True):
        pub = KvEventPublisher("tcp://*:0" if allow_public else "tcp://127.0.0.1:0", block_size=BLOCK, topic="t",
                               allow_public=allow_public)
        port = pub.endpoint.rsplit(":", 1)[1]
        local, remote = Subscriber(vllm, f"tcp://127.0.0.1:{port}"), Subscriber(vllm, f"tcp://{outside}:{port}")
        try:
            time.sleep(0.5)  # ZeroMQ's slow joiner
            pub.update("m", (1,), [prompt])
            local.drain(0.5)
            remote.drain(0.5)
            assert local.chains(b"t", "GPU") == [list(prompt.tokens)]
            assert remote.chains(b"t", "GPU") == ([list(prompt.tokens)] if allow_public else []), allow_public
        finally:
            local.close()
            remote.close()
            pub.close()


def _key_file(path: Path, secret: bytes, mode: int = 0o600, *, certificate: bool = False) -> str:
    text = (f'#   ZeroMQ CURVE **Secret** Certificate\ncurve\n    public-key = "{"x" * 40}"\n'
            f'    secret-key = "{secret.decode()}"\n') if certificate else f"# the KV events' key\n{secret.decode()}\n"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_the_curve_settings_are_checked_at_start(tmp_path: Path) -> None:
    import zmq

    server_pub, server_sec = zmq.curve_keypair()
    client_pub, _ = zmq.curve_keypair()
    ok = _key_file(tmp_path / "kv.key", server_sec)
    base = {"kv_events_endpoint": "tcp://*:5557", "kv_events_curve_client_keys": f" {client_pub.decode()} ,"}

    curve = check_settings(Settings(**base, kv_events_curve_secret_key_file=ok))
    assert curve == Curve(server_sec, frozenset([client_pub])) and curve.public_key == server_pub
    cert = _key_file(tmp_path / "kv.key_secret", server_sec, 0o400, certificate=True)  # zmq.auth's certificate
    assert check_settings(Settings(**base, kv_events_curve_secret_key_file=cert)) == curve
    assert check_settings(Settings(kv_events_endpoint=None, kv_events_curve_client_keys="junk")) is None

    refusals = {
        "readable or writable by others (mode 644)": {"kv_events_curve_secret_key_file":
                                                      _key_file(tmp_path / "open.key", server_sec, 0o644)},
        "holds no CURVE secret key": {"kv_events_curve_secret_key_file": _key_file(tmp_path / "short.key", b"abc")},
        "cannot be read": {"kv_events_curve_secret_key_file": str(tmp_path / "missing.key")},
        "key 2 is not a CURVE public key": {"kv_events_curve_secret_key_file": ok,
                                            "kv_events_curve_client_keys": f"{client_pub.decode()},nope"},
        "go together": {"kv_events_curve_secret_key_file": ok, "kv_events_curve_client_keys": None},
    }
    for says, change in refusals.items():
        with pytest.raises(KvEventsRefused, match=re.escape(says)) as refused:
            check_settings(Settings(**{**base, **change}))
        assert server_sec.decode() not in str(refused.value), "an error never quotes the secret"
    with pytest.raises(KvEventsRefused, match="go together"):
        check_settings(Settings(kv_events_endpoint="tcp://127.0.0.1:5557", kv_events_curve_secret_key_file=ok))
    with pytest.raises(KvEventsRefused, match="GGUF_KV_EVENTS_ALLOW_PUBLIC"):  # no CURVE: loopback or the opt-in
        check_settings(Settings(kv_events_endpoint="tcp://*:5557"))
    assert check_settings(Settings(kv_events_endpoint="tcp://*:5557", kv_events_allow_public=True)) is None


def _run_service(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_")}
    full.update({"GGUF_DEFAULT_MODEL": "", "GGUF_PORT": "0", **env})
    return subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=60)


def test_the_server_refuses_to_start_with_public_events_it_was_not_told_to_allow(tmp_path: Path) -> None:
    """docs/configuration.md's old example, tcp://*:5557, and a CURVE key the whole machine can read: exit 2 and
    one line naming the setting, before anything loads or binds."""
    import zmq

    p = _run_service({"GGUF_KV_EVENTS_ENDPOINT": f"tcp://*:{free_port()}"})
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    (line,) = [ln for ln in p.stderr.splitlines() if "GGUF_KV_EVENTS" in ln]
    assert line.startswith("gguf-server: invalid settings: GGUF_KV_EVENTS_ENDPOINT") and \
        "GGUF_KV_EVENTS_ALLOW_PUBLIC=true" in line, p.stderr
    server_pub, server_sec = zmq.curve_keypair()
    p = _run_service({"GGUF_KV_EVENTS_ENDPOINT": f"tcp://*:{free_port()}",
                      "GGUF_KV_EVENTS_CURVE_SECRET_KEY_FILE": _key_file(tmp_path / "kv.key", server_sec, 0o640),
                      "GGUF_KV_EVENTS_CURVE_CLIENT_KEYS": server_pub.decode()})
    assert p.returncode == 2 and "mode 640" in p.stderr and server_sec.decode() not in p.stderr, p.stderr


def test_hash_only_events_name_the_same_blocks_without_their_tokens(vllm: types.ModuleType) -> None:
    """GGUF_KV_EVENTS_TOKEN_IDS=false: every BlockStored vLLM decodes has empty token ids, and the hashes, parents,
    media and removals are those of the full events for the same history."""
    full = KvEventPublisher("tcp://127.0.0.1:0", block_size=BLOCK, topic="kv@{host}@{model}")
    bare = KvEventPublisher.from_settings(Settings(kv_events_endpoint="tcp://127.0.0.1:0", kv_events_token_ids=False,
                                                   kv_events_block_size=BLOCK))
    subs = [Subscriber(vllm, full.endpoint), Subscriber(vllm, bare.endpoint, hash_only=True)]
    try:
        time.sleep(0.5)  # ZeroMQ's slow joiner
        a = tuple(range(1, 70))
        for incarnation, prompts in [(1, [CachedPrompt("GPU", "", a)]),
                                     (1, [CachedPrompt("GPU", "k", a[:40]), CachedPrompt("CPU", "", a + (5,) * 40)]),
                                     (2, [CachedPrompt("DISK", "", a)])]:
            for pub in (full, bare):
                pub.update("m", (incarnation,), prompts)
            for sub in subs:
                sub.drain(0.4)
        with_ids, without = subs
        assert len(with_ids.stored) >= 4 and with_ids.kinds == without.kinds
        assert all(e.token_ids for e in with_ids.stored) and not any(e.token_ids for e in without.stored)
        same = [[(e.block_hashes, e.parent_block_hash, e.medium, e.block_size) for e in sub.stored] for sub in subs]
        assert same[0] == same[1]
        topic = full.topic_of("m")
        assert with_ids.blocks(topic) == without.blocks(topic) == {"STORAGE": {b for b in held_blocks(
            [CachedPrompt("DISK", "", a)], BLOCK)["STORAGE"]}}
    finally:
        for sub in subs:
            sub.close()
        full.close()
        bare.close()


@pytest.mark.slow
def test_the_kv_events_sniff(tmp_path: Path, embedded_model: str, vllm: types.ModuleType) -> None:
    """A server with two API keys publishing on every interface, CURVE on. A subscriber with no key of its own
    (plain, over loopback and over this machine's outside address) and one whose key is not listed receive not one
    message of the two keys' prompts; the router, whose key is listed, decodes them with vLLM's definitions as the
    render route tokenizes them."""
    import zmq

    outside = _outside_address()
    server_pub, server_sec = zmq.curve_keypair()
    router_pub, router_sec = zmq.curve_keypair()
    intruder_pub, intruder_sec = zmq.curve_keypair()
    port = free_port()
    keys = {"alice": "alice-key-0123456789", "bob": "bob-key-9876543210"}
    (tmp_path / "models").mkdir()
    svc = ServiceProcess({"GGUF_MODELS_DIR": str(tmp_path / "models"), "GGUF_CONTEXT_LENGTH": "2048",
                          "GGUF_DEFAULT_MODEL": EMBEDDED_NAME, "GGUF_PARALLEL": "2", "GGUF_SPECULATIVE": "off",
                          "GGUF_API_KEYS": ",".join(keys.values()), "GGUF_API_KEY_FILE": None,
                          "GGUF_KV_EVENTS_ENDPOINT": f"tcp://*:{port}", "GGUF_KV_EVENTS_BLOCK_SIZE": str(BLOCK),
                          "GGUF_KV_EVENTS_CURVE_SECRET_KEY_FILE": _key_file(tmp_path / "kv.key", server_sec),
                          "GGUF_KV_EVENTS_CURVE_CLIENT_KEYS": router_pub.decode()}, tmp_path / "service.log")
    router = Subscriber(vllm, f"tcp://127.0.0.1:{port}", curve=(server_pub, router_pub, router_sec))
    sniffers = [Subscriber(vllm, f"tcp://127.0.0.1:{port}"), Subscriber(vllm, f"tcp://{outside}:{port}"),
                Subscriber(vllm, f"tcp://{outside}:{port}", curve=(server_pub, intruder_pub, intruder_sec))]
    try:
        with svc.running():
            topic = f"kv@{socket.gethostname()}@{EMBEDDED_NAME}".encode()
            prompts = {"alice": STORY + "Alice's account number is 4417 and her password is heron-lantern.",
                       "bob": "Bob's diagnosis, kept private: " + "the results of the scan were clear. " * 5}
            wanted = {}
            for who, prompt in prompts.items():
                auth = {"Authorization": f"Bearer {keys[who]}"}
                body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
                assert svc.client.post("/v1/completions", json=body, headers=auth).status_code == 200
                ids = svc.client.post("/v1/completions/render", json=body, headers=auth).json()[0]["token_ids"]
                wanted[who] = ids[:len(ids) // BLOCK * BLOCK]
                assert len(wanted[who]) >= 2 * BLOCK
            deadline = time.monotonic() + 30
            while True:
                router.drain(0.3)
                chains = router.chains(topic, "GPU")
                held = {who: any(ch[:len(ids)] == ids for ch in chains) for who, ids in wanted.items()}
                if all(held.values()) or time.monotonic() > deadline:
                    break
            assert all(held.values()), (held, svc.log())  # the listed subscriber reads both keys' prompts
            assert router.kinds[0] == "AllBlocksCleared" and router.seqs == list(range(len(router.seqs)))
            assert [_frames(sniffer, 1.0) for sniffer in sniffers] == [0, 0, 0]
            log = svc.log_path.read_text(errors="replace")  # whole: svc.log() is its last 5,000 characters
            assert intruder_pub.decode() in log and router_pub.decode() not in log, "the refused key is logged"
            assert f"server public key {server_pub.decode()}" in log and server_sec.decode() not in log
    finally:
        for sub in (router, *sniffers):
            sub.close()


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
