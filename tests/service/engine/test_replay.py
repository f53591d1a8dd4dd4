"""A greedy request asked again answers what it answered before (issue 55, ``service.engine.replay``): the earlier
answer is kept per cache scope and prompt, taken where it is within the rounding of the argmax and not further,
and kept on disk beside the prompt cache's files, sealed, so that a restart answers the same."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from service.engine.prompt_cache import REPLAYS_FILE, REPLAYS_MAGIC, SEAL_BYTES, PromptCache, scope_of
from service.engine.replay import Replays, prefer

A, B = scope_of("tenant-one", None), scope_of("tenant-two", None)
FIELDS = {"model": "m" * 32, "type_k": 1, "type_v": 1}


def test_the_earlier_token_is_taken_within_the_tolerance_and_not_beyond() -> None:
    row = np.array([0.0, 5.0, 4.2, 3.9, 5.0], dtype=np.float32)
    assert prefer(row, 1, 2, tolerance=1.0) == 2  # trails by 0.8
    assert prefer(row, 1, 3, tolerance=1.0) == 1  # trails by 1.1: the model's other choice
    assert prefer(row, 1, 4, tolerance=0.0) == 4  # a tie is the earlier answer's
    assert prefer(row, 1, 2, tolerance=0.5) == 1
    assert prefer(row, 1, 99, tolerance=1.0) == 1  # not a token of this row


def test_answers_are_kept_per_scope_and_prompt() -> None:
    r = Replays(answers=2)
    r.add(A, [1, 2, 3], [7, 8, 9])
    assert r.find(A, [1, 2, 3]) == [7, 8, 9]
    assert r.find(B, [1, 2, 3]) is None  # another tenant's answer never steers this one
    assert r.find(A, [1, 2]) is None and r.find(A, [1, 2, 3, 4]) is None  # the same prompt only
    r.add(A, [1, 2, 3], [7, 8])  # cut shorter (a smaller max_tokens), agreeing: the longer stays
    assert r.find(A, [1, 2, 3]) == [7, 8, 9]
    r.add(A, [1, 2, 3], [7, 5])  # another answer: the latest
    assert r.find(A, [1, 2, 3]) == [7, 5]
    r.add(A, [4], [1])
    r.find(A, [1, 2, 3])  # asked again: the most recently used
    r.add(A, [5], [1])  # beyond 2 prompts: the least recently asked goes
    assert r.find(A, [4]) is None and r.find(A, [1, 2, 3]) == [7, 5] and r.find(A, [5]) == [1]
    off = Replays(tolerance=0.0)
    off.add(A, [1, 2, 3], [7, 8, 9])
    assert off.find(A, [1, 2, 3]) is None  # GGUF_REPLAY_TOLERANCE=0: every token the argmax


def _cache(root: Path, fields: dict[str, object] = FIELDS) -> PromptCache:
    pc = PromptCache(1 << 20)
    pc.open_disk(root, fields, 1 << 30)
    return pc


def _written(root: Path) -> Replays:
    pc = _cache(root)
    r = Replays(persist=pc.put_replays)
    r.add(A, [1, 2, 3], [7, 8, 9])
    r.add(B, [1, 2, 3], [6])
    pc.flush()
    pc.close()
    return r


def test_answers_outlive_a_restart_sealed_to_the_install_and_the_model(tmp_path: Path) -> None:
    _written(tmp_path)
    pc = _cache(tmp_path)
    back = Replays()
    back.load(pc.replays())
    assert back.find(A, [1, 2, 3]) == [7, 8, 9] and back.find(B, [1, 2, 3]) == [6]
    pc.close()
    # Another model (another binding) never reads them: its folder holds none.
    other = _cache(tmp_path, {**FIELDS, "model": "n" * 32})
    assert other.replays() is None
    other.close()


@pytest.mark.parametrize("tamper", ["answer edited", "moved to another model's folder", "truncated"])
def test_a_replays_file_not_as_the_install_wrote_it_is_ignored(tmp_path: Path, tamper: str) -> None:
    _written(tmp_path)
    pc = _cache(tmp_path)
    path = pc.directory / REPLAYS_FILE  # type: ignore[operator]
    raw = path.read_bytes()
    head, payload = raw[:len(REPLAYS_MAGIC) + SEAL_BYTES], raw[len(REPLAYS_MAGIC) + SEAL_BYTES:]
    pc.close()
    target = _cache(tmp_path, {**FIELDS, "model": "n" * 32}) if tamper.startswith("moved") else _cache(tmp_path)
    data = json.loads(payload)
    data[A][0][1] = [6, 6, 6]
    forged = {"answer edited": head + json.dumps(data).encode(), "truncated": raw[:len(REPLAYS_MAGIC) + 4],
              "moved to another model's folder": raw}[tamper]
    (target.directory / REPLAYS_FILE).write_bytes(forged)  # type: ignore[operator]
    assert target.replays() is None and target.stats.rejected == 1
    target.close()


def test_forgetting_the_answers_forgets_them_on_disk(tmp_path: Path) -> None:
    pc = _cache(tmp_path)
    r = Replays(persist=pc.put_replays)
    r.add(A, [1, 2, 3], [7, 8, 9])
    r.clear()
    pc.flush()
    back = Replays()
    back.load(pc.replays())
    pc.close()
    assert back.find(A, [1, 2, 3]) is None
