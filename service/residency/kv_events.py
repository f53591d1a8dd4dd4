"""KV events in vLLM's format: which prompt blocks each loaded model holds, for a router that routes by prefix.

llm-d's precise prefix-cache scorer (and NVIDIA Dynamo's router) subscribe to each replica's events over ZeroMQ and
send a request where most of its leading blocks are held. The format is vLLM's (``vllm/distributed/kv_events.py``
of vLLM 0.34.0): a PUB socket sends ``(topic, sequence as 8 bytes big-endian, payload)``; the payload is a msgpack
``KVEventBatch``, the array ``[ts, events]``, each event a map tagged by ``type``: ``BlockStored`` (the blocks'
hashes, the parent's hash, their token ids, ``block_size``, ``lora_id``, ``medium``, ``lora_name``),
``BlockRemoved`` (hashes and ``medium``) or ``AllBlocksCleared``.

llama.cpp has no blocks: a slot holds a run of tokens. Here a held prompt is cut into blocks of ``block_size``
tokens (``GGUF_KV_EVENTS_BLOCK_SIZE``; only whole blocks, as vLLM publishes them), each hashed with its parent's
hash and the prompt's scope (the API key's and ``cache_salt``'s: requests of another scope cannot reuse it), so a
block is named by everything before it. The media: ``GPU`` for a slot's KV (llama.cpp's cache, on the cards or in
host memory on a CPU-only load), ``CPU`` for a prompt saved in host memory beyond the slots and ``STORAGE`` (vLLM's
name) for one on disk (``service.engine.prompt_cache``).

The publisher reads what each model holds (``Engine.cached_prompts``) whenever its gauges moved, and sends the
difference from what it published last: stored blocks in chain order (a parent before its children), removed
ones. The process's first batch starts with ``AllBlocksCleared`` (a subscriber may still hold what an earlier
server process published); after that a model's own losses are ``BlockRemoved`` of everything it had published,
never ``AllBlocksCleared`` (llm-d's router clears every model of the pod on that event): when its runner process
dies (its slots and host memory went with it; the disk's blocks come back with the restart), when it is reloaded,
and when it is unloaded. One topic per model
(``GGUF_KV_EVENTS_TOPIC``, by default ``kv@<host>@<model>``, llm-d's convention). Not built: vLLM's replay socket
(a subscriber that missed batches cannot ask for them again; the next change still brings its state).

Private by default (issue 54): the token ids are the prompts of every API key, and a ZeroMQ PUB socket answers
whoever connects. So the endpoint must be loopback or local (``check_endpoint``) unless the socket is CURVE's
(``Curve``: the server's secret key and the subscribers' public keys allowed, enforced by pyzmq's ZAP
authenticator, ZeroMQ's RFC 27) or the operator says ``GGUF_KV_EVENTS_ALLOW_PUBLIC``, which llm-d needs: its
subscriber (llm-d-router ``pkg/kvevents/zmq_subscriber.go``) is go-zeromq/zmq4, which has no CURVE. With
``GGUF_KV_EVENTS_TOKEN_IDS`` off a ``BlockStored`` carries no token ids, the same hashes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import socket
import stat
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..engine.base import CachedPrompt
from ..hosts import is_loopback
from ..settings import Settings

log = logging.getLogger(__name__)

MEDIA = {"GPU": "GPU", "CPU": "CPU", "DISK": "STORAGE"}
"""The engine's media under vLLM's names (``MEDIUM_GPU``, ``MEDIUM_CPU``, ``MEDIUM_STORAGE``)."""
DEFAULT_TOPIC = "kv@{host}@{model}"
"""A model's topic unless ``GGUF_KV_EVENTS_TOPIC`` says otherwise (llm-d's convention)."""
POLL_S = 0.2
"""How often the publisher reads each loaded model's gauges (one round trip to its runner)."""
ZAP_DOMAIN = "gguf-kv-events"
"""The ZAP domain of the PUB socket: the authenticator checks CURVE keys for it."""
LOCAL_TRANSPORTS = ("ipc", "inproc")
"""ZeroMQ transports no other machine reaches: a Unix socket (its file's mode decides who on this machine may
connect), and this process."""


