"""A small mirror of ggml's graph building and of ``ggml_gallocr``, to predict the compute buffer.

llama.cpp measures its compute buffer by allocating the worst-case graph with
``ggml_gallocr`` (``ggml/src/ggml-alloc.c`` of the llama.cpp vendored by
llama-cpp-python 0.3.36) and keeping the allocator's high-water mark. This
module replays that: tensors carry ggml's shapes, strides and element types,
``Graph.expand`` orders nodes as ``ggml_visit_parents_graph`` does (sources
first, left to right, leaves apart), and ``peak_bytes`` runs
``ggml_gallocr_alloc_graph_impl``:

- graph inputs (leaves) are allocated first, in leaf order;
- a view (``view_src`` set) takes no memory and keeps its source alive;
- an op that ``ggml_op_can_inplace`` reuses its first own, non-output source
  of the same layout whose only consumer it is (``ggml_gallocr_allocate_node``);
- a tensor is freed after its last consumer, unless it is a graph output
  (``ggml_gallocr_free_node``);
- ``ggml_dyn_tallocr_alloc``: best fit over the free blocks except the last,
  else the last block (which grows the buffer); sizes padded to the buffer
  alignment (32 bytes on the CPU, ``TENSOR_ALIGNMENT``); freed blocks merge
  with their neighbours (``ggml_dyn_tallocr_free_bytes``).

``trace`` records those decisions (they depend on the graph's structure and layouts, not on
the offsets) and ``replay`` runs the allocator over them with any tensor sizes, so one trace
serves every KV length of a graph structure.

Pure standard library; weights are not modelled (they live in their own buffers).
"""

from __future__ import annotations

from typing import Sequence

ALIGNMENT = 32
"""``TENSOR_ALIGNMENT`` (ggml/src/ggml-impl.h): the CPU buffer type's alignment."""

# (block size, bytes per block) of the element types the graphs use (ggml_type_traits).
TYPE_SIZES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "i32": (1, 4), "i64": (1, 8),
    "q8_0": (32, 34), "q5_1": (32, 24), "q5_0": (32, 22), "q4_1": (32, 20), "q4_0": (32, 18), "iq4_nl": (32, 18),
}

# ggml_op_can_inplace (ggml/src/ggml-alloc.c), by our op names.
_INPLACE = frozenset({"scale", "add", "mul", "div", "unary", "rope", "rms_norm", "soft_max", "clamp"})

INPUT = 1
OUTPUT = 2


def row_bytes(type_: str, n: int) -> int:
    """``ggml_row_size``."""
    blck, size = TYPE_SIZES[type_]
    return size * n // blck


class Tensor:
    """The fields of ``ggml_tensor`` that allocation looks at."""

    __slots__ = ("ne", "nb", "type", "op", "src", "view_src", "view_offs", "flags", "external", "name")

    def __init__(self, type_: str, ne: Sequence[int], op: str = "none", src: Sequence["Tensor"] = (),
                 view_src: "Tensor | None" = None, nb: Sequence[int] | None = None, name: str = "",
                 offs: int = 0) -> None:
        self.type = type_
        self.ne = tuple(ne) + (1,) * (4 - len(ne))
        if nb is None:
            b0 = TYPE_SIZES[type_][1]
            b1 = row_bytes(type_, self.ne[0])
            nb = (b0, b1, b1 * self.ne[1], b1 * self.ne[1] * self.ne[2])
        self.nb = tuple(nb)
        self.op = op
        self.src = tuple(src)
        self.view_src: Tensor | None = None
        self.view_offs = 0
        if view_src is not None:
            # ggml_view_impl: a view of a view points at the original, offsets add up
            self.view_src = view_src.view_src or view_src
            self.view_offs = view_src.view_offs + offs
        self.flags = 0
        self.external = False
        self.name = name

    @property
    def nbytes(self) -> int:
        n = row_bytes(self.type, self.ne[0])
        return n * self.ne[1] * self.ne[2] * self.ne[3]

    @property
    def n_elements(self) -> int:
        return self.ne[0] * self.ne[1] * self.ne[2] * self.ne[3]

    def is_contiguous(self) -> bool:
        b = TYPE_SIZES[self.type][1]
        if self.nb[0] != b:
            return False
        exp = row_bytes(self.type, self.ne[0])
        for i in (1, 2, 3):
            if self.ne[i] != 1 and self.nb[i] != exp:
                return False
            exp *= self.ne[i]
        return True


def same_layout(a: Tensor, b: Tensor) -> bool:
    """``ggml_are_same_layout``: type, shape and strides."""
    return a.type == b.type and a.ne == b.ne and a.nb == b.nb


