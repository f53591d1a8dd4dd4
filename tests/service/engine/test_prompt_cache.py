"""The prompt cache beyond the slots on the embedded model (issue 24): a conversation whose slot went to another
is restored from host memory or disk, token for token what a cold evaluation gives; scopes never share; bad files
are ignored, counted, and the request served from a cold prompt."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from service.engine.base import Cancel, Chunk, GenerationParams
from service.engine.llama import LlamaEngine
from service.text.served import ServedModel
from service.engine.prompt_cache import KEY_FILE, MAGIC, SEAL_BYTES, SUFFIX, PromptCache, budget, scope_of
from sizing.plan.make import Plan, PlanRequest, make_plan
from sizing.probe import probe_path
from sizing.probe.devices import host_memory

pytestmark = pytest.mark.slow

GREEDY = GenerationParams(max_tokens=8, temperature=0.0)
COLD = replace(GREEDY, cache_prompt=False)
A = ("The keeper of the lighthouse on the northern cape wrote in his log every evening. "
     "He noted the wind, the height of the waves, the ships that passed and the birds. ") * 5
B = ("A recipe for bread: flour, water, salt and yeast, mixed and kneaded, left to rise overnight, "
     "shaped in the morning and baked in a hot oven until the crust sings. ") * 5
A2 = A + " On the last evening of the year he wrote"


def _plan(path: str, cache_type: str = "f16") -> Plan:
    return make_plan(probe_path(path), [], host_memory(),
                     PlanRequest(n_ctx=2048, n_seq_max=1, cache_type=cache_type, min_ctx=256))


def _run(engine: LlamaEngine, prompt: str, params: GenerationParams = GREEDY) -> tuple[str, Chunk]:
    got = list(engine.complete(prompt, params, Cancel()))
    return "".join(c.text for c in got), got[-1]


@pytest.fixture(scope="module")
def cold(embedded_model: str) -> dict[str, str]:
    """A2's text evaluated cold (``A2``), and over A kept in its slot (``warm``: only A2's new tokens evaluated),
    with the service's exactness (batch-invariant weights). A restore from host memory or disk must give ``warm``:
    the slot's state as it was. That equals the cold text where this build's kernels compute a tail of 8 or more
    rows as a whole prompt does (``INVARIANT_MIN_ROWS``, measured on AVX2 and on the AMX hosts' builds); on an AMD
    EPYC (AVX-512, its own -march=native build) no tail of 1 to 96 rows gave a cold evaluation's logits bit for
    bit, and the texts parted at A2's third token."""
    eng = ServedModel.of(LlamaEngine(batch_invariant=True))
    eng.load(embedded_model, _plan(embedded_model))
    try:
        out = {"A2": _run(eng, A2, COLD)[0]}
        _run(eng, A)
        text, chunk = _run(eng, A2)
        assert chunk.cached_tokens > 0
        out["warm"] = text
        return out
    finally:
        eng.unload()


def _engine(path: str, tmp: Path | None = None, mib: int = 64, cache_type: str = "f16") -> LlamaEngine:
    eng = ServedModel.of(LlamaEngine(batch_invariant=True, prompt_cache_mib=mib, prompt_cache_dir=str(tmp) if tmp else None,
                      prompt_cache_disk_mib=256))
    eng.load(path, _plan(path, cache_type))
    return eng


def test_budget_is_half_of_what_the_plan_leaves_free_under_the_ceiling() -> None:
    mib = 1 << 20
    assert budget(8192 * mib, 20_000 * mib, 4_000 * mib) == 8000 * mib
    assert budget(4096 * mib, 20_000 * mib, 4_000 * mib) == 4096 * mib
    assert budget(8192 * mib, 3_000 * mib, 4_000 * mib) == 0  # the plan takes more than is free: nothing kept
    assert budget(0, 20_000 * mib, 0) == 0


def test_scopes_are_distinct_per_key_and_salt() -> None:
    assert scope_of(None, None) == ""
    assert len({scope_of("k1", None), scope_of("k2", None), scope_of("k1", "s"), scope_of(None, "s")}) == 4
    assert scope_of("k1", "s") == scope_of("k1", "s")


def test_a_conversation_beyond_the_slot_is_restored_exactly(embedded_model: str, cold: dict[str, str]) -> None:
    """One slot: A, then B takes the slot, then A's next turn restores A from host memory: it evaluates only its
    new tokens and gives what a cold evaluation gives."""
    eng = _engine(embedded_model)
    try:
        _, a = _run(eng, A)
        _, b = _run(eng, B)
        assert b.cached_tokens <= 1  # the BOS token
        g = eng.prompt_cache_gauges
        assert g["entries"] == 1 and g["bytes"] > 0 and g["budget_bytes"] == 64 << 20
        text, a2 = _run(eng, A2)
        assert a2.cached_tokens >= a.prompt_tokens - 2, (a.prompt_tokens, a2.cached_tokens)
        assert text == cold["warm"]
        g = eng.prompt_cache_gauges
        assert g["hits"] == 1 and g["restored_tokens"] == a2.cached_tokens
        assert g["entries"] == 1  # B went in when A came back out; A is in the slot, not held twice
        assert g["misses"] == 2  # A and B, the first time
    finally:
        eng.unload()


def test_another_scope_never_reuses_a_cached_prompt(embedded_model: str) -> None:
    eng = _engine(embedded_model)
    try:
        mine = replace(GREEDY, cache_scope=scope_of("key-1", None))
        theirs = replace(GREEDY, cache_scope=scope_of("key-2", None))
        _run(eng, A, mine)
        _run(eng, B, mine)
        assert _run(eng, A2, theirs)[1].cached_tokens <= 1  # neither the cache nor the slot it left
        assert _run(eng, A2, theirs)[1].cached_tokens > 0  # its own slot, now
        assert _run(eng, B, mine)[1].cached_tokens > 0  # B was kept for its own scope when the slot changed hands
    finally:
        eng.unload()


def test_an_entry_over_the_budget_is_not_kept(embedded_model: str) -> None:
    eng = _engine(embedded_model, mib=1)  # a 250-token f16 state of this model is about 4.5 MiB
    try:
        _run(eng, A)
        _run(eng, B)
        assert eng.prompt_cache_gauges["entries"] == 0
        assert _run(eng, A2)[1].cached_tokens <= 1
    finally:
        eng.unload()


def _files(tmp: Path) -> list[Path]:
    return sorted(tmp.glob(f"*/*{SUFFIX}"))


def test_conversations_survive_an_unload_on_disk(embedded_model: str, tmp_path: Path, cold: dict[str, str]) -> None:
    """A and B on disk when the model is unloaded (B from its slot); loaded again, A's next turn is restored from
    its file, exactly."""
    eng = _engine(embedded_model, tmp_path)
    try:
        _, a = _run(eng, A)
        _run(eng, B)
    finally:
        eng.unload()
    assert len(_files(tmp_path)) == 2
    eng = _engine(embedded_model, tmp_path)
    try:
        assert eng.prompt_cache_gauges["disk_entries"] == 2
        text, a2 = _run(eng, A2)
        assert a2.cached_tokens >= a.prompt_tokens - 2 and text == cold["warm"]
        assert eng.prompt_cache_gauges["hits"] == 1 and eng.prompt_cache_gauges["rejected"] == 0
    finally:
        eng.unload()


def _head(raw: bytes | bytearray) -> dict:
    at = len(MAGIC) + SEAL_BYTES
    n = struct.unpack("<I", raw[at:at + 4])[0]
    return dict(json.loads(raw[at + 4:at + 4 + n]))


def _state_at(raw: bytes | bytearray) -> int:
    """Where a file's state begins: after its header and tokens."""
    at = len(MAGIC) + SEAL_BYTES
    return at + 4 + struct.unpack("<I", raw[at:at + 4])[0] + 4 * _head(raw)["n_tokens"]


def _rewrite_header(path: Path, change: dict) -> None:
    """The file's binding changed in its header, its seal kept (tests/service/engine/test_prompt_cache_seal.py
    tampers with every other field)."""
    raw = path.read_bytes()
    at = len(MAGIC) + SEAL_BYTES
    n = struct.unpack("<I", raw[at:at + 4])[0]
    head = json.loads(raw[at + 4:at + 4 + n])
    head["binding"].update(change)
    new = json.dumps(head, sort_keys=True).encode()
    path.write_bytes(raw[:at] + struct.pack("<I", len(new)) + new + raw[at + 4 + n:])


@pytest.mark.parametrize("damage", ["truncated", "random", "flipped", "other-parameters", "other-model"])
def test_a_bad_file_is_ignored_counted_and_the_request_served_cold(embedded_model: str, tmp_path: Path,
                                                                    cold: dict[str, str], damage: str) -> None:
    eng = _engine(embedded_model, tmp_path)
    try:
        _run(eng, A)
        _run(eng, B)
    finally:
        eng.unload()
    # A's file: the one whose tokens A2 extends (the older of the two: B was saved from its slot at unload)
    files = sorted(_files(tmp_path), key=lambda p: p.stat().st_mtime_ns)
    a_file = files[0]
    if damage == "truncated":
        with open(a_file, "r+b") as f:
            f.truncate(a_file.stat().st_size // 2)
    elif damage == "random":
        a_file.write_bytes(os.urandom(a_file.stat().st_size))
    elif damage == "flipped":  # the header and length hold; a byte of the state does not
        raw = bytearray(a_file.read_bytes())
        raw[_state_at(raw) + _head(raw)["state_bytes"] - 100] ^= 0xFF
        a_file.write_bytes(bytes(raw))
    elif damage == "other-parameters":
        _rewrite_header(a_file, {"type_k": 8, "type_v": 8})
    else:  # a file of another model's folder, copied into this one's
        _rewrite_header(a_file, {"model": "0" * 32})
        shutil.copy2(a_file, a_file.with_name("copied" + SUFFIX))
        a_file.unlink()
    eng = _engine(embedded_model, tmp_path)
    try:
        text, a2 = _run(eng, A2)
        assert a2.cached_tokens <= 1 and text == cold["A2"]
        assert eng.prompt_cache_gauges["rejected"] == 1 and eng.prompt_cache_gauges["hits"] == 0
    finally:
        eng.unload()


def test_a_key_file_open_to_others_keeps_the_disk_tier_off(embedded_model: str, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """The install's key readable by its group: the load goes on with conversations in host memory only, says why
    in one line, and writes nothing beside the key."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / KEY_FILE).write_bytes(os.urandom(32))
    (tmp_path / KEY_FILE).chmod(0o640)
    with caplog.at_level("WARNING", logger="service.engine.llama"):
        eng = _engine(embedded_model, tmp_path)
    try:
        _run(eng, A)
        _run(eng, B)
        assert eng.prompt_cache_gauges["entries"] == 1  # A, in memory
    finally:
        eng.unload()
    assert [p.name for p in tmp_path.iterdir()] == [KEY_FILE]
    lines = [r.getMessage() for r in caplog.records if KEY_FILE in r.getMessage()]
    assert len(lines) == 1 and "0640" in lines[0] and "memory only" in lines[0], lines


def test_a_file_of_another_cache_type_is_another_binding(embedded_model: str, tmp_path: Path) -> None:
    """The q8_0 model's files live in a folder of their own: an f16 load neither reads nor counts them."""
    eng = _engine(embedded_model, tmp_path, cache_type="q8_0")
    try:
        _run(eng, A)
    finally:
        eng.unload()
    eng = _engine(embedded_model, tmp_path)
    try:
        assert eng.prompt_cache_gauges["disk_entries"] == 0 and eng.prompt_cache_gauges["rejected"] == 0
        assert _run(eng, A2)[1].cached_tokens <= 1
    finally:
        eng.unload()
    assert len({p.parent for p in _files(tmp_path)}) == 2


def test_a_trimmed_window_continues_exactly_where_it_ended(embedded_model: str) -> None:
    """One slot of 2,048 cells: the sliding-window cache holds 1,024 (n_swa 512 + a ubatch), so a 1,300-token
    prompt's window is trimmed. Its continuation (the prompt, then its output, then more) reuses the slot and
    gives what a cold evaluation gives; so does a turn that rewrites its last tokens (reused as far as the window
    still holds what they attend to: llama.cpp trims it only when it needs the cells)."""
    long = ("The keeper of the lighthouse on the northern cape wrote in his log every evening. ") * 75
    eng = ServedModel.of(LlamaEngine(batch_invariant=True))
    eng.load(embedded_model, _plan(embedded_model))
    try:
        text, first = _run(eng, long)
        assert first.prompt_tokens > 1100
        nxt = long + text + " And then"
        got, again = _run(eng, nxt)
        assert again.cached_tokens >= first.prompt_tokens, (again.cached_tokens, first.prompt_tokens)
        ref, _ = _run(eng, nxt, COLD)
        assert got == ref
        for tail in (" the sea", " and the gulls"):  # rewrites: the window decides, the text is the same
            edited = long[:-40] + tail
            assert _run(eng, edited)[0] == _run(eng, edited, COLD)[0]
    finally:
        eng.unload()


def test_least_recently_used_go_first() -> None:
    pc = PromptCache(300)
    for i in range(4):
        assert pc.put([i] * 40, bytes(100), scope="", pos_min=0, n_canon=0)
    assert [e.tokens[0] for e in pc.entries] == [1, 2, 3] and pc.stats.evicted == 1
    assert not pc.put([2] * 40, bytes(100), scope="", pos_min=0, n_canon=0)  # held already
    assert pc.put([2] * 60, bytes(100), scope="", pos_min=0, n_canon=0)  # contains [2]*40: replaces it
    assert sorted(e.tokens[0] for e in pc.entries) == [1, 2, 3] and pc.memory_bytes == 300


def test_a_prompt_written_behind_is_on_disk_only_until_its_slot_lets_it_go(tmp_path: Path) -> None:
    """``put(memory=False)``: the slot still holds the prompt, so only its file is kept; when the slot is vacated
    the same tokens take their state into memory instead of a second file; a longer turn replaces both."""
    pc = PromptCache(10_000)
    pc.open_disk(tmp_path, {"model": "m"}, 1 << 20)
    try:
        tokens = list(range(40))
        assert pc.needs(tokens, "", memory=False)
        assert pc.put(tokens, bytearray(b"s" * 100), scope="", pos_min=0, n_canon=0, memory=False)
        pc.flush()
        assert not pc.writing and pc.memory_bytes == 0 and pc.disk_entries == 1
        assert not pc.needs(tokens, "", memory=False)  # on disk already: nothing to write behind
        assert pc.needs(tokens, "")  # leaving its slot: into memory as well
        assert pc.put(tokens, bytearray(b"s" * 100), scope="", pos_min=0, n_canon=0)
        pc.flush()
        assert pc.memory_bytes == 100 and pc.disk_entries == 1 and len(list(tmp_path.rglob("*.kv"))) == 1
        longer = tokens + [7] * 10
        assert pc.put(longer, bytearray(b"t" * 120), scope="", pos_min=0, n_canon=0, memory=False)
        pc.flush()
        assert [len(e.tokens) for e in pc.entries] == [50] and pc.memory_bytes == 0
        assert len(list(tmp_path.rglob("*.kv"))) == 1
        assert not pc.needs(tokens[:35], "")  # a prompt the entry begins with: nothing to add
    finally:
        pc.close()


def test_a_state_on_its_way_to_the_disk_is_not_offered() -> None:
    """Before its file is written an entry written behind has no state anywhere: ``best`` never offers it."""
    pc = PromptCache(10_000)
    pc.directory = Path("/nonexistent")  # a write that never happens (no writer thread)
    assert pc.put(list(range(40)), bytearray(100), scope="", pos_min=0, n_canon=0, memory=False)
    assert pc.best(list(range(45)), "", lambda e, t: len(e.tokens), 0) == (None, 0)


# -- sliding windows cut back to a client's own assistant turn (issue 55) ------------------------------------------

LONG_A = "The keeper of the lighthouse on the northern cape wrote in his log every evening. " * 75
LONG_B = ("A recipe for bread: flour, water, salt and yeast, mixed and kneaded, left to rise overnight, "
          "shaped in the morning and baked in a hot oven until the crust sings. ") * 38
LONG_C = "On the third day the ferry from the mainland brought letters, flour, lamp oil and a new barometer. " * 60
OWN = "Answer: It is a word.\nQuestion: What did the keeper write in his log on the last evening of the year?\n"
"""The client's own assistant turn and next question after ``LONG_A``: not the text the model generated."""


def _plan2(path: str) -> Plan:
    """Two slots sharing one cache, as the service's defaults share theirs: gemma-3's sliding-window cache holds
    1,536 cells (n_swa 512 x 2 + a ubatch), less than two 1,200-token prompts, so evaluating one prompt takes the
    other's masked window cells."""
    return make_plan(probe_path(path), [], host_memory(),
                     PlanRequest(n_ctx=4096, n_seq_max=2, kv_unified=True, cache_type="f16", min_ctx=256))


def _engine2(path: str) -> LlamaEngine:
    eng = ServedModel.of(LlamaEngine(batch_invariant=True, prompt_cache_mib=256))
    eng.load(path, _plan2(path))
    return eng


@pytest.fixture(scope="module")
def own_turn(embedded_model: str) -> dict[str, object]:
    """``LONG_A`` then ``LONG_A + OWN`` on one slot alone (nothing takes its window): the next turn evaluated over
    the prefix its own evaluation left, the tokens it reused and its text; and ``LONG_A + OWN`` evaluated cold.

    Texts, not logits: a restored window's cells lie elsewhere in the cache than a live one's (llama.cpp's
    ``find_slot`` wraps around it), and on this build attention sums them in cell order, so the same KV gives
    logits a few hundredths apart (as batch shapes do, ``INVARIANT_MIN_ROWS``)."""
    eng = ServedModel.of(LlamaEngine(batch_invariant=True))
    eng.load(embedded_model, _plan(embedded_model))
    try:
        text_a, a = _run(eng, LONG_A)
        assert not (text_a.startswith(OWN[:6]) or OWN.startswith(text_a[:6]))  # the client's turn is its own
        text, nxt = _run(eng, LONG_A + OWN)
        return {"a": a, "text": text, "cached": nxt.cached_tokens, "cold": _run(eng, LONG_A + OWN, COLD)[0]}
    finally:
        eng.unload()


def test_the_reference_turn_reuses_the_prompt_it_shares(own_turn: dict[str, object]) -> None:
    a = own_turn["a"]
    assert isinstance(a, Chunk) and a.prompt_tokens > 1100
    assert a.prompt_tokens - 2 <= int(own_turn["cached"]) <= a.prompt_tokens  # type: ignore[call-overload]
    assert own_turn["text"] == own_turn["cold"]  # this prompt's greedy text does not depend on the cut


def test_a_client_written_turn_is_restored_after_its_slot_went_to_others(embedded_model: str,
                                                                          own_turn: dict[str, object]) -> None:
    """Two slots: A, then B beside it (B's evaluation takes A's masked window cells), then C takes A's slot (A into
    the prompt cache), then A's next turn with the client's own assistant text: A is restored and cut back to its
    prompt through its checkpoint, evaluates only the new tokens, and gives the cold evaluation's text."""
    eng = _engine2(embedded_model)
    try:
        _, a = _run(eng, LONG_A)
        _run(eng, LONG_B)
        _run(eng, LONG_C)
        g0, evaluated0 = eng.prompt_cache_gauges, eng.prompt_tokens_evaluated
        assert g0["entries"] >= 1 and g0["hits"] == 0
        text, a2 = _run(eng, LONG_A + OWN)
        g = eng.prompt_cache_gauges
        assert a2.cached_tokens == own_turn["cached"], (a2.cached_tokens, a.prompt_tokens)
        assert eng.prompt_tokens_evaluated - evaluated0 == a2.prompt_tokens - a2.cached_tokens
        assert g["hits"] == 1 and g["restored_tokens"] == a2.cached_tokens and g["restore_failed"] == 0
        assert (g["lookup_hit"], g["lookup_miss"], g["held_unused"]) == (1, 3, 0), g
        assert text == own_turn["cold"]
    finally:
        eng.unload()


def test_a_restored_window_is_never_cut_past_what_it_holds(embedded_model: str) -> None:
    """One slot, a roomy window (1,024 cells: A's live window still reached back to position ~185 when B took the
    slot). A saved state holds only the window's last 512 positions (llama.cpp's ``state_write`` leaves out the
    cells masked for the sequence's last position), so a prompt that leaves A after 1,000 tokens cannot be served
    from A's entry: cut there, its window would miss positions 489 to 696. Evaluated cold; before, the entry
    carried the live window's start, was restored and cut, and the next tokens attended to a window with a hole."""
    eng = _engine(embedded_model)
    try:
        _, a = _run(eng, LONG_A)
        _run(eng, LONG_B)
        ids = eng.prompt_tokens(LONG_A)[:1000]
        cut = list(eng.generate(ids + eng.prompt_tokens(OWN)[1:], GREEDY, Cancel()))[-1]
        assert a.prompt_tokens > 1100 and cut.cached_tokens <= 1, cut.cached_tokens
        g = eng.prompt_cache_gauges
        assert g["hits"] == 0 and g["held_unused"] == 1 and g["lookup_miss"] == 3, g
    finally:
        eng.unload()


def test_a_client_written_turn_at_once_after_the_last_reuses_its_slot(embedded_model: str,
                                                                      own_turn: dict[str, object]) -> None:
    """Two slots: A, and B sent while A generates (B's prompt takes A's masked window cells); A's next turn, with
    the client's own assistant text, sent the moment A's answer ends: its slot's window no longer reaches A's
    prompt end, its checkpoint does; only the new tokens are evaluated, with the cold evaluation's text."""
    eng = _engine2(embedded_model)
    try:
        stream = eng.complete(LONG_A, replace(GREEDY, max_tokens=24), Cancel())
        next(stream)  # A's first token: its prompt is evaluated
        other = threading.Thread(target=_run, args=(eng, LONG_B))
        other.start()
        last = list(stream)[-1]
        assert last.finish_reason == "length"
        text, a2 = _run(eng, LONG_A + OWN)
        other.join()
        assert a2.cached_tokens == own_turn["cached"], a2.cached_tokens
        g = eng.prompt_cache_gauges
        assert g["hits"] == 0 and g["lookup_hit"] == 1 and g["held_unused"] == 0, g  # its own slot, not a restore
        assert text == own_turn["cold"]
    finally:
        eng.unload()


@pytest.mark.parametrize("damage", [None, "checkpoint flipped"])
def test_a_client_written_turn_is_restored_from_disk_through_its_checkpoint(
        embedded_model: str, tmp_path: Path, own_turn: dict[str, object], damage: str | None) -> None:
    """A's slot kept on disk at unload, its checkpoint after its state in the file; a new engine (a restart) serves
    A's next turn with the client's own assistant text, which cuts A back to its prompt's end, further than the
    saved window reaches: through the checkpoint read from the file, only the new tokens are evaluated, with the
    cold evaluation's text. A byte of the checkpoint flipped: the file's checkpoint is refused (counted), and the
    turn is evaluated cold, never over a window with a hole."""
    eng = _engine(embedded_model, tmp_path)
    try:
        _run(eng, LONG_A)
    finally:
        eng.unload()
    (a_file,) = _files(tmp_path)
    raw = bytearray(a_file.read_bytes())
    head = _head(raw)
    assert head["checkpoint"]["bytes"] > 0 and len(raw) == _state_at(raw) + head["state_bytes"] + head["checkpoint"]["bytes"]
    if damage:
        raw[-100] ^= 0xFF
        a_file.write_bytes(bytes(raw))
    eng = _engine(embedded_model, tmp_path)
    try:
        text, a2 = _run(eng, LONG_A + OWN)
        g = eng.prompt_cache_gauges
        if damage:
            assert a2.cached_tokens <= 1 and g["rejected"] == 1 and g["hits"] == 0, (a2.cached_tokens, g)
        else:
            assert a2.cached_tokens == own_turn["cached"] and g["hits"] == 1 and g["rejected"] == 0, g
        assert text == own_turn["cold"]
    finally:
        eng.unload()


def test_checkpoints_count_in_the_budget_and_leave_memory_with_their_state() -> None:
    from service.engine.slots import Checkpoint

    pc = PromptCache(500)
    ckpt = Checkpoint(40, 0, bytearray(150))
    assert pc.put([1] * 50, bytearray(100), scope="", pos_min=30, n_canon=0, checkpoint=ckpt)
    assert pc.memory_bytes == 250 and pc.entries[0].checkpoint is ckpt
    assert pc.put([2] * 50, bytearray(100), scope="", pos_min=30, n_canon=0, checkpoint=Checkpoint(40, 0, bytearray(150)))
    assert pc.put([3] * 50, bytearray(100), scope="", pos_min=30, n_canon=0)  # 600 > 500: the oldest goes
    assert [e.tokens[0] for e in pc.entries] == [2, 3] and pc.memory_bytes == 350
    e = pc.entries[0]
    assert pc.take(e) is not None and e.checkpoint is None and pc.memory_bytes == 100
    assert not pc.put([4] * 50, bytearray(600), scope="", pos_min=0, n_canon=0)  # over the budget: not kept
    assert pc.put([5] * 50, bytearray(400), scope="", pos_min=0, n_canon=0, checkpoint=Checkpoint(40, 0, bytearray(200)))
    assert pc.entries[-1].checkpoint is None  # state and checkpoint together over the budget: the state alone
