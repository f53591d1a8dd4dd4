"""Predicted generation speed of a placement, from bytes read per token and each tier's bandwidth.

Decoding one token reads every weight it uses once (all of a dense model;
the shared tensors and ``n_expert_used / n_expert`` of the experts of a MoE)
plus the KV cache; each tier streams its share at its bandwidth, one after
the other (layers run in order). Prompt processing is compute-bound on the
GPU, plus, for layers left on the host, the ``op_offload`` copy of their
weights over PCIe once per ubatch. These are models for ranking placements,
checked on real hardware by ``bench/offload_gpu.py``; the service reports
measured speeds beside them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


class PlanRequestLike(Protocol):
    @property
    def host_bandwidth_bytes_per_s(self) -> float: ...

    @property
    def disk_bandwidth_bytes_per_s(self) -> float: ...

    @property
    def cpu_cores(self) -> int: ...

    @property
    def cpu_flops_per_core(self) -> float | None: ...

GB = 1e9

# Memory bandwidth by GPU name (vendor figures, bytes/s); matched by substring, longest first.
GPU_BANDWIDTH: dict[str, float] = {
    "H200": 4800 * GB, "H100": 3350 * GB, "A100": 2039 * GB, "L40S": 864 * GB, "L40": 864 * GB,
    "A6000": 768 * GB, "A5000": 768 * GB, "A4000": 448 * GB, "L4": 300 * GB, "T4": 320 * GB, "V100": 900 * GB,
    "RTX 5090": 1792 * GB, "RTX 5080": 960 * GB, "RTX 4090": 1008 * GB, "RTX 4080": 717 * GB,
    "RTX 4070 Ti": 504 * GB, "RTX 4070": 504 * GB, "RTX 4060 Ti": 288 * GB, "RTX 4060": 272 * GB,
    "RTX 3090 Ti": 1008 * GB, "RTX 3090": 936 * GB, "RTX 3080 Ti": 912 * GB, "RTX 3080 Laptop": 448 * GB,
    "RTX 3080": 760 * GB, "RTX 3070": 448 * GB, "RTX 3060 Ti": 448 * GB, "RTX 3060": 360 * GB,
    "RTX 2080 Ti": 616 * GB, "RTX 2080": 448 * GB, "RTX 2070": 448 * GB, "RTX 2060": 336 * GB,
}
DEFAULT_GPU_BANDWIDTH = 450 * GB
DEFAULT_GPU_FLOPS = 40e12
"""Effective dense FLOP/s for prompt processing when the card is not known."""


CPU_FLOPS_PER_CORE = 15e9
"""Decode (matrix-vector) FLOP/s per core where none was measured: ~25-30 GFLOP/s for gemma-3-270m Q4_K_M on the
2 cores of the AMX host; the AVX2 EPYC host measured 31.5 per core (``service.engine.cpu_speed``, which the service
and its workers measure once per machine)."""
CPU_GEMM_FLOPS_PER_CORE = 60e9
"""Prompt (matrix-matrix) FLOP/s per core: ~130 GFLOP/s measured on the same 2 cores."""


@dataclass(frozen=True)
class Tiers:
    """Bandwidths of the memory tiers a token's weights are read from, bytes/s."""

    gpu: float = DEFAULT_GPU_BANDWIDTH
    host: float = 40 * GB
    disk: float = 2 * GB
    pcie: float = 25 * GB
    gpu_flops: float = DEFAULT_GPU_FLOPS
    cpu_flops: float = 8 * CPU_FLOPS_PER_CORE
    """Effective CPU FLOP/s decoding (quantized matrix-vector products)."""
    cpu_gemm_flops: float = 8 * CPU_GEMM_FLOPS_PER_CORE
    """Effective CPU FLOP/s evaluating a prompt (matrix-matrix)."""
    token_overhead_s: float = 0.002
    """Fixed cost per decoded token: graph build and launch, sampling over the vocabulary."""

    @classmethod
    def for_request(cls, req: "PlanRequestLike") -> "Tiers":
        """The tiers a plan request describes (bandwidths measured or configured, the machine's cores)."""
        return cls(
            host=req.host_bandwidth_bytes_per_s,
            disk=req.disk_bandwidth_bytes_per_s,
            cpu_flops=req.cpu_cores * (req.cpu_flops_per_core or CPU_FLOPS_PER_CORE),
            cpu_gemm_flops=req.cpu_cores * CPU_GEMM_FLOPS_PER_CORE,
        )


