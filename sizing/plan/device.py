"""The ``Device`` value: a memory pool a plan can place bytes on (a GPU or host memory), and its ``Backend``.

Pure: the adapters that read ggml's device list, NVML, declared inventories and /proc/meminfo into
these values live in ``sizing.probe.devices`` (ggml's list itself is read in a child process,
``service.engine.devices``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..units import MIB, gpu_label

DeviceKind = Literal["gpu", "host", "rpc"]
GpuType = Literal["gpu", "igpu", "accel"]
"""ggml's ``enum ggml_backend_dev_type`` for a card (ggml-backend.h): a discrete GPU, an integrated one (its memory
is the host's), an accelerator."""
FreeMemory = Literal["reported", "unreported", "shared"]
"""How far a card's free memory can be trusted (``Device.free_memory``)."""


@dataclass(frozen=True)
class Backend:
    """The ggml backend a card belongs to: how llama.cpp names its devices and buffers, and what it can report.

    Read from ggml's device API (``sizing.probe.devices.ggml_devices``); CUDA's for a card that NVML or a declared
    inventory lists, as every card was before ggml's list was read."""

    prefix: str = "CUDA"
    """ggml's name for the backend's devices less their number (``ggml_backend_dev_name``): ``CUDA``, ``ROCm``
    (ggml-cuda built for HIP), ``MUSA``, ``Vulkan``, ``SYCL``, ``MTL`` (Metal), ``CANN``..."""
    reports_free: bool = True
    """Whether ggml's free figure for the device is a measurement: CUDA's ``cudaMemGetInfo``, Vulkan's heap budget
    where the driver has ``VK_EXT_memory_budget``. Without it ggml-vulkan reports each heap's size as free for ever
    (``ggml_backend_vk_get_device_memory``), whatever is allocated there."""
    host_buffer: str = "CUDA_Host"
    """The pinned host buffer type llama.cpp puts the output and the host's compute copies in for this backend
    (``ggml_backend_dev_host_buffer_type``'s name: ``CUDA_Host``, ``Vulkan_Host``); empty where it has none."""


CUDA = Backend()
"""The backend of a card NVML or a declared inventory lists."""


@dataclass(frozen=True)
class Device:
    """A memory pool a plan can place bytes on."""

    index: int
    name: str
    free_bytes: int
    total_bytes: int
    kind: DeviceKind = "gpu"
    bandwidth_bytes_per_s: float | None = None
    endpoint: str | None = None
    """A worker's device (``kind`` ``rpc``): the worker's ``host:port``; ``index`` is llama.cpp's place for it among
    the workers' devices (they come before the local cards), ``name`` its buffer name (``RPC0[host:port]``)."""
    remote_kind: str = ""
    """A worker's device: what it is on its machine (``cpu``, ``gpu``), as its ``/status`` says."""
    link_latency_s: float = 0.0
    """A worker's device: the network's round trip to its worker (``service.rpc.client.round_trip_s``); a decoded
    token waits for one per worker it crosses (the result read back; the inputs and the graph are sent without
    waiting), and for ``sizing.plan.speed.RPC_TOKEN_OVERHEAD_S``, on top of the memory it reads
    (``sizing.plan.speed.rpc_token_s``)."""
    link_bandwidth_bytes_per_s: float | None = None
    """A worker's device: the transfer rate of the link to its worker (``service.rpc.client.link_bandwidth``); what a
    decoded token's results cross it with (a worker's output, the logits on the last one), on top of its round trip;
    None: not measured, not counted."""
    cpu_threads: int = 0
    """A worker's CPU device: the threads its graphs run on (its ``/status``); its share of a token is computed at
    the CPU's speed per thread, as the host's is (0: not reported, only its memory bandwidth counts)."""
    cpu_flops_per_core: float | None = None
    """A worker's CPU device: its decode FLOP/s per thread, as it measured them (its ``/status``); None:
    ``sizing.plan.speed.CPU_FLOPS_PER_CORE``."""
    backend: Backend = CUDA
    """A card's ggml backend (its label's prefix, whether it reports free memory, its host buffer)."""
    ordinal: int | None = None
    """The number in the card's ggml name (``Vulkan1``): its backend's own count, which differs from ``index``
    (llama.cpp's position for it among the devices it uses) where llama.cpp skips a device (the same GPU through
    two backends) or a build has two GPU backends; None: ``index``."""
    gpu_type: GpuType = "gpu"
    device_id: str = ""
    """The PCI bus id ggml reports for the card (``ggml_backend_dev_props.device_id``, ``0000:c1:00.0``); NVML's
    figures for an NVIDIA card are matched to ggml's CUDA device by it. Empty: not reported (lavapipe)."""
    free_margin_bytes: int = 0
    """Where the backend cannot report free memory: the margin taken off the card's total for what this server
    cannot see there (other processes, the driver; ``sizing.probe.devices.unreported_free``)."""
    alignment_bytes: int = 0
    """The card's buffer alignment (``ggml_backend_buft_get_alignment``); 0: not read (NVML, declared)."""
    max_buffer_bytes: int = 0
    """The largest single buffer the card's backend allocates (``ggml_backend_buft_get_max_size``); 0: not read."""
    max_tensor_bytes: int = 0
    """The largest tensor the card's backend runs an op on (``ggml_backend_dev_supports_op``'s answer, read in the
    device child: ggml-vulkan's ``maxStorageBufferRange``, 128 MiB on lavapipe); a weight whose op needs more stays
    in host memory (``sizing.memory.gpu.vulkan_refuses``). 0: not read, or no limit."""

    @property
    def free_mib(self) -> float:
        return self.free_bytes / MIB

    @property
    def total_mib(self) -> float:
        return self.total_bytes / MIB

    @property
    def label(self) -> str:
        """llama.cpp's backend name for the device (CUDA0, Vulkan0, ..., a worker's ``RPC0[host:port]``) or ``CPU``
        for host memory."""
        if self.kind == "rpc":
            return self.name
        if self.kind == "host":
            return "CPU"
        return gpu_label(self.index if self.ordinal is None else self.ordinal, self.backend.prefix)

    @property
    def free_memory(self) -> FreeMemory:
        """``reported``: its free figure is measured now (NVML, ggml's); ``unreported``: its backend gives only its
        total, so the plan takes the total less ``free_margin_bytes`` less what this server's models hold there;
        ``shared``: an integrated GPU, whose memory is the host's."""
        if self.kind != "gpu":
            return "reported"
        if self.gpu_type == "igpu":
            return "shared"
        return "reported" if self.backend.reports_free else "unreported"


def free_memory_note(dev: Device) -> str:
    """What a plan says about a card whose free memory it could not read (empty where it could): where the figure
    it planned on comes from."""
    if dev.free_memory == "unreported":
        return (f"{dev.label} ({dev.name}) does not report its free memory (ggml's {dev.backend.prefix} backend gives "
                f"its total, {dev.total_bytes / MIB:.0f} MiB, as free: for Vulkan, a driver without "
                f"VK_EXT_memory_budget): planned on that total less a {dev.free_margin_bytes / MIB:.0f} MiB margin "
                "(GGUF_UNREPORTED_FREE_MARGIN_PCT) and less what this server's models hold there; what other "
                "processes hold there is not seen")
    if dev.free_memory == "shared":
        return (f"{dev.label} ({dev.name}) is an integrated GPU: its memory is the host's, and what a plan puts there "
                "leaves the host too")
    return ""