class KvEventsRefused(ValueError):
    """Settings the KV events must not start with: one line naming the setting (the service exits 2 on it)."""


def check_endpoint(endpoint: str, *, allow_public: bool, curve: bool) -> None:
    """Refuse an endpoint other machines reach, unless its subscribers must authenticate (CURVE) or the operator said
    so. Local: ``ipc://``, ``inproc://``, and ``tcp://`` on a loopback address or ``localhost``; everything else,
    ``tcp://*``, an interface name, a host name, another transport, counts as public (a name may resolve anywhere)."""
    transport, sep, address = endpoint.partition("://")
    if not sep or not address:
        raise KvEventsRefused(f"GGUF_KV_EVENTS_ENDPOINT {endpoint!r}: expected TRANSPORT://ADDRESS, e.g. "
                              "tcp://127.0.0.1:5557")
    if endpoint_is_local(endpoint) or curve or allow_public:
        return
    raise KvEventsRefused(
        f"GGUF_KV_EVENTS_ENDPOINT {endpoint} listens beyond loopback, unauthenticated, and the KV events carry the "
        "token ids of every API key's prompts: bind tcp://127.0.0.1:PORT, or set GGUF_KV_EVENTS_CURVE_SECRET_KEY_FILE "
        "and GGUF_KV_EVENTS_CURVE_CLIENT_KEYS for subscribers that can do CURVE, or set "
        "GGUF_KV_EVENTS_ALLOW_PUBLIC=true on a network that only the router reaches (docs/deployment.md)")


def endpoint_is_local(endpoint: str) -> bool:
    transport, _, address = endpoint.partition("://")
    if transport.lower() in LOCAL_TRANSPORTS:
        return True
    if transport.lower() != "tcp":
        return False
    return is_loopback(address.rpartition(":")[0])


def z85_key(text: str) -> bytes | None:
    """A CURVE key in Z85 (40 characters for 32 bytes, ZeroMQ's RFC 32), as bytes; None if it is not one."""
    from zmq.utils import z85

    raw = text.strip().encode("ascii", "replace")
    if len(raw) != 40:
        return None
    try:
        z85.decode(raw)
    except (KeyError, ValueError, struct.error):
        return None
    return raw


_CERT_SECRET = re.compile(r'^\s*secret-key\s*=\s*"([^"]*)"\s*$')


@dataclass(frozen=True)
class Curve:
    """The PUB socket as a CURVE server (ZeroMQ's RFC 26): its secret key and the subscribers' public keys allowed,
    Z85. A subscriber needs the server's public key and a key of the list: without them its handshake fails and it
    receives nothing."""

    secret_key: bytes
    client_keys: frozenset[bytes]

    @property
    def public_key(self) -> bytes:
        import zmq

        return zmq.curve_public(self.secret_key)


def read_secret_key(path: str) -> bytes:
    """The secret key in ``path``: the file must be its owner's alone (as ssh wants a private key), and hold the Z85
    key alone or as the ``secret-key`` line of a ZeroMQ certificate. The errors never quote the file."""
    name = "GGUF_KV_EVENTS_CURVE_SECRET_KEY_FILE"
    try:
        with open(path, encoding="utf-8") as fh:
            mode = stat.S_IMODE(os.fstat(fh.fileno()).st_mode)
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise KvEventsRefused(f"{name} {path!r} cannot be read: {type(exc).__name__}") from None
    if mode & 0o077:
        raise KvEventsRefused(f"{name} {path!r} is readable or writable by others (mode {mode:o}): chmod 600 it "
                              "(Kubernetes: the Secret volume's defaultMode 0400)")
    cert = [m.group(1) for m in map(_CERT_SECRET.match, lines) if m]
    bare = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    candidates = cert or (bare if len(bare) == 1 else [])
    key = z85_key(candidates[0]) if len(candidates) == 1 else None
    if key is None:
        raise KvEventsRefused(f"{name} {path!r} holds no CURVE secret key: expected its 40 Z85 characters alone, or a "
                              "ZeroMQ certificate's secret-key line")
    return key