def gpu_bandwidth(name: str, declared: float | None = None) -> float:
    """A card's memory bandwidth: declared, else from the table by name, else a middling default."""
    if declared:
        return declared
    for key in sorted(GPU_BANDWIDTH, key=len, reverse=True):
        if key.lower() in name.lower():
            return GPU_BANDWIDTH[key]
    return DEFAULT_GPU_BANDWIDTH


@dataclass(frozen=True)
class TokenBytes:
    """Bytes one decoded token reads from each tier."""

    gpu: int
    host: int
    disk: int


def prompt_tokens_per_s(active_params: float, gpu_share: float, host_weight_bytes: int, n_ubatch: int,
                        t: Tiers, op_offload: bool = True, workers: Sequence[tuple[float, float]] = ()) -> float:
    """Prompt tokens/s: GPU compute for the offloaded share; host layers computed on the GPU after a PCIe copy
    (op_offload) or on the CPU; ``workers``: the shares ggml-rpc workers' CPUs compute, each with its matrix-matrix
    FLOP/s."""
    flops_per_token = 2.0 * active_params
    gpu_s = flops_per_token * n_ubatch * gpu_share / t.gpu_flops
    worker_s = sum(flops_per_token * n_ubatch * share / flops for share, flops in workers)
    host_share = max(1.0 - gpu_share - sum(share for share, _ in workers), 0.0)
    if host_share > 0:
        if op_offload:
            host_s = host_weight_bytes / t.pcie + flops_per_token * n_ubatch * host_share / t.gpu_flops
        else:
            host_s = flops_per_token * n_ubatch * host_share / t.cpu_gemm_flops
    else:
        host_s = 0.0
    total = gpu_s + worker_s + host_s
    return n_ubatch / total if total > 0 else float("inf")


RPC_TOKEN_OVERHEAD_S = 2.0e-3
"""What each ggml-rpc worker a token crosses costs beyond the network's round trips: the graph sent and run on the
worker's side each token (``GRAPH_COMPUTE``), measured by ``bench/rpc_bench.py`` (the embedded model over one
worker on loopback: 2.0 ms a token more than on the host, 2026-12-06)."""
RPC_ROUND_TRIPS_PER_TOKEN = 1
"""Round trips of its link a decoded token waits for, per worker it crosses: ggml-rpc's dispatcher sends the
inputs (``SET_TENSOR``) and the graph (``GRAPH_RECOMPUTE``) without waiting for an answer (``send_async`` of
ggml-rpc.cpp, ``ggml_backend_rpc_set_tensor_async``, ``ggml_backend_rpc_graph_compute``) and waits once, for the
result (``GET_TENSOR``: the next device's input through the host, ``ggml_backend_tensor_copy``, or the logits).
It was 2 (activations in, results out, each waited for)."""


def rpc_token_s(link_latency_s: float, link_bytes: int = 0, link_bandwidth_bytes_per_s: float | None = None
                ) -> float:
    """What one ggml-rpc worker a decoded token crosses adds to it beyond the memory it reads: its link's round trips
    (``link_latency_s`` each, the worker's ``Device.link_latency_s``), the bytes the token sends it and reads back
    (``link_bytes``: the input and the result; the logits, ``n_vocab`` floats, from the worker holding the output) at
    its link's transfer rate where measured, and ggml-rpc's own cost."""
    transfer_s = link_bytes / link_bandwidth_bytes_per_s if link_bandwidth_bytes_per_s else 0.0
    return RPC_ROUND_TRIPS_PER_TOKEN * link_latency_s + transfer_s + RPC_TOKEN_OVERHEAD_S


def rpc_link_bytes(n_embd: int, n_vocab: int, holds_output: bool) -> int:
    """Bytes a decoded token moves over one worker's link: its input, the hidden state (F32), in, and its result out:
    the hidden state again, or the logits (F32, ``n_vocab``) where the worker holds the output layer
    (``llama_context::decode`` reads them back, ``ggml_backend_tensor_get_async``)."""
    return 4 * n_embd + 4 * (n_vocab if holds_output else n_embd)