# ---- ops (ggml.c), reduced to shapes ---------------------------------------------------------


def new_input(type_: str, ne: Sequence[int], name: str = "") -> Tensor:
    t = Tensor(type_, ne, name=name)
    t.flags |= INPUT
    return t


def weight(type_: str = "f32") -> Tensor:
    t = Tensor(type_, (1,))
    t.external = True
    return t


def unary_like(op: str, a: Tensor, *others: Tensor, type_: str | None = None) -> Tensor:
    """An op whose result is ``ggml_dup_tensor(a)`` (same shape, contiguous)."""
    return Tensor(type_ or a.type, a.ne, op, (a, *others))


def mul_mat(a: Tensor, b: Tensor) -> Tensor:
    return Tensor("f32", (a.ne[1], b.ne[1], b.ne[2], b.ne[3]), "mul_mat", (a, b))


def proj(n_out: int, x: Tensor) -> Tensor:
    """``ggml_mul_mat(w, x)`` with a weight ``w`` of ``n_out`` rows (weights live outside the compute buffer)."""
    return Tensor("f32", (n_out, x.ne[1], x.ne[2], x.ne[3]), "mul_mat", (x,))


def get_rows(a: Tensor, idx: Tensor) -> Tensor:
    return Tensor("i32" if a.type == "i32" else "f32", (a.ne[0], idx.ne[0], idx.ne[1], idx.ne[2]), "get_rows", (a, idx))


def view(a: Tensor, ne: Sequence[int], nb: Sequence[int] | None = None, op: str = "view", offs: int = 0) -> Tensor:
    """``ggml_view_*`` / ``ggml_reshape_*``: no memory of its own (``view_src``)."""
    return Tensor(a.type, ne, op, (a,), view_src=a, nb=nb, offs=offs)


def reshape(a: Tensor, *ne: int) -> Tensor:
    return view(a, ne, op="reshape")


def permute(a: Tensor, axes: Sequence[int]) -> Tensor:
    ne = [0] * 4
    nb = [0] * 4
    for i, ax in enumerate(axes):
        ne[ax] = a.ne[i]
        nb[ax] = a.nb[i]
    return view(a, ne, nb, op="permute")


def transpose(a: Tensor) -> Tensor:
    return permute(a, (1, 0, 2, 3))


def cont(a: Tensor, *ne: int) -> Tensor:
    return Tensor(a.type, ne or a.ne, "cont", (a,))


class Graph:
    """``ggml_cgraph``: nodes in ``ggml_visit_parents_graph`` order, and leaves."""

    def __init__(self) -> None:
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []
        self._seen: set[int] = set()

    def expand(self, t: Tensor) -> Tensor:
        stack: list[tuple[Tensor, int]] = [(t, 0)]
        seen = self._seen
        if id(t) in seen:
            return t
        seen.add(id(t))
        while stack:
            node, i = stack.pop()
            if i < len(node.src):
                stack.append((node, i + 1))
                s = node.src[i]
                if id(s) not in seen:
                    seen.add(id(s))
                    stack.append((s, 0))
                continue
            if node.op == "none":
                self.leafs.append(node)
            else:
                self.nodes.append(node)
        return t


# ---- ggml_dyn_tallocr + ggml_gallocr ---------------------------------------------------------


