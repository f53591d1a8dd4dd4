"""Test data: header-only (sparse) GGUF files of real models' shapes, written with ``gguf.GGUFWriter``, for the tests
and the benchmarks. Nothing in the product imports it (the layout test checks)."""
