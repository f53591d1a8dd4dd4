"""Fuzz the GGUF probe for longer than the test suite does: no crash, no hang, no allocation beyond the input.

    .venv/bin/python bench/fuzz_probe.py --seconds 120     # `make soak` runs this

Mutates a valid minimal header (byte edits, truncation, splices of random bytes) and feeds
random bytes; every input must give a ``ModelSpec`` or a ``SizingError`` within ``--hang-s``,
and the peak Python allocation while probing (tracemalloc) must stay below a bound proportional
to the input (``ALLOC_FACTOR`` x its size + ``ALLOC_SLACK_BYTES``): a length field of 2**60 must
not turn into a 2**60-byte read. Prints the figures; exits 1 on the first failure, with the input
saved to ``fuzz-failure.bin``.
"""

from __future__ import annotations

import argparse
import random
import signal
import struct
import sys
import time
import tracemalloc
from pathlib import Path

from sizing.errors import SizingError
from sizing.probe import probe_bytes
from sizing.testing.raw_gguf import minimal_llama

ALLOC_FACTOR = 64
ALLOC_SLACK_BYTES = 4 * 1024 * 1024


class Hang(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise Hang()


def mutate(rng: random.Random, valid: bytes) -> bytes:
    kind = rng.randrange(5)
    data = bytearray(valid)
    if kind == 0:  # byte edits in the header
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 1:  # a length or count field set to a huge value
        pos = rng.randrange(8, max(9, len(data) - 8))
        data[pos:pos + 8] = struct.pack("<Q", rng.choice([2**31, 2**32 - 1, 2**48, 2**60, 2**64 - 1]))
    elif kind == 2:  # truncation
        data = data[: rng.randrange(len(data))]
    elif kind == 3:  # splice random bytes
        pos = rng.randrange(len(data))
        data[pos:pos + rng.randint(1, 64)] = rng.randbytes(rng.randint(1, 64))
    else:  # random bytes behind the magic
        data = bytearray(b"GGUF" + struct.pack("<I", rng.choice([1, 2, 3])) + rng.randbytes(rng.randint(0, 2048)))
    return bytes(data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hang-s", type=float, default=2.0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    valid = bytes(minimal_llama(4, n_vocab=300))
    signal.signal(signal.SIGALRM, _alarm)
    tracemalloc.start()
    n = specs = errors = 0
    worst_ratio = 0.0
    slowest_s = 0.0
    t_end = time.monotonic() + args.seconds
    while time.monotonic() < t_end:
        data = mutate(rng, valid)
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, args.hang_s)
        try:
            probe_bytes(data)
            specs += 1
        except SizingError:
            errors += 1
        except Hang:
            Path("fuzz-failure.bin").write_bytes(data)
            print(f"HANG: input of {len(data)} bytes took over {args.hang_s} s (saved to fuzz-failure.bin)")
            return 1
        except Exception as exc:
            Path("fuzz-failure.bin").write_bytes(data)
            print(f"CRASH: {type(exc).__name__}: {exc} (input saved to fuzz-failure.bin)")
            return 1
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        slowest_s = max(slowest_s, time.perf_counter() - t0)
        peak = tracemalloc.get_traced_memory()[1] - base
        worst_ratio = max(worst_ratio, peak / max(len(data), 1))
        if peak > ALLOC_FACTOR * len(data) + ALLOC_SLACK_BYTES:
            Path("fuzz-failure.bin").write_bytes(data)
            print(f"ALLOCATION: {peak} bytes for an input of {len(data)} bytes (saved to fuzz-failure.bin)")
            return 1
        n += 1
    print(f"fuzz_probe: {n} inputs in {args.seconds:.0f} s (seed {args.seed}): {specs} specs, {errors} typed errors, "
          f"0 crashes, 0 hangs; slowest {slowest_s * 1000:.1f} ms; peak allocation at most {worst_ratio:.1f} x the input")
    return 0


if __name__ == "__main__":
    sys.exit(main())
