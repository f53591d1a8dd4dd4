"""The reserve graph of the mirrored architectures, rebuilt tensor by tensor, and its allocator peak.

llama.cpp measures its compute buffer in ``llama_context::sched_reserve``
(``src/llama-context.cpp``): it builds the worst-case graph (``graph_reserve``:
``n_tokens = min(n_ctx, n_ubatch)``, every token an output, the whole KV view)
and ``ggml_gallocr`` (``ggml/src/ggml-alloc.c``) allocates it. For the mirrored
architectures (``sizing.model.arch.MIRRORED``: llama, qwen2, qwen3, gemma2, gemma3,
qwen3moe, deepseek2 with absorbed MLA) this module rebuilds that graph's tensors
in the builders' node order (``_Reserve``, after ``src/models/*.cpp`` and
``llm_graph_context::build_attn`` / ``build_attn_mha`` / ``build_ffn`` /
``build_moe_ffn`` / ``build_norm`` in ``src/llama-graph.cpp``; the first and last
layers only, see ``KEEP_LAYERS``) and replays ``ggml_gallocr`` over it
(``sizing/memory/graph_alloc.py``): the allocator's decisions are traced once per graph
structure and replayed with each KV length's tensor sizes (``_program``); the peak
is the prediction, cached per model shape and configuration.

Every other architecture goes to ``sizing.memory.compute``'s phase model, and its plans
are calibrated by llama.cpp's own dry run (``service.planning.planner``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..model import arch as archs
from . import graph_alloc as ga
from .context import ContextConfig
from ..model.ggml import cache_type
from .kv import kv_cells
from ..model.spec import ModelSpec


def n_ff(spec: ModelSpec) -> int:
    v = spec.metadata.get(f"{spec.architecture}.feed_forward_length")
    if isinstance(v, list):
        v = max((int(x) for x in v if isinstance(x, int)), default=0)
    return v if isinstance(v, int) and not isinstance(v, bool) else 4 * spec.n_embd


def n_ff_exp(spec: ModelSpec) -> int:
    v = spec.metadata.get(f"{spec.architecture}.expert_feed_forward_length")
    if isinstance(v, list):
        v = max((int(x) for x in v if isinstance(x, int)), default=0)
    return v if isinstance(v, int) and not isinstance(v, bool) else 0



KEEP_LAYERS = 3
"""Layers simulated at each end of the stack. After the first layers the allocator's free list repeats
layer after layer, or every other layer (DeepSeek-V2-Lite), so the first and last three (plus one of each
attention kind, the first MoE layer, and one more to drop an even number) give the same peak as the whole
stack: checked equal over the test matrix for every mirrored fixture."""


@dataclass(frozen=True)
class MoeShape:
    """``build_moe_ffn``'s parameters (``src/llama-graph.cpp``) and the shared experts (deepseek2)."""

    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    """Width of the shared-expert FFN (``n_ff_exp * n_expert_shared``), 0 without shared experts."""
    norm_w: bool
    scale_w: bool
    gating: int
    """``llama_expert_gating_func_type``: 1 softmax, 2 sigmoid."""
    probs_bias: bool


@dataclass(frozen=True)
class MlaShape:
    """DeepSeek-V2 multi-head latent attention, absorbed (``attn_k_b`` / ``attn_v_b``; ``deepseek2.cpp``)."""

    kv_lora_rank: int
    n_embd_head_k_mla: int
    n_embd_head_v_mla: int
    n_rot: int
    q_lora_rank: int
    """0 for the lite models (``wq``), else the ``wq_a`` / ``wq_b`` path."""


@dataclass(frozen=True)
class GraphShape:
    """What the reserve graph's tensor shapes depend on in the model (hashable: the simulation cache key)."""

    arch: str
    n_embd: int
    n_ff: int
    n_vocab: int
    layers: tuple[tuple[int, int, int, int, bool, bool], ...]
    """(n_head, n_head_kv, n_embd_head_k, n_embd_head_v, is_swa, is_moe) of the simulated layers, in order."""
    iswa: bool
    v_max: int
    """``n_embd_v_gqa_max``: the transposed V cache rows (and v_idxs) without flash attention."""
    qk_norm: bool
    qkv_bias: bool
    attn_softcap: bool
    final_softcap: bool
    moe: MoeShape | None = None
    mla: MlaShape | None = None