def curve_of(settings: Settings) -> Curve | None:
    """The CURVE settings, read and checked; None when neither is set."""
    path, listed = settings.kv_events_curve_secret_key_file, settings.kv_events_curve_client_keys
    if not path and not listed:
        return None
    if not path or not listed:
        raise KvEventsRefused("GGUF_KV_EVENTS_CURVE_SECRET_KEY_FILE and GGUF_KV_EVENTS_CURVE_CLIENT_KEYS go together: "
                              "the server's secret key and the subscribers' public keys allowed")
    clients = []
    for i, item in enumerate(k for k in listed.split(",") if k.strip()):
        key = z85_key(item)
        if key is None:
            raise KvEventsRefused(f"GGUF_KV_EVENTS_CURVE_CLIENT_KEYS: key {i + 1} is not a CURVE public key "
                                  "(40 Z85 characters)")
        clients.append(key)
    if not clients:
        raise KvEventsRefused("GGUF_KV_EVENTS_CURVE_CLIENT_KEYS holds no key")
    return Curve(read_secret_key(path), frozenset(clients))


def check_settings(settings: Settings) -> Curve | None:
    """The start-up check (``service.__main__``): the KV-event settings the publisher would refuse, refused before
    anything loads or binds. Returns the CURVE keys read."""
    if not settings.kv_events_endpoint:
        return None
    curve = curve_of(settings)
    check_endpoint(settings.kv_events_endpoint, allow_public=settings.kv_events_allow_public, curve=curve is not None)
    return curve


@dataclass(frozen=True)
class Block:
    hash: int
    parent: int | None
    tokens: tuple[int, ...]


def block_hash(parent: int | None, scope: str, tokens: Sequence[int]) -> int:
    """A block's name: the first 8 bytes of SHA-256 over its parent's hash, the scope and its token ids, as a
    signed 64-bit integer (vLLM's ``ExternalBlockHash`` may be an int)."""
    h = hashlib.sha256()
    h.update(b"-" if parent is None else parent.to_bytes(8, "big", signed=True))
    h.update(scope.encode("utf-8") + b"\0")
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest()[:8], "big", signed=True)


def blocks_of(prompt: CachedPrompt, block_size: int) -> list[Block]:
    """A held prompt's whole blocks, in order."""
    out: list[Block] = []
    parent: int | None = None
    for start in range(0, len(prompt.tokens) - block_size + 1, block_size):
        tokens = prompt.tokens[start:start + block_size]
        h = block_hash(parent, prompt.scope, tokens)
        out.append(Block(h, parent, tokens))
        parent = h
    return out


def held_blocks(prompts: Iterable[CachedPrompt], block_size: int) -> dict[str, dict[int, Block]]:
    """vLLM's medium -> hash -> block, for everything a model holds."""
    out: dict[str, dict[int, Block]] = {}
    for p in prompts:
        by_hash = out.setdefault(MEDIA[p.medium], {})
        for b in blocks_of(p, block_size):
            by_hash.setdefault(b.hash, b)
    return out


