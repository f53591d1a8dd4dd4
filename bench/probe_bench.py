"""Time the GGUF probe on the embedded model's file, against gguf-py and ggml's C parser.

    .venv/bin/python bench/probe_bench.py [--repeat 21] [--no-gguf-py] [PATH]

Prints, in one run: the probe's median (``sizing.probe.probe_path``: header
walk plus spec), ggml's ``gguf_init_from_file`` (no_alloc) called through
ctypes from llama-cpp-python's libggml-base, median of the same number of
runs, and one run of ``gguf.GGUFReader`` (about 14 s: it builds numpy views
of every array element), with the ratios. Targets: probe median at most
40 ms, and no slower than ggml's C parser. Exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import time
from pathlib import Path

from sizing.probe import probe_path

TARGET_MS = 40.0


class _GgufInitParams(ctypes.Structure):
    # struct gguf_init_params { bool no_alloc; struct ggml_context ** ctx; }  (ggml/include/gguf.h)
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]


def _libggml() -> ctypes.CDLL:
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml.so"):
        candidate = lib_dir / name
        if candidate.exists():
            lib = ctypes.CDLL(str(candidate))
            if hasattr(lib, "gguf_init_from_file"):
                break
    else:  # pragma: no cover - depends on the build
        raise SystemExit(f"no libggml with gguf_init_from_file under {lib_dir}")
    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, _GgufInitParams]
    lib.gguf_free.argtypes = [ctypes.c_void_p]
    lib.gguf_get_n_tensors.restype = ctypes.c_int64
    lib.gguf_get_n_tensors.argtypes = [ctypes.c_void_p]
    return lib


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", nargs="?", help="GGUF file (default: the embedded model)")
    p.add_argument("--repeat", type=int, default=21)
    p.add_argument("--no-gguf-py", action="store_true", help="skip the ~14 s gguf.GGUFReader run")
    p.add_argument("--no-fixtures", action="store_true", help="skip timing the real-shape fixtures")
    args = p.parse_args(argv)
    if args.path is None:
        from service.catalog.embedded import embedded_model_path

        args.path = embedded_model_path()
    path = str(args.path)
    spec = probe_path(path)
    print(f"file        {path}")
    print(f"            {os.path.getsize(path):,} bytes, header {spec.data_offset:,} bytes, "
          f"{spec.n_vocab:,} tokens, {len(spec.tensors)} tensors")

    lib = _libggml()
    bpath = os.fsencode(path)

    def ggml_c() -> None:
        ctx = lib.gguf_init_from_file(bpath, _GgufInitParams(True, None))
        if not ctx:
            raise SystemExit("gguf_init_from_file failed")
        lib.gguf_free(ctx)

    # Interleave the two so that a busy machine slows both alike.
    probe_ts: list[float] = []
    c_ts: list[float] = []
    probe_path(path)
    ggml_c()
    for _ in range(args.repeat):
        gc.collect()
        t = time.perf_counter()
        probe_path(path)
        probe_ts.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        ggml_c()
        c_ts.append((time.perf_counter() - t) * 1000)
    probe_ms = statistics.median(probe_ts)
    c_ms = statistics.median(c_ts)
    print(f"probe       median {probe_ms:7.1f} ms  (min {min(probe_ts):.1f}, max {max(probe_ts):.1f}, n={args.repeat})")
    print(f"ggml C      median {c_ms:7.1f} ms  (gguf_init_from_file no_alloc via ctypes; "
          f"min {min(c_ts):.1f}, max {max(c_ts):.1f})")
    print(f"ratio       ggml C / probe = {c_ms / probe_ms:.2f}x")

    if not args.no_gguf_py:
        import gguf

        t = time.perf_counter()
        reader = gguf.GGUFReader(path)
        py_ms = (time.perf_counter() - t) * 1000
        assert len(reader.tensors) == len(spec.tensors)
        from importlib.metadata import version

        print(f"gguf-py     once   {py_ms:7.1f} ms  (gguf.GGUFReader, gguf {version('gguf')})")
        print(f"ratio       gguf.GGUFReader / probe = {py_ms / probe_ms:.0f}x")

    if not args.no_fixtures:
        _fixtures(lib, args.repeat)

    ok = probe_ms <= TARGET_MS and probe_ms <= c_ms
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    print(f"target      median <= {TARGET_MS:.0f} ms and <= ggml C: {'met' if ok else 'MISSED'}"
          f"  (load {load:.1f} per core; the absolute target assumes an idle machine)")
    return 0 if ok else 1


def _fixtures(lib: ctypes.CDLL, repeat: int) -> None:
    """The probe and ggml's C parser on each sparse real-shape fixture (header-only, full vocabularies)."""
    import tempfile

    from sizing.testing.fixtures import FIXTURES, write_fixture

    print()
    print(f"{'fixture':<20} {'header':>12} {'tokens':>8} {'probe ms':>9} {'ggml C ms':>10} {'ratio':>6}")
    with tempfile.TemporaryDirectory(prefix="probe-bench-") as d:
        for name in FIXTURES:
            path = write_fixture(name, d, "q4_k_m")
            spec = probe_path(path)
            bpath = os.fsencode(path)
            pt: list[float] = []
            ct: list[float] = []
            for _ in range(repeat):
                t = time.perf_counter()
                probe_path(path)
                pt.append((time.perf_counter() - t) * 1000)
                t = time.perf_counter()
                ctx = lib.gguf_init_from_file(bpath, _GgufInitParams(True, None))
                ct.append((time.perf_counter() - t) * 1000)
                lib.gguf_free(ctx)
            pm, cm = statistics.median(pt), statistics.median(ct)
            print(f"{name:<20} {spec.data_offset:>12,} {spec.n_vocab:>8,} {pm:9.1f} {cm:10.1f} {cm / pm:5.2f}x")


if __name__ == "__main__":
    sys.exit(main())
