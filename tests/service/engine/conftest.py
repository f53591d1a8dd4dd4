"""Fixtures of the engine tests."""

from __future__ import annotations

from typing import Any, Iterator

import pytest


@pytest.fixture(scope="module")
def vocab(embedded_model: str) -> Iterator[Any]:
    """The embedded model's vocabulary alone (``LlamaModel`` with ``vocab_only``): tokenizing and llguidance's
    matcher over the real 262,144 tokens, without weights."""
    import llama_cpp
    from llama_cpp import _internals

    mp = llama_cpp.llama_model_default_params()
    mp.vocab_only = True
    model = _internals.LlamaModel(path_model=embedded_model, params=mp, verbose=False)
    yield model
    model.close()