class _DynAlloc:
    """``ggml_dyn_tallocr`` with one chunk (the CPU buffer type has no maximum size)."""

    __slots__ = ("blocks", "max_size")

    def __init__(self) -> None:
        self.blocks: list[list[int]] = [[0, 1 << 62]]  # [offset, size], sorted by offset
        self.max_size = 0

    def alloc(self, size: int) -> int:
        size = (size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        blocks = self.blocks
        best = -1
        best_size = 1 << 63
        for i in range(len(blocks) - 1):
            bs = blocks[i][1]
            if bs >= size and bs <= best_size:
                best = i
                best_size = bs
        if best == -1:
            best = len(blocks) - 1
        b = blocks[best]
        off = b[0]
        b[0] += size
        b[1] -= size
        if b[1] == 0:
            del blocks[best]
        if off + size > self.max_size:
            self.max_size = off + size
        return off

    def free(self, off: int, size: int) -> None:
        size = (size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        blocks = self.blocks
        n = len(blocks)
        for i in range(n):
            b = blocks[i]
            if b[0] + b[1] == off:
                b[1] += size
                if i < n - 1 and b[0] + b[1] == blocks[i + 1][0]:
                    b[1] += blocks[i + 1][1]
                    del blocks[i + 1]
                return
            if off + size == b[0]:
                b[0] = off
                b[1] += size
                if i > 0 and blocks[i - 1][0] + blocks[i - 1][1] == b[0]:
                    blocks[i - 1][1] += b[1]
                    del blocks[i]
                return
        pos = 0
        while pos < n and blocks[pos][0] < off:
            pos += 1
        blocks.insert(pos, [off, size])


ALLOC = 0
FREE = 1
REUSE = 2


def trace(graph: Graph) -> tuple[list[Tensor], list[tuple[int, int, int]]]:
    """The allocator's decisions over ``graph``: which tensor is allocated, reused in place or freed, in order.

    ``ggml_gallocr_alloc_graph_impl``'s choices (leaves first, in-place reuse, frees after the last
    consumer) depend on the graph's structure and layouts only, never on the allocator's offsets:
    the trace can be replayed (``replay``) with other tensor sizes, e.g. another KV length.
    Returns the allocated tensors (indexed by the trace) and the events ``(op, tensor, parent)``.
    """
    tensors: list[Tensor] = []
    index: dict[int, int] = {}
    events: list[tuple[int, int, int]] = []
    n_children: dict[int, int] = {}
    n_views: dict[int, int] = {}
    allocated: dict[int, bool] = {}

    def tid(t: Tensor) -> int:
        k = id(t)
        i = index.get(k)
        if i is None:
            i = index[k] = len(tensors)
            tensors.append(t)
        return i

    def allocate(t: Tensor) -> None:
        k = id(t)
        if t.external or k in allocated or t.view_src is not None:
            return
        allocated[k] = True
        if t.op in _INPLACE:
            for p in t.src:
                pk = id(p)
                if not allocated.get(pk, False):
                    continue
                if p.flags & OUTPUT or (p.view_src is not None and p.view_src.flags & OUTPUT):
                    continue
                if not same_layout(t, p):
                    continue
                if n_children.get(pk, 0) == 1 and n_views.get(pk, 0) == 0:
                    if p.view_src is not None:
                        vs = p.view_src
                        vk = id(vs)
                        if n_views.get(vk, 0) == 1 and n_children.get(vk, 0) == 0 and p.view_offs == 0:
                            allocated[pk] = False
                            allocated[vk] = False
                            events.append((REUSE, tid(t), tid(vs)))
                            return
                    else:
                        allocated[pk] = False
                        events.append((REUSE, tid(t), tid(p)))
                        return
        events.append((ALLOC, tid(t), -1))

    def free(t: Tensor) -> None:
        if t.flags & OUTPUT:
            return
        events.append((FREE, tid(t), -1))
        allocated[id(t)] = False

    for leaf in graph.leafs:
        allocate(leaf)
    for node in graph.nodes:
        if node.view_src is not None:
            vk = id(node.view_src)
            n_views[vk] = n_views.get(vk, 0) + 1
        for s in node.src:
            n_children[id(s)] = n_children.get(id(s), 0) + 1
            if s.flags & INPUT:
                allocate(s)
    for node in graph.nodes:
        for p in node.src:
            allocate(p)
        allocate(node)
        for p in node.src:
            pk = id(p)
            n_children[pk] -= 1
            if n_children[pk] == 0 and n_views.get(pk, 0) == 0:
                if p.view_src is not None:
                    vs = p.view_src
                    vk = id(vs)
                    n_views[vk] -= 1
                    if n_views[vk] == 0 and n_children.get(vk, 0) == 0 and allocated.get(vk, False):
                        free(vs)
                elif allocated.get(pk, False):
                    free(p)
    return tensors, events


def replay(events: Sequence[tuple[int, int, int]], sizes: Sequence[int]) -> int:
    """Run ``ggml_dyn_tallocr`` over a ``trace`` with these tensor sizes (bytes); the high-water mark."""
    alloc = _DynAlloc()
    addr = [0] * len(sizes)
    a = ALIGNMENT - 1
    for op, t, p in events:
        if op == ALLOC:
            addr[t] = alloc.alloc(sizes[t])
        elif op == FREE:
            alloc.free(addr[t], sizes[t])
        else:
            # in place: the parent's memory; a larger parent gives its tail back (ggml_gallocr_allocate_node)
            addr[t] = addr[p]
            ps = (sizes[p] + a) // ALIGNMENT * ALIGNMENT
            ns = (sizes[t] + a) // ALIGNMENT * ALIGNMENT
            if ps > ns:
                alloc.free(addr[p] + ns, ps - ns)
    return alloc.max_size


def peak_bytes(graph: Graph) -> int:
    """``ggml_gallocr_reserve_n_size`` for one buffer: the allocator's high-water mark in bytes."""
    tensors, events = trace(graph)
    return replay(events, [t.nbytes for t in tensors])