def _tensor_shape(spec: ModelSpec, name: str) -> tuple[int, ...] | None:
    return next((t.shape for t in spec.tensors if t.name == name), None)


def _moe_shape(spec: ModelSpec) -> MoeShape | None:
    """The routed-expert parameters as ``llama_model::load_hparams`` reads them, or None when not mirrored."""
    arch, md = spec.architecture, spec.metadata
    if not spec.n_expert or not spec.n_expert_used:
        return None
    groups = md.get(f"{arch}.expert_group_count")
    if isinstance(groups, int) and groups > 1:
        return None  # DeepSeek-V3 group selection: not mirrored
    names = spec.tensor_names
    first = next((l.index for l in spec.layers[: spec.n_layer] if f"blk.{l.index}.ffn_gate_inp.weight" in names), None)
    if first is None or f"blk.{first}.ffn_gate_exps.weight" not in names or f"blk.{first}.ffn_up_exps.weight" not in names:
        return None  # fused gate_up experts or no gate: not mirrored
    up = _tensor_shape(spec, f"blk.{first}.ffn_up_exps.weight")
    sh = _tensor_shape(spec, f"blk.{first}.ffn_up_shexp.weight")
    scale = md.get(f"{arch}.expert_weights_scale")
    if archs.traits(arch).moe_norm_fixed:
        norm_w, gating = True, 1  # src/models/qwen3moe.cpp: norm_w true, softmax
    else:
        norm_w = bool(md.get(f"{arch}.expert_weights_norm", False))
        g = md.get(f"{arch}.expert_gating_func")
        gating = g if isinstance(g, int) and g else 1
    if gating not in (1, 2):
        return None
    return MoeShape(
        n_expert=spec.n_expert,
        n_expert_used=spec.n_expert_used,
        n_ff_exp=up[1] if up and len(up) > 1 else n_ff_exp(spec),
        n_ff_shexp=sh[1] if sh and len(sh) > 1 else 0,
        norm_w=norm_w,
        scale_w=isinstance(scale, (int, float)) and scale not in (0, 1),
        gating=gating,
        probs_bias=f"blk.{first}.exp_probs_b.bias" in names,
    )


def graph_shape(spec: ModelSpec) -> GraphShape | None:
    """The simulated model shape (memoized on the spec), or None when the graph is not mirrored."""
    memo = spec.__dict__
    if "_graph_shape_memo" not in memo:
        memo["_graph_shape_memo"] = _graph_shape(spec)
    shape: GraphShape | None = memo["_graph_shape_memo"]
    return shape


def _graph_shape(spec: ModelSpec) -> GraphShape | None:
    """The simulated model shape, or None when the architecture's graph is not mirrored (recurrent, others)."""
    arch = spec.architecture
    t = archs.traits(arch)
    if arch not in archs.MIRRORED or spec.state is not None or spec.ssm is not None:
        return None
    if not t.moe_graph and (spec.mla is not None or spec.n_expert):
        return None
    layers = spec.layers[: spec.n_layer]
    if not layers or any(not l.has_kv for l in layers):
        return None
    names = spec.tensor_names
    moe: MoeShape | None = None
    mla: MlaShape | None = None
    if t.moe_graph:
        moe = _moe_shape(spec)
        if moe is None:
            return None
    if t.mla_graph:
        if spec.mla is None or "blk.0.attn_k_b.weight" not in names or spec.swa_layer_count:
            return None  # legacy wkv_b (non-absorbed) files: not mirrored
        if spec.metadata.get(f"{arch}.attention.temperature_scale"):
            return None
        qa = _tensor_shape(spec, "blk.0.attn_q_a.weight")
        mla = MlaShape(spec.mla.kv_lora_rank, spec.mla.n_embd_head_k_mla, spec.mla.n_embd_head_v_mla,
                       spec.mla.n_rot, qa[1] if qa and len(qa) > 1 else 0)
    n = len(layers)
    keep = set(range(min(KEEP_LAYERS, n))) | set(range(max(n - KEEP_LAYERS, 0), n))
    for kind in (False, True):
        # the last layer of each attention kind, so both masks and caches take part
        last = [l.index for l in layers if l.is_swa == kind]
        if last:
            keep.add(last[-1] - layers[0].index)
    if moe is not None:
        # the last dense lead layer and the first MoE layer (deepseek2's n_layer_dense_lead)
        for i, l in enumerate(layers):
            if f"blk.{l.index}.ffn_gate_inp.weight" in names:
                keep |= {max(i - 1, 0), i}
                break
    if (n - len(keep)) % 2:
        # the free list may alternate layer by layer (DeepSeek-V2-Lite does): drop an even number of layers
        keep.add(min(set(range(n)) - keep))
    sel = tuple(
        (l.n_head, l.n_head_kv, l.n_embd_head_k, l.n_embd_head_v, l.is_swa, f"blk.{l.index}.ffn_gate_inp.weight" in names)
        for i, l in enumerate(layers) if i in keep
    )
    return GraphShape(
        arch=arch,
        n_embd=spec.n_embd,
        n_ff=n_ff(spec),
        n_vocab=spec.n_vocab,
        layers=sel,
        iswa=spec.swa_layer_count > 0,
        v_max=max(l.n_head_kv * l.n_embd_head_v for l in layers),
        qk_norm="blk.0.attn_q_norm.weight" in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        attn_softcap=t.attn_softcap and bool(spec.metadata.get(f"{arch}.attn_logit_softcapping")),
        final_softcap=bool(spec.metadata.get(f"{arch}.final_logit_softcapping")),
        moe=moe,
        mla=mla,
    )


