"""Where llama.cpp puts each layer: n_gpu_layers, tensor_split and the layer map.

``assign_slots`` mirrors ``llama_model::load_tensors`` (``src/llama-model.cpp``,
llama.cpp vendored by llama-cpp-python 0.3.36): there are n_layer_all + 1
slots, the output layer last; ``n_gpu_layers = N`` offloads the last N slots;
slot ``il`` goes to the first device whose cumulative split share exceeds
``(il - i_gpu_start) / n_offloaded``, computed in float32 as llama.cpp does.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence


def _f32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


@dataclass(frozen=True)
class Placement:
    """What llama.cpp receives about devices: which GPUs, how many slots, in what proportions.

    ``gpus`` are indexes into the plan's device list, in the order llama.cpp
    sees them; ``tensor_split`` has one proportion per entry of ``gpus``.
    An empty ``gpus`` (or ``n_gpu_layers == 0``) is a CPU-only placement.
    """

    gpus: tuple[int, ...] = ()
    n_gpu_layers: int = 0
    tensor_split: tuple[float, ...] = ()
    n_cpu_moe: int = 0
    """MoE expert tensors of blocks 0..n_cpu_moe-1 pinned to host memory (``tensor_buft_overrides``,
    llama.cpp's ``--n-cpu-moe``); their attention and shared weights stay on the GPU."""

    @property
    def experts_on_host(self) -> bool:
        return self.n_cpu_moe > 0

    def expert_override_pattern(self) -> str | None:
        """The tensor_buft_overrides regex that keeps these blocks' experts in host memory."""
        if self.n_cpu_moe <= 0:
            return None
        blocks = "|".join(str(i) for i in range(self.n_cpu_moe))
        return rf"^blk\.({blocks})\.ffn_(up|down|gate)_exps"

    @property
    def cpu_only(self) -> bool:
        return not self.gpus or self.n_gpu_layers == 0

    def slots(self, n_layer_all: int) -> tuple[int | None, ...]:
        """Device (index into ``gpus``) of each slot 0..n_layer_all; the last is the output layer; None is host."""
        if self.cpu_only:
            return (None,) * (n_layer_all + 1)
        return assign_slots(n_layer_all, self.n_gpu_layers, self.tensor_split or (1.0,) * len(self.gpus))


def assign_slots(n_layer_all: int, n_gpu_layers: int, split: Sequence[float]) -> tuple[int | None, ...]:
    """llama.cpp's layer-to-device rule; returns a device position per slot, None for host."""
    return _assign_slots(n_layer_all, n_gpu_layers, tuple(float(x) for x in split))


@lru_cache(maxsize=8192)
def _assign_slots(n_layer_all: int, n_gpu_layers: int, split: tuple[float, ...]) -> tuple[int | None, ...]:
    n_dev = len(split)
    if n_dev == 0 or n_gpu_layers <= 0:
        return (None,) * (n_layer_all + 1)
    cum: list[float] = []
    total = 0.0
    for s in split:
        total = _f32(total + _f32(s))
        cum.append(total)
    if total <= 0:
        raise ValueError("tensor_split sums to zero")
    cum = [_f32(c / total) for c in cum]
    i_gpu_start = max(n_layer_all + 1 - n_gpu_layers, 0)
    act = min(n_gpu_layers, n_layer_all + 1)
    out: list[int | None] = []
    for il in range(n_layer_all + 1):
        if il < i_gpu_start or il - i_gpu_start >= act:
            out.append(None)
            continue
        frac = _f32(float(il - i_gpu_start) / act)
        out.append(min(bisect.bisect_right(cum, frac), n_dev - 1))
    return tuple(out)
