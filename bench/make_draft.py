"""Write a draft model for speculative decoding: the embedded model with fewer transformer blocks.

    python bench/make_draft.py OUT.gguf [--first K] [--last L] [--model PATH]

A draft model must share the main model's vocabulary token by token (the service refuses any other), and no
smaller model with gemma-3's 262144-token vocabulary is at hand, so this builds one from the embedded model's
own tensors (gemma-3-270m Q4_K_M, ``service.models.embedded_model_path()``): it keeps the first K and the last L
of its 18 blocks, renumbered blk.0..blk.M-1 (M = K + L), plus ``token_embd`` and ``output_norm`` (and
``output`` where a model has one; gemma-3 ties it to ``token_embd``). Every tensor keeps its quantized type and
its bytes. All metadata is copied unchanged (the tokenizer arrays exactly, checked after writing) except
``<arch>.block_count`` = M and per-layer arrays, cut to the kept blocks. gemma-3 alternates 5 sliding-window
blocks (RoPE base 10000) with one global block (RoPE base 1e6) by position (llama.cpp ``set_swa_pattern(6)``),
so renumbered blocks would change role; the draft therefore carries ``<arch>.attention.sliding_window_pattern``
as a per-block array (read by llama.cpp's ``load_swa_pattern``), each kept block keeping its original role.

Measured (2 shared cores, greedy, 96 tokens, draft_rows=32, q8_0 cache; drafted/accepted tokens, decode wall
seconds with the draft, and without drafting (``speculative=False``) beside it; "free" = "The history of the
printing press begins", "copy" = an 81-word paragraph then "The same text, copied exactly:" and its first 40
characters):

    K+L   M  size MB | free drafted/accepted  s (plain) | copy drafted/accepted  s (plain)
    RESULTS_TABLE

RECOMMENDATION
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import numpy as np

import gguf

DEFAULT_FIRST = 3
DEFAULT_LAST = 1

# Period of the sliding-window pattern where the file has no pattern key (src/models/<arch>.cpp load_swa_pattern).
DEFAULT_SWA_PERIOD = {"gemma3": 6}

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


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
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    n_layer = int(reader.get_field(f"{arch}.block_count").contents())
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
    if int(dst.get_field(f"{arch}.block_count").contents()) != len(blocks):
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
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from service.models import embedded_model_path

        src = Path(embedded_model_path())
    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    n_layer = int(reader.get_field(f"{arch}.block_count").contents())
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