def stored_events(new: dict[int, Block], block_size: int, medium: str, *,
                  token_ids: bool = True) -> list[dict[str, Any]]:
    """``BlockStored`` events for ``new`` blocks: runs along each chain, a parent before its children; without
    ``token_ids`` their ``token_ids`` are empty (vLLM's type is a list: an empty one decodes)."""
    children: dict[int | None, list[Block]] = {}
    for b in new.values():
        children.setdefault(b.parent, []).append(b)
    roots = [b for b in new.values() if b.parent not in new]
    events: list[dict[str, Any]] = []
    stack = sorted(roots, key=lambda b: b.hash)
    while stack:
        run = [stack.pop()]
        while True:  # follow the chain while it does not fork
            nxt = sorted(children.get(run[-1].hash, []), key=lambda b: b.hash)
            if len(nxt) != 1:
                stack.extend(nxt)
                break
            run.append(nxt[0])
        events.append({"type": "BlockStored", "block_hashes": [b.hash for b in run],
                       "parent_block_hash": run[0].parent,
                       "token_ids": [t for b in run for t in b.tokens] if token_ids else [],
                       "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None})
    return events


def diff_events(before: dict[str, dict[int, Block]], after: dict[str, dict[int, Block]],
                block_size: int, *, token_ids: bool = True) -> list[dict[str, Any]]:
    """What turns the published state ``before`` into ``after``: removals first, then stores."""
    events: list[dict[str, Any]] = []
    for medium in sorted(set(before) | set(after)):
        gone = [h for h in before.get(medium, {}) if h not in after.get(medium, {})]
        if gone:
            events.append({"type": "BlockRemoved", "block_hashes": sorted(gone), "medium": medium})
    for medium in sorted(after):
        new = {h: b for h, b in after[medium].items() if h not in before.get(medium, {})}
        if new:
            events.extend(stored_events(new, block_size, medium, token_ids=token_ids))
    return events


@dataclass
class _Model:
    incarnation: tuple[Any, ...]
    gauges: Any = None
    published: dict[str, dict[int, Block]] = field(default_factory=dict)


class _AllowList:
    """pyzmq's CURVE credentials provider (``Authenticator.configure_curve_callback``): a subscriber's key is allowed
    if listed. A refused key is logged once (a refused subscriber reconnects every 100 ms, ZMQ_RECONNECT_IVL)."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        if key not in self.refused and len(self.refused) < 64:
            self.refused.add(key)
            log.warning("KV events: refused a subscriber whose CURVE public key %s is not in "
                        "GGUF_KV_EVENTS_CURVE_CLIENT_KEYS", key.decode("ascii", "replace"))
        return False


class KvEventPublisher:
    """One PUB socket for the server; a topic and a published state per loaded model. Private unless told
    (``check_endpoint``): a loopback or local endpoint, a CURVE server, or ``allow_public``."""

    def __init__(self, endpoint: str, *, block_size: int, topic: str, token_ids: bool = True,
                 allow_public: bool = False, curve: Curve | None = None) -> None:
        import msgspec
        import zmq

        check_endpoint(endpoint, allow_public=allow_public, curve=curve is not None)
        self.block_size, self.topic, self.token_ids, self.curve = block_size, topic, token_ids, curve
        self._ctx = zmq.Context()
        self._auth: Any = None
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        try:
            if curve is not None:
                from zmq.auth.thread import ThreadAuthenticator

                # The ZAP handler before the bind: libzmq lets a CURVE client in without asking when no handler is
                # bound (ZMQ_ZAP_ENFORCE_DOMAIN is off by default), knowing the server's public key would do.
                self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger(f"{__name__}.zap"))
                self._auth.start()
                self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_AllowList(curve.client_keys))
                self._pub.curve_secretkey = curve.secret_key
                self._pub.curve_publickey = curve.public_key
                self._pub.curve_server = True
                self._pub.zap_domain = ZAP_DOMAIN.encode()
            self._pub.bind(endpoint)
        except BaseException:
            self.close()
            raise
        last = self._pub.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint = last.decode() if isinstance(last, bytes) else str(last)
        """Where it listens (a ``tcp://*:0`` endpoint gets its port here)."""
        self._encode = msgspec.msgpack.Encoder().encode
        self._seq = 0
        self._models: dict[str, _Model] = {}
        self._started = False

    @classmethod
    def from_settings(cls, settings: Settings) -> "KvEventPublisher":
        """The publisher ``GGUF_KV_EVENTS_*`` describe, checked as at start (``check_settings``), its mode logged."""
        assert settings.kv_events_endpoint
        curve = check_settings(settings)
        pub = cls(settings.kv_events_endpoint, block_size=settings.kv_events_block_size,
                  topic=settings.kv_events_topic or DEFAULT_TOPIC, token_ids=settings.kv_events_token_ids,
                  allow_public=settings.kv_events_allow_public, curve=curve)
        ids = "token ids and hashes" if pub.token_ids else "hashes only, no token ids"
        if curve is not None:
            log.info("KV events on %s (blocks of %d tokens, %s), CURVE: server public key %s, %d subscriber key(s)",
                     pub.endpoint, pub.block_size, ids, curve.public_key.decode("ascii"), len(curve.client_keys))
        elif endpoint_is_local(settings.kv_events_endpoint):
            log.info("KV events on %s (blocks of %d tokens, %s), local only", pub.endpoint, pub.block_size, ids)
        else:
            log.warning("KV events on %s (blocks of %d tokens, %s) with no authentication or encryption "
                        "(GGUF_KV_EVENTS_ALLOW_PUBLIC): whoever reaches the port reads them", pub.endpoint,
                        pub.block_size, ids)
        return pub

    def topic_of(self, model: str) -> bytes:
        return self.topic.format(host=socket.gethostname(), model=model).encode("utf-8")

    def send(self, model: str, events: list[dict[str, Any]]) -> None:
        """One ``KVEventBatch`` on the model's topic."""
        if not events:
            return
        payload = self._encode([time.time(), events])
        self._pub.send_multipart([self.topic_of(model), self._seq.to_bytes(8, "big"), payload])
        self._seq += 1

    def update(self, model: str, incarnation: tuple[Any, ...], prompts: Sequence[CachedPrompt]) -> None:
        """Publish what ``model`` holds now (``incarnation`` changes when its cache was emptied: a load, a
        runner's restart; what it had published is removed then, and the new state stored)."""
        m = self._models.get(model)
        events: list[dict[str, Any]] = []
        if not self._started:  # this process's first batch: a subscriber may hold what an earlier one published
            events.append({"type": "AllBlocksCleared"})
            self._started = True
        before = m.published if m is not None else {}
        if m is None or m.incarnation != incarnation:  # reloaded or restarted: what it held is gone
            m = self._models[model] = _Model(incarnation)
        held = held_blocks(prompts, self.block_size)
        events.extend(diff_events(before, held, self.block_size, token_ids=self.token_ids))
        m.published = held
        self.send(model, events)

    def down(self, model: str) -> None:
        """``model``'s runner process died: its slots and its prompt cache in memory went with it (the disk's
        blocks come back with the restart)."""
        m = self._models.get(model)
        if m is not None and m.published:
            self.send(model, diff_events(m.published, {}, self.block_size))
            m.published, m.gauges = {}, None

    def gone(self, model: str) -> None:
        """``model`` was unloaded: its blocks are all gone."""
        m = self._models.pop(model, None)
        if m is not None:
            self.send(model, diff_events(m.published, {}, self.block_size))

    def changed(self, model: str, incarnation: tuple[Any, ...], gauges: Any) -> bool:
        """Whether the model's gauges (or incarnation) moved since its last publication (``poll`` records them only
        once what they describe is published: a read that failed is tried again)."""
        m = self._models.get(model)
        return m is None or m.incarnation != incarnation or m.gauges != gauges

    def close(self) -> None:
        self._pub.close(0)
        if self._auth is not None:
            self._auth.stop()  # its ZAP socket would keep the context from terminating
            self._auth = None
        self._ctx.term()

    async def run(self, manager: Any) -> None:
        """Follow the loaded models until cancelled."""
        while True:
            try:
                await self.poll(manager)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a runner dying mid-read: the next poll sees its restart
                log.warning("KV events: a read of the models failed (%s: %s); trying again", type(exc).__name__, exc)
            await asyncio.sleep(POLL_S)

    async def poll(self, manager: Any) -> None:
        loaded = {s.name: s for s in manager.loaded()}
        for name in [n for n in self._models if n not in loaded]:
            self.gone(name)
        for name, state in loaded.items():
            engine = state.engine
            runner = getattr(engine, "runner_json", None)
            info = runner() if runner is not None else {}
            if info.get("state", "loaded") != "loaded":
                self.down(name)
                continue
            incarnation = (id(engine), info.get("restarts"))
            gauges = await asyncio.to_thread(engine.gauges)
            key = (gauges.kv_cells_used, gauges.prompt_tokens_evaluated, tuple(sorted(gauges.prompt_cache.items())))
            if not self.changed(name, incarnation, key):
                continue
            prompts = await asyncio.to_thread(engine.cached_prompts)
            self.update(name, incarnation, prompts)
            m = self._models.get(name)
            if m is not None:
                m.gauges = key


__all__ = ["DEFAULT_TOPIC", "Curve", "KvEventPublisher", "KvEventsRefused", "block_hash", "blocks_of",
           "check_endpoint", "check_settings", "curve_of", "diff_events", "endpoint_is_local", "held_blocks",
           "read_secret_key", "z85_key"]