def _rot_size_k(head_dim: int) -> int:
    """``llama_kv_cache::build_input_k_rot``: the largest power of two (from 64) that divides the head size."""
    nrot = 64
    while True:
        nrot *= 2
        if head_dim % nrot:
            break
    return nrot // 2


class _Reserve:
    """Builds the reserve graph of ``llama_context::graph_reserve`` for one model and configuration."""

    def __init__(self, shape: GraphShape, cells_full: int, cells_swa: int, n_ubatch: int, n_stream: int,
                 flash: bool, type_k: str, type_v: str) -> None:
        self.shape, self.flash = shape, flash
        self.g = ga.Graph()
        self.n_stream = n_stream
        # graph_reserve rounds n_tokens up to a multiple of n_seqs
        self.n_tokens = (n_ubatch + n_stream - 1) // n_stream * n_stream
        self.cells_full, self.cells_swa = cells_full, cells_swa
        self.tk, self.tv = type_k, type_v

    # inputs, in the order the builders create them
    def inp_embd(self) -> ga.Tensor:
        g, n = self.g, self.n_tokens
        tokens = ga.new_input("i32", (n,))
        tok_embd = ga.Tensor("f16", (self.shape.n_embd, self.shape.n_vocab))
        tok_embd.external = True
        cur = ga.get_rows(tok_embd, tokens)  # [n_embd, n_tokens] F32
        embd = ga.new_input("f32", (self.shape.n_embd, n))
        g.expand(cur)
        g.expand(embd)  # ggml_build_forward_select adds the unused embeddings input too
        return cur

    def kv_inputs(self, n_kv: int, kv_layer_v: int, has_v: bool = True) -> dict[str, Any]:
        n, ns = self.n_tokens, self.n_stream
        d: dict[str, Any] = {}
        d["k_idxs"] = ga.new_input("i64", (n,))
        v_trans = not self.flash
        d["v_idxs"] = ga.new_input("i64", (n * kv_layer_v,) if v_trans else (n,)) if has_v else None
        d["mask"] = ga.new_input("f16" if self.flash else "f32", (n_kv, n // ns, 1, ns))
        d["n_kv"] = n_kv
        return d

    def rot_inputs(self, head_k: int, head_v: int) -> tuple[ga.Tensor | None, ga.Tensor | None]:
        k_rot = v_rot = None
        if cache_type(self.tk).quantized and head_k % 64 == 0:
            r = _rot_size_k(head_k)
            k_rot = ga.new_input("f32", (r, r))
        if cache_type(self.tv).quantized and head_v % 64 == 0:
            v_rot = ga.new_input("f32", (64, 64))
        return k_rot, v_rot

    def norm(self, x: ga.Tensor) -> ga.Tensor:
        return ga.unary_like("mul", ga.unary_like("rms_norm", x), ga.weight())

    @staticmethod
    def hadamard(cur: ga.Tensor, rot: ga.Tensor) -> ga.Tensor:
        """``llama_mul_mat_hadamard`` (src/llama-impl.h)."""
        n = rot.ne[0]
        res = ga.reshape(cur, n, cur.n_elements // n) if cur.is_contiguous() else ga.cont(cur, n, cur.n_elements // n)
        res = ga.mul_mat(rot, res)
        return ga.reshape(res, *cur.ne)

    def attn(self, inp: dict[str, Any], q: ga.Tensor, k: ga.Tensor, v: ga.Tensor, layer: tuple[int, int, int, int, bool, bool],
             n_kv_layers_v: int, iswa: bool, softcap: bool) -> ga.Tensor:
        """``build_attn`` (kv / kv_iswa) + ``build_attn_mha`` + the output projection."""
        g, flash, ns, n = self.g, self.flash, self.n_stream, self.n_tokens
        k_rot, v_rot = inp["k_rot"], inp["v_rot"]
        if k_rot is not None:
            q = self.hadamard(q, k_rot)
            k = self.hadamard(k, k_rot)
        if v_rot is not None:
            v = self.hadamard(v, v_rot)
        if iswa:
            g.expand(q); g.expand(k); g.expand(v)
        else:
            g.expand(q); g.expand(v); g.expand(k)
        n_head, n_kv_h, hd_k, hd_v = layer[:4]
        n_kv = inp["n_kv"]
        kv_size = n_kv
        # cpy_k: view_2d of k_cur, set_rows into the cache (a view of the external cache tensor)
        cache_k = ga.weight(self.tk)
        kc = ga.view(k, (hd_k * n_kv_h, n), (k.nb[0], k.nb[2], k.nb[2] * n, k.nb[2] * n))
        g.expand(ga.Tensor(self.tk, (1,), "set_rows", (cache_k, kc, inp["k_idxs"]), view_src=cache_k))
        cache_v = ga.weight(self.tv)
        if flash:
            vc = ga.view(v, (hd_v * n_kv_h, n), (v.nb[0], v.nb[2], v.nb[2] * n, v.nb[2] * n))
            g.expand(ga.Tensor(self.tv, (1,), "set_rows", (cache_v, vc, inp["v_idxs"]), view_src=cache_v))
        else:
            vc = ga.reshape(v, hd_v * n_kv_h, n)
            vc = ga.reshape(vc, 1, vc.n_elements)
            vv = ga.reshape(cache_v, 1, 1)
            g.expand(ga.Tensor(self.tv, (1,), "set_rows", (vv, vc, inp["v_idxs"]), view_src=cache_v))
        # get_k / get_v: views of the cache
        kview = ga.view(cache_k, (hd_k, n_kv_h, n_kv, ns), (ga.TYPE_SIZES[self.tk][1], ga.row_bytes(self.tk, hd_k),
                        ga.row_bytes(self.tk, hd_k * n_kv_h), ga.row_bytes(self.tk, hd_k * n_kv_h * kv_size)))
        if flash:
            vview = ga.view(cache_v, (hd_v, n_kv_h, n_kv, ns), (ga.TYPE_SIZES[self.tv][1], ga.row_bytes(self.tv, hd_v),
                            ga.row_bytes(self.tv, hd_v * n_kv_h), ga.row_bytes(self.tv, hd_v * n_kv_h * kv_size)))
        else:
            vview = ga.view(cache_v, (n_kv, n_kv_h, hd_v, ns), (2, 2 * kv_size * hd_v, 2 * kv_size, 2 * kv_size * n_kv_layers_v))
        # build_attn_mha
        qv = ga.view(q, (q.ne[0], q.ne[1], q.ne[2] // ns, ns), (q.nb[0], q.nb[1], q.nb[2], q.nb[2] * (q.ne[2] // ns)))
        qp = ga.permute(qv, (0, 2, 1, 3))
        kp = ga.permute(kview, (0, 2, 1, 3))
        vp = ga.permute(vview, (0, 2, 1, 3))
        if flash:
            fa = ga.Tensor("f32", (vp.ne[0], qp.ne[2], qp.ne[1], qp.ne[3]), "flash_attn_ext", (qp, kp, vp, inp["mask"]))
            cur = ga.reshape(fa, fa.ne[0] * fa.ne[1], fa.ne[2] * fa.ne[3])
        else:
            kq = ga.mul_mat(kp, qp)
            if softcap:
                kq = ga.unary_like("scale", kq)
                kq = ga.unary_like("unary", kq)
                kq = ga.unary_like("scale", kq)
            kq = ga.unary_like("soft_max", kq, inp["mask"])
            kqv = ga.mul_mat(vp, kq)
            cur = ga.permute(kqv, (0, 2, 1, 3))
            cur = ga.cont(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        g.expand(cur)
        if v_rot is not None:
            cur = self.hadamard(cur, v_rot)
        return ga.proj(self.shape.n_embd, cur)

    def ffn(self, cur: ga.Tensor, n_ff: int) -> ga.Tensor:
        """``build_ffn``, LLM_FFN_PAR: up, gate, then swiglu/geglu_split(gate, up) (GGML_OP_GLU: not in place), down."""
        up = ga.proj(n_ff, cur)
        gate = ga.proj(n_ff, cur)
        cur = ga.Tensor("f32", (n_ff, cur.ne[1]), "glu", (gate, up))
        return ga.proj(self.shape.n_embd, cur)

    def moe_ffn(self, cur: ga.Tensor) -> ga.Tensor:
        """``build_moe_ffn`` (separate gate/up experts, SiLU) plus deepseek2's shared experts."""
        m = self.shape.moe
        assert m is not None
        g, n_embd, n = self.g, self.shape.n_embd, cur.ne[1]
        ffn_in = cur
        logits = ga.proj(m.n_expert, cur)
        probs = ga.unary_like("soft_max" if m.gating == 1 else "unary", logits)
        sel = ga.unary_like("add", probs, ga.weight()) if m.probs_bias else probs
        argsort = ga.Tensor("i32", (m.n_expert, n), "argsort", (sel,))
        topk = ga.view(argsort, (m.n_expert_used, n), argsort.nb)  # ggml_argsort_top_k: a view of the argsort
        weights = ga.get_rows(ga.reshape(probs, 1, m.n_expert, n), topk)
        if m.norm_w:
            w2 = ga.reshape(weights, m.n_expert_used, n)
            wsum = ga.Tensor("f32", (1, n), "sum_rows", (w2,))
            wsum = ga.unary_like("clamp", wsum)
            w2 = ga.unary_like("div", w2, wsum)
            weights = ga.reshape(w2, 1, m.n_expert_used, n)
        if m.scale_w:
            weights = ga.unary_like("scale", weights)
        g.expand(weights)  # "call early so that topk-moe can be used"
        cur3 = ga.reshape(cur, n_embd, 1, n)
        up = ga.Tensor("f32", (m.n_ff_exp, m.n_expert_used, n), "mul_mat_id", (cur3, topk))
        gate = ga.Tensor("f32", (m.n_ff_exp, m.n_expert_used, n), "mul_mat_id", (cur3, topk))
        act = ga.Tensor("f32", (m.n_ff_exp, m.n_expert_used, n), "glu", (gate, up))
        experts = ga.Tensor("f32", (n_embd, m.n_expert_used, n), "mul_mat_id", (act, topk))
        experts = ga.unary_like("mul", experts, weights)
        g.expand(experts)
        views = []
        for i in range(m.n_expert_used):
            v = ga.view(experts, (n_embd, n), (4, experts.nb[2], experts.nb[2] * n, experts.nb[2] * n), offs=i * experts.nb[1])
            g.expand(v)
            views.append(v)
        out = views[0]
        for v in views[1:]:
            out = ga.Tensor("f32", (n_embd, n), "add", (out, v))
            g.expand(out)
        if m.n_expert_used == 1:
            out = ga.cont(out)
        if m.n_ff_shexp:
            out = ga.unary_like("add", out, self.ffn(ffn_in, m.n_ff_shexp))
        return out

    def attn_mla(self, inp: dict[str, Any], q: ga.Tensor, k: ga.Tensor, v: ga.Tensor, n_head: int) -> ga.Tensor:
        """``build_attn`` with the K-only input (absorbed MLA: MQA over the latent) + ``build_attn_mha`` with v_mla."""
        mla = self.shape.mla
        assert mla is not None
        g, flash, ns, n = self.g, self.flash, self.n_stream, self.n_tokens
        g.expand(q); g.expand(v); g.expand(k)
        hd_k = k.ne[0]
        n_kv = inp["n_kv"]
        cache_k = ga.weight(self.tk)
        kc = ga.view(k, (hd_k, n), (k.nb[0], k.nb[2], k.nb[2] * n, k.nb[2] * n))
        g.expand(ga.Tensor(self.tk, (1,), "set_rows", (cache_k, kc, inp["k_idxs"]), view_src=cache_k))
        row = ga.row_bytes(self.tk, hd_k)
        kview = ga.view(cache_k, (hd_k, 1, n_kv, ns), (ga.TYPE_SIZES[self.tk][1], row, row, row * n_kv))
        vview = ga.view(kview, (v.ne[0], 1, n_kv, ns), kview.nb)
        qv = ga.view(q, (q.ne[0], q.ne[1], q.ne[2] // ns, ns), (q.nb[0], q.nb[1], q.nb[2], q.nb[2] * (q.ne[2] // ns)))
        qp = ga.permute(qv, (0, 2, 1, 3))
        kp = ga.permute(kview, (0, 2, 1, 3))
        vp = ga.permute(vview, (0, 2, 1, 3))
        if flash:
            fa = ga.Tensor("f32", (vp.ne[0], qp.ne[2], qp.ne[1], qp.ne[3]), "flash_attn_ext", (qp, kp, vp, inp["mask"]))
            cur = ga.permute(fa, (0, 2, 1, 3))
            cur = ga.proj(mla.n_embd_head_v_mla, cur)  # v_mla
            cur = ga.permute(cur, (0, 2, 1, 3))
            cur = ga.cont(cur)
            cur = ga.reshape(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        else:
            kq = ga.mul_mat(kp, qp)
            kq = ga.unary_like("soft_max", kq, inp["mask"])
            # v is a view of K (not transposed): build_attn_mha copies its transpose
            vt = ga.cont(ga.transpose(vp))
            kqv = ga.mul_mat(vt, kq)
            kqv = ga.proj(mla.n_embd_head_v_mla, kqv)  # v_mla
            cur = ga.permute(kqv, (0, 2, 1, 3))
            cur = ga.cont(cur, cur.ne[0] * cur.ne[1], cur.ne[2] * cur.ne[3])
        g.expand(cur)
        return ga.proj(self.shape.n_embd, cur)

    def build_deepseek2(self) -> ga.Graph:
        """``llama_model_deepseek2::graph`` (``src/models/deepseek2.cpp``), absorbed MLA (``is_mla``)."""
        s, g, n = self.shape, self.g, self.n_tokens
        mla = s.mla
        assert mla is not None
        nope = mla.n_embd_head_k_mla - mla.n_rot
        kv_w = mla.kv_lora_rank + mla.n_rot
        inpL = self.inp_embd()
        pos = ga.new_input("i32", (n,))
        inp = self.kv_inputs(self.cells_full, 0, has_v=False)
        out_ids = ga.new_input("i32", (n,))
        for il, layer in enumerate(s.layers):
            n_head, is_moe = layer[0], layer[5]
            inpSA = inpL
            cur = self.norm(inpL)
            if mla.q_lora_rank:
                q = self.norm(ga.proj(mla.q_lora_rank, cur))
                q = ga.proj(n_head * mla.n_embd_head_k_mla, q)
            else:
                q = ga.proj(n_head * mla.n_embd_head_k_mla, cur)
            q = ga.reshape(q, mla.n_embd_head_k_mla, n_head, n)
            kv_cmpr_pe = ga.proj(kv_w, cur)
            rb = kv_cmpr_pe.nb[1]
            kv_cmpr = ga.view(kv_cmpr_pe, (mla.kv_lora_rank, n), (4, rb, rb * n, rb * n))
            k_pe = ga.view(kv_cmpr_pe, (mla.n_rot, 1, n), (4, rb, rb, rb * n), offs=4 * mla.kv_lora_rank)
            k_pe = ga.unary_like("rope", k_pe, pos)
            kv_cmpr = self.norm(kv_cmpr)
            q_nope = ga.view(q, (nope, n_head, n), (4, q.nb[1], q.nb[2], q.nb[3]))
            q_pe = ga.view(q, (mla.n_rot, n_head, n), (4, q.nb[1], q.nb[2], q.nb[3]), offs=4 * nope)
            q_pe = ga.unary_like("rope", q_pe, pos)
            q_nope = ga.permute(q_nope, (0, 2, 1, 3))
            q_abs = ga.proj(mla.kv_lora_rank, q_nope)  # wk_b
            q_abs = ga.permute(q_abs, (0, 2, 1, 3))
            qcur = ga.Tensor("f32", (q_abs.ne[0] + q_pe.ne[0], n_head, n), "concat", (q_abs, q_pe))
            kv_cmpr = ga.reshape(kv_cmpr, mla.kv_lora_rank, 1, n)
            kcur = ga.Tensor("f32", (kv_cmpr.ne[0] + k_pe.ne[0], 1, n), "concat", (kv_cmpr, k_pe))
            cur = self.attn_mla(inp, qcur, kcur, kv_cmpr, n_head)
            if il == len(s.layers) - 1:
                cur = ga.get_rows(cur, out_ids)
                inpSA = ga.get_rows(inpSA, out_ids)
            ffn_inp = ga.unary_like("add", cur, inpSA)
            cur = self.norm(ffn_inp)
            cur = self.moe_ffn(cur) if is_moe else self.ffn(cur, s.n_ff)
            inpL = ga.unary_like("add", cur, ffn_inp)
        cur = self.norm(inpL)
        cur.flags |= ga.OUTPUT  # res->t_embd
        cur = ga.proj(s.n_vocab, cur)
        cur.flags |= ga.OUTPUT  # res->t_logits
        g.expand(cur)
        return g

    def build_dense(self) -> ga.Graph:
        """The llama / qwen2 / qwen3 / gemma2 / gemma3 graph builders (``src/models/*.cpp``)."""
        s, g, n = self.shape, self.g, self.n_tokens
        gemma = archs.traits(s.arch).gemma_graph
        layers = s.layers
        inpL = self.inp_embd()
        if gemma:
            inpL = ga.unary_like("scale", inpL)
        pos = ga.new_input("i32", (n,))
        full = [l for l in layers if not l[4]]
        swa = [l for l in layers if l[4]]
        inp_full: dict[str, Any] = self.kv_inputs(self.cells_full, s.v_max) if (full or not s.iswa) else {}
        inp_swa: dict[str, Any] = self.kv_inputs(self.cells_swa, s.v_max) if s.iswa else {}
        ref = full[0] if full else layers[0]
        inp_full["k_rot"], inp_full["v_rot"] = self.rot_inputs(ref[2], ref[3])
        if s.iswa:
            inp_swa["k_rot"], inp_swa["v_rot"] = self.rot_inputs(swa[0][2], swa[0][3])
        out_ids = ga.new_input("i32", (n,))
        for il, layer in enumerate(layers):
            n_head, n_kv_h, hd, hd_v, is_swa, is_moe = layer
            inpSA = inpL
            cur = self.norm(inpL)
            q = ga.proj(n_head * hd, cur)
            if s.qkv_bias:
                q = ga.unary_like("add", q)
            k = ga.proj(n_kv_h * hd, cur)
            if s.qkv_bias:
                k = ga.unary_like("add", k)
            v = ga.proj(n_kv_h * hd_v, cur)
            if s.qkv_bias:
                v = ga.unary_like("add", v)
            q = ga.reshape(q, hd, n_head, n)
            k = ga.reshape(k, hd, n_kv_h, n)
            v = ga.reshape(v, hd_v, n_kv_h, n)
            if s.qk_norm:
                q = self.norm(q)
            q = ga.unary_like("rope", q, pos)
            if s.qk_norm:
                k = self.norm(k)
            k = ga.unary_like("rope", k, pos)
            if gemma:
                q = ga.unary_like("scale", q)
            inp = inp_swa if (s.iswa and is_swa) else inp_full
            cur = self.attn(inp, q, k, v, layer, s.v_max, s.iswa, s.attn_softcap)
            if il == len(layers) - 1:
                cur = ga.get_rows(cur, out_ids)
                inpSA = ga.get_rows(inpSA, out_ids)
            if gemma:
                cur = self.norm(cur)
            ffn_inp = ga.unary_like("add", cur, inpSA)
            cur = self.norm(ffn_inp)
            cur = self.moe_ffn(cur) if is_moe else self.ffn(cur, s.n_ff)
            if gemma:
                cur = self.norm(cur)
            cur = ga.unary_like("add", cur, ffn_inp)
            inpL = cur
        cur = self.norm(inpL)
        cur.flags |= ga.OUTPUT  # res->t_embd (llm_graph_result::set_outputs)
        cur = ga.proj(s.n_vocab, cur)
        if s.final_softcap:
            cur = ga.unary_like("scale", cur)
            cur = ga.unary_like("unary", cur)
            cur = ga.unary_like("scale", cur)
        cur.flags |= ga.OUTPUT  # res->t_logits
        g.expand(cur)
        return g


def _build(shape: GraphShape, cells_full: int, cells_swa: int, n_ubatch: int, n_stream: int,
           flash: bool, type_k: str, type_v: str) -> ga.Graph:
    r = _Reserve(shape, cells_full, cells_swa, n_ubatch, n_stream, flash, type_k, type_v)
    return r.build_deepseek2() if shape.mla is not None else r.build_dense()


# KV lengths at which the graph is built to find each tensor's size as a function of the KV length:
# multiples of 256 (like every n_kv) that no model dimension equals, so layouts compare as they do in general.
_KV_A, _KV_B, _KV_C, _KV_D = 256 * 4099, 256 * 4111, 256 * 4127, 256 * 4133


@lru_cache(maxsize=512)
def _program(shape: GraphShape, n_ubatch: int, n_stream: int, flash: bool, type_k: str,
             type_v: str) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]] | None:
    """The allocator's trace for one graph structure, with every tensor's bytes as ``a*full + b*swa + c``.

    Only the KV masks and the attention scores grow with the KV length (linearly), and the allocator's
    decisions (``graph_alloc.trace``) do not depend on sizes, so one trace serves every context length:
    a new n_ctx costs a replay of ``ggml_dyn_tallocr``, not a rebuild. None when the three builds do not
    agree (the caller then builds the graph itself).
    """
    runs = []
    for full, swa in ((_KV_A, _KV_B), (_KV_C, _KV_B), (_KV_A, _KV_D)):
        tensors, events = ga.trace(_build(shape, full, swa, n_ubatch, n_stream, flash, type_k, type_v))
        runs.append(([t.nbytes for t in tensors], events))
    (s1, e1), (s2, e2), (s3, e3) = runs
    if e1 != e2 or e1 != e3:
        return None
    coeffs = []
    for x1, x2, x3 in zip(s1, s2, s3):
        a, ra = divmod(x2 - x1, _KV_C - _KV_A)
        b, rb = divmod(x3 - x1, _KV_D - _KV_B)
        if ra or rb:
            return None
        coeffs.append((a, b, x1 - a * _KV_A - b * _KV_B))
    return e1, coeffs


@lru_cache(maxsize=4096)
def _simulate(shape: GraphShape, cells_full: int, cells_swa: int, n_ubatch: int, n_stream: int,
              flash: bool, type_k: str, type_v: str) -> int:
    prog = _program(shape, n_ubatch, n_stream, flash, type_k, type_v)
    if prog is None:
        return ga.peak_bytes(_build(shape, cells_full, cells_swa, n_ubatch, n_stream, flash, type_k, type_v))
    events, coeffs = prog
    return ga.replay(events, [a * cells_full + b * cells_swa + c for a, b, c in coeffs])


def simulated_compute_bytes(spec: ModelSpec, cfg: ContextConfig, flash: bool) -> int | None:
    """The peak of ``ggml_gallocr`` over the mirrored reserve graph, or None for an architecture not mirrored."""
    shape = graph_shape(spec)
    if shape is None:
        return None
    cells = kv_cells(spec, cfg)
    n_stream = 1 if cfg.kv_unified else max(cfg.n_seq_max, 1)
    return _simulate(shape, cells.full, cells.swa, cfg.n_ubatch_effective, n_stream, flash,
                     cache_type(cfg.type_k).name, cache_type(cfg.type_v).name)
