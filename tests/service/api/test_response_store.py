"""The stored responses of /v1/responses: one LRU store per API key within its budget (service.api.response_store)."""

from __future__ import annotations

from service.api.response_store import ResponseStore, StoredResponse, owner_of, size_of


def _entry(text: str) -> StoredResponse:
    response = {"id": "r", "output_text": text}
    messages = [{"role": "user", "content": text}]
    return StoredResponse(response=response, input_items=[], messages=messages, nbytes=size_of(response, [], messages))


def test_each_owner_keeps_its_own_within_the_budget() -> None:
    one = _entry("x" * 100)
    store = ResponseStore(budget_bytes=3 * one.nbytes)
    a, b = owner_of(b"key-a"), owner_of(b"key-b")
    assert a != b and owner_of(None) == "" and b"key-a".hex() not in a
    for i in range(3):
        assert store.put(a, f"r{i}", one)
    assert store.put(b, "r0", one)
    assert store.get(b, "r1") is None and store.get(a, "r1") is one  # ids are per owner
    assert store.usage(a) == (3, 3 * one.nbytes)
    store.get(a, "r0")  # read r1 then r0: r2 is now the least recently used
    assert store.put(a, "r3", one)
    assert store.get(a, "r2") is None and store.get(a, "r0") is one and store.get(a, "r3") is one
    assert store.usage(b) == (1, one.nbytes)  # another key's traffic evicts nothing of b's


def test_an_entry_beyond_the_budget_is_not_kept_and_delete_frees() -> None:
    store = ResponseStore(budget_bytes=200)
    assert not store.put("", "big", _entry("x" * 500))
    assert store.usage("") == (0, 0)
    small = _entry("hi")
    assert store.put("", "s", small) and store.put("", "s", small)  # the same id again replaces it
    assert store.usage("") == (1, small.nbytes)
    assert store.delete("", "s") and not store.delete("", "s")
    assert store.usage("") == (0, 0)
    assert not ResponseStore(0).put("", "s", small)  # GGUF_RESPONSES_STORE_MIB=0: nothing is stored
