"""Write a draft model for speculative decoding: the embedded model with fewer transformer blocks.

    python bench/make_draft.py OUT.gguf [--first K] [--last L] [--blocks I,J,...] [--model PATH]

A draft model must share the main model's vocabulary token by token (the service refuses any other), and no
smaller model with gemma-3's 262144-token vocabulary is at hand, so this builds one from the embedded model's
own tensors (gemma-3-270m Q4_K_M, ``service.catalog.embedded.embedded_model_path()``): it keeps the first K and the last L
of its 18 blocks, renumbered blk.0..blk.M-1 (M = K + L), plus ``token_embd`` and ``output_norm`` (and
``output`` where a model has one; gemma-3 ties it to ``token_embd``). Every tensor keeps its quantized type and
its bytes. All metadata is copied unchanged (the tokenizer arrays exactly, checked after writing) except
``<arch>.block_count`` = M and per-layer arrays, cut to the kept blocks. gemma-3 alternates 5 sliding-window
blocks (RoPE base 10000) with one global block (RoPE base 1e6) by position (llama.cpp ``set_swa_pattern(6)``),
so renumbered blocks would change role; the draft therefore carries ``<arch>.attention.sliding_window_pattern``
as a per-block array (read by llama.cpp's ``load_swa_pattern``), each kept block keeping its original role.

Measured (2 shared cores, llama-cpp-python 0.3.36 CPU, greedy, 96 tokens, draft_rows=32, q8_0 cache, n_ctx 2048;
``LlamaEngine.complete`` with the draft: drafted/accepted tokens and wall seconds, without drafting
(``speculative=False``, same engine) in brackets; "free" = "The history of the printing press begins", "copy" = an
81-word paragraph, "\n\nThe same text, copied exactly:\n" and its first 40 characters. "top-1" = teacher-forced
agreement: the draft's argmax at each of the main model's 96 greedy tokens, free / copy):

    blocks kept        M  MB    | free: drafted/acc  s (plain) | copy: drafted/acc  s (plain) | top-1 free/copy
    --first 2 --last 1  3  197  |       12/0   2.63 (2.17)     |        9/0   2.78 (2.38)     |  0/96   0/96
    --first 3 --last 1  4  200  |        9/0   2.67 (2.13)     |        9/0   2.69 (2.35)     |  0/96   0/96
    --first 5 --last 1  6  208  |       11/0   2.75 (2.14)     |        7/0   3.31 (2.37)     |  0/96   0/96
    --first 8 --last 1  9  219  |        6/0   3.21 (2.13)     |        4/0   4.21 (2.34)     |  0/96   2/96
    --first 6 --last 3  9  220  |        6/0   3.29 (2.14)     |        8/0   3.44 (2.39)     |  0/96   1/96
    --first 4 --last 5  9  220  |        7/0   3.38 (2.10)     |        6/0   3.56 (2.28)     |  0/96   0/96
    --first 9 --last 0  9  219  |                              |                              |  1/96   2/96
    --blocks 0,2,..,14,17 9 219 |                              |                              |  0/96   0/96
    --first 12 --last 3 15 242  |       42/41  3.35 (2.08)     |       59/54  3.37 (2.26)     | 65/96  53/96
    --first 16 --last 1 17 249  |                              |                              | 75/96  66/96
    --first 18 (a copy) 18 253  |       59/59  3.17 (2.08)     |       69/69  3.31 (2.30)     | 96/96  94/96

With 9 or fewer of the 18 blocks the draft's text is gibberish (no drafted token accepted; the engine's policy
stops drafting after misses, hence the few drafted), and no draft speeds decoding: 96 tokens alone take 1.48 s
(3+1 blocks), 1.79 s (8+1), 2.04 s (12+3) against the model's 2.15 s, because the draft keeps the whole
262144 x 640 Q8_0 token embedding / output head (178 of the model's 253 MB), so even 4 blocks cost 70% of the
model per token, and only drafts with about 15 blocks or more agree with it (at 95% of its cost). The default,
``--first 12 --last 3``, is the smallest measured choice whose drafts are accepted (useful to exercise
draft-model speculation on the embedded model, not to speed it up).
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np

DEFAULT_FIRST = 12
DEFAULT_LAST = 3

# Period of the sliding-window pattern where the file has no pattern key (src/models/<arch>.cpp load_swa_pattern).
DEFAULT_SWA_PERIOD = {"gemma3": 6}

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def _get(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise SystemExit(f"{key} is missing from the model")
    return field.contents()


def kept_blocks(n_layer: int, first: int, last: int) -> list[int]:
    if first < 0 or last < 0 or first + last < 1:
        raise SystemExit("keep at least one block (--first K --last L, K, L >= 0)")
    if first + last > n_layer:
        raise SystemExit(f"--first {first} --last {last} keeps more than the model's {n_layer} blocks")
    return list(range(first)) + list(range(n_layer - last, n_layer))


def _swa_roles(reader: gguf.GGUFReader, arch: str, n_layer: int) -> list[bool] | None:
    """The source's ``is_swa`` per block (``set_swa_pattern(period, dense_first=False)``), None if it has no
    sliding window."""
    window = reader.get_field(f"{arch}.attention.sliding_window")
    if window is None or int(window.contents()) <= 0:
        return None
    field = reader.get_field(f"{arch}.attention.sliding_window_pattern")
    if field is not None and field.types[0] == gguf.GGUFValueType.ARRAY:
        return [bool(x) for x in field.contents()]
    period = int(field.contents()) if field is not None else DEFAULT_SWA_PERIOD.get(arch)
    if period is None:
        return None
    return [period == 0 or (il % period < period - 1) for il in range(n_layer)]


def build(reader: gguf.GGUFReader, out: Path, blocks: list[int]) -> list[bool] | None:
    """Write the draft keeping ``blocks`` of ``reader``'s model; returns the source's sliding-window roles."""
    arch = _get(reader, gguf.Keys.General.ARCHITECTURE)
    n_layer = int(_get(reader, f"{arch}.block_count"))
    m = len(blocks)
    swa_key = f"{arch}.attention.sliding_window_pattern"
    roles = _swa_roles(reader, arch, n_layer)

    writer = gguf.GGUFWriter(out, arch, endianess=reader.endianess)
    align = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if align is not None:
        writer.data_alignment = int(align.contents())
    for field in reader.fields.values():
        # general.architecture and the GGUF.* header fields are written by GGUFWriter itself
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == swa_key:
            continue  # written below from the per-block roles
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == f"{arch}.block_count":
            value = m
        elif (vtype == gguf.GGUFValueType.ARRAY and field.name.startswith(f"{arch}.")
              and len(field.data) == n_layer):
            value = [value[i] for i in blocks]  # a per-layer array
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    if roles is not None:
        writer.add_key_value(swa_key, [roles[i] for i in blocks], gguf.GGUFValueType.ARRAY,
                             sub_type=gguf.GGUFValueType.BOOL)

    new_index = {old: new for new, old in enumerate(blocks)}
    for t in reader.tensors:
        mt = _BLK.match(t.name)
        if mt is None:
            name = t.name
        elif int(mt.group(1)) in new_index:
            name = f"blk.{new_index[int(mt.group(1))]}.{mt.group(2)}"
        else:
            continue
        writer.add_tensor(name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type,
                          tensor_endianess=reader.endianess)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _check(reader, out, arch, blocks)
    return roles


def _check(src: gguf.GGUFReader, out: Path, arch: str, blocks: list[int]) -> None:
    """The vocabulary is byte for byte the source's, the kept blocks' tensors are the source's."""
    dst = gguf.GGUFReader(out, "r")
    for field in src.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        other = dst.get_field(field.name)
        if other is None or other.types != field.types:
            raise SystemExit(f"{field.name} was not copied")
        a = [np.asarray(field.parts[i]).tobytes() for i in field.data]
        b = [np.asarray(other.parts[i]).tobytes() for i in other.data]
        if a != b:
            raise SystemExit(f"{field.name} differs from the source")
    if int(_get(dst, f"{arch}.block_count")) != len(blocks):
        raise SystemExit("block_count was not written")
    src_t = {t.name: t for t in src.tensors}
    new_index = {old: new for new, old in enumerate(blocks)}
    for t in dst.tensors:
        mt = _BLK.match(t.name)
        name = t.name if mt is None else f"blk.{blocks[int(mt.group(1))]}.{mt.group(2)}"
        s = src_t[name]
        if s.tensor_type != t.tensor_type or not np.array_equal(s.data, t.data):
            raise SystemExit(f"{t.name} differs from the source's {name}")
    want = sum(1 for t in src.tensors if (m := _BLK.match(t.name)) is None or int(m.group(1)) in new_index)
    if len(dst.tensors) != want:
        raise SystemExit(f"wrote {len(dst.tensors)} tensors, expected {want}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("out", type=Path, help="the draft GGUF to write")
    ap.add_argument("--first", type=int, default=DEFAULT_FIRST, help=f"keep the first K blocks ({DEFAULT_FIRST})")
    ap.add_argument("--last", type=int, default=DEFAULT_LAST, help=f"keep the last L blocks ({DEFAULT_LAST})")
    ap.add_argument("--blocks", type=str, default=None,
                    help="keep these blocks instead, comma-separated source indices in increasing order (e.g. 0,2,4,17)")
    ap.add_argument("--model", type=Path, default=None, help="source GGUF (default: the embedded model)")
    args = ap.parse_args(argv)

    src = args.model
    if src is None:
        from service.catalog.embedded import embedded_model_path

        src = Path(embedded_model_path())
    reader = gguf.GGUFReader(src, "r")
    arch = _get(reader, gguf.Keys.General.ARCHITECTURE)
    n_layer = int(_get(reader, f"{arch}.block_count"))
    if args.blocks:
        blocks = [int(x) for x in args.blocks.split(",")]
        if blocks != sorted(set(blocks)) or blocks[0] < 0 or blocks[-1] >= n_layer:
            raise SystemExit(f"--blocks must be increasing indices below {n_layer}")
    else:
        blocks = kept_blocks(n_layer, args.first, args.last)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    roles = build(reader, args.out, blocks)
    kinds = "" if roles is None else " (" + ", ".join("swa" if roles[i] else "global" for i in blocks) + ")"
    print(f"source {src}: {n_layer} blocks")
    print(f"kept blocks {blocks}{kinds} as blk.0..blk.{len(blocks) - 1}, plus token_embd, output_norm")
    print(f"wrote {args.out}: {os.path.getsize(args.out) / 1e6:.1f} MB "
          f"(source {os.path.getsize(src) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
