"""The llama.cpp engine: the only package that imports ``llama_cpp`` for serving, one part a module.

One engine, built as llama-server serves (tools/server/server-context.cpp of the llama.cpp that llama-cpp-python
0.3.36 vendors), through llama-cpp-python's low-level API:

- ``loading``: the plan into llama.cpp objects (the model, its context, the embedding context, a draft model or the
  MTP head, the vision projector) and the load's report.
- ``scheduler``: the one thread that calls llama.cpp (continuous batching: each step puts one token for every
  generating sequence into the batch, then fills the rest of ``n_batch`` with prompt tokens, oldest request
  first), embeddings yielding to generations, idle write-behind.
- ``step``: one batch built, decoded, its rows handed out; a failed decode's outcome (``llama_decode`` 1 or -2 fails
  one request with ``InsufficientMemory`` while the others go on; a full unified cache first clears an idle slot;
  a long prompt's evaluation stops when its client leaves: the abort callback).
- ``slotting``: slots that keep their tokens' KV after a request (slot *i* is sequence *i*), prefix reuse
  (``service.engine.slots``: llama-server's ``get_available_slot``, ``update_slots``; with a unified cache a longer
  prefix another slot holds is shared, ``llama_memory_seq_cp``; a sliding-window cache's trimmed cells checked),
  and the prompts beyond the slots (``service.engine.prompt_cache``: host memory, disk, written behind).
- ``sequences``: sampling, text (UTF-8, stop strings, log probabilities, EOG), drafts verified, ``n`` choices
  forked from one prompt evaluation, the final chunk with usage and timings; chunks delivered together.
- ``drafting``: n-gram drafts and the pool of earlier answers, the plan's draft model, the MTP head.
- ``pooling``: embeddings and rerank scores from the embedding context.
- ``engine``: ``LlamaEngine``, the ``Engine`` protocol over those parts.

``generate`` may be called, and iterated, from many threads at once: each call has its own queue of ``Chunk``
values. In the service this engine runs in a runner process of its own (``service.runner.process``).
"""

from .engine import LlamaEngine

__all__ = ["LlamaEngine"]
