"""Per-token decode time from hits and misses: a small model others can import.

    t_token = t_dense + L * t_layer + hits * t_hit + misses * t_miss

    t_dense  = dense_bytes / gpu_mem            (attention, router, shared experts)
    t_hit    = compute_bytes / gpu_mem          (batch-1 expert matmul is memory bound)
    t_fetch  = latency + expert_bytes / h2d + t_hit      (copy over PCIe, then compute)
    t_cpu    = max(expert_bytes / cpu_mem, tokens * expert_flops / cpu_flops)
                                                (cpu_flops: ggml's quantized rate where probed)
    t_miss   = t_fetch | t_cpu | min(t_fetch, t_cpu)     (miss path fetch | cpu | auto)

Quantized experts (``compute_bytes`` > ``expert_bytes``: the dequantized expert is
larger than what is stored and moved) add a dequantization, memory bound on the
device, ``t_deq = (expert_bytes + compute_bytes) / gpu_mem`` (or ``params /
device_dequant`` where that rate is measured, e.g. a CPU standing in for the device): once per load with
``dequantized`` slots (in t_fetch), once per use with ``quantized`` slots (in t_hit);
on the host ``params / cpu_dequant`` (in t_cpu).

``hits`` and ``misses`` are per decode token, summed over layers. Assumptions
and sources are in docs/cost-model.md; bench/ checks them against measured
times.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import MISS_PATHS, SLOT_KINDS

GB = 1e9

@dataclass(frozen=True)
class Hardware:
    """Rates of one machine; bandwidths in GB/s (1e9 bytes), compute in GFLOP/s."""

    name: str
    h2d_gbps: float            # pinned host -> device copies
    gpu_mem_gbps: float        # device memory bandwidth
    cpu_mem_gbps: float        # host memory bandwidth (CPU expert matmul streams weights)
    cpu_gflops: float          # CPU matmul rate
    transfer_latency_s: float = 10e-6  # fixed cost per expert copy (launch, DMA setup)
    layer_overhead_s: float = 0.0      # fixed cost per MoE layer (launches, sync points)
    cpu_dequant_gelems: float = 0.3    # host dequantization, G weights/s (torch, one thread: 0.2-0.7)
    # device dequantization, G weights/s; None: memory bound at gpu_mem_gbps (a GPU). A CPU
    # "device" (benchmarks on the host) is compute bound: the bench measures and sets it.
    device_dequant_gelems: float | None = None
    # ggml's quantized matmul on the CPU (activations quantized to 8 bits, integer dots),
    # GFLOP/s: what a CPU miss of several tokens costs with ggml (docs/cpu.md: 2-4x below a
    # float32 BLAS matmul on the same cores). None: cpu_gflops (presets; probe measures it)
    cpu_quant_gflops: float | None = None
    # O_DIRECT reads of a model file, GB/s (host_memory='tiered': experts missing from RAM);
    # None: not measured ('expertcache probe --disk FILE' measures it)
    disk_gbps: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        for field in ("h2d_gbps", "gpu_mem_gbps", "cpu_mem_gbps", "cpu_gflops", "cpu_dequant_gelems"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"hardware {self.name!r}: {field} must be a positive number, "
                                 f"got {value!r}")
        disk = self.disk_gbps
        if disk is not None and (isinstance(disk, bool) or not isinstance(disk, (int, float)) or disk <= 0):
            raise ValueError(f"hardware {self.name!r}: disk_gbps must be a positive number or null, got {disk!r}")
        rate = self.cpu_quant_gflops
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate <= 0):
            raise ValueError(f"hardware {self.name!r}: cpu_quant_gflops must be a positive number or "
                             f"null, got {rate!r}")
        for field in ("transfer_latency_s", "layer_overhead_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"hardware {self.name!r}: {field} must not be negative")


@dataclass(frozen=True)
class ExpertCost:
    """The model side: bytes and FLOPs of one expert for one token."""

    expert_bytes: int                  # stored and moved per load (quantized bytes for GGUF experts)
    expert_flops: float | None = None  # 2 x parameters; None: CPU cost from bandwidth alone
    dense_bytes: int = 0               # non-expert weights read per token
    compute_bytes: int | None = None   # the expert in the compute dtype; None: not quantized

    def __post_init__(self) -> None:
        for name in ("expert_bytes", "compute_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive whole number, got {value!r}")
        if self.compute_bytes is None:
            object.__setattr__(self, "compute_bytes", self.expert_bytes)

    @property
    def quantized(self) -> bool:
        return self.compute_bytes != self.expert_bytes

    def slot_bytes(self, slot_format: str = "dequantized") -> int:
        """Device bytes one slot takes: the stored bytes in 'quantized' slots, else the compute dtype."""
        return self.expert_bytes if slot_format == "quantized" else self.compute_bytes


def miss_times(model: ExpertCost, hw: Hardware, slot_format: str = "dequantized",
               tokens: int = 1, ggml: bool = False) -> dict[str, float]:
    """Seconds per expert for each way of serving it to ``tokens`` tokens: hit, fetch, cpu.

    ``ggml``: quantized experts on the CPU run ggml's kernels on the stored bytes (no host
    dequantization: docs/cpu.md), else torch dequantizes them first."""
    if slot_format not in SLOT_KINDS:  # what 'auto' resolves to (pool.resolve_slot_format)
        raise ValueError(f"unknown slot format {slot_format!r}; use one of {', '.join(SLOT_KINDS)}")
    gpu = hw.gpu_mem_gbps * GB
    dequant = 0.0
    if model.quantized:
        dequant = ((model.expert_bytes + model.compute_bytes) / gpu if not hw.device_dequant_gelems
                   else (model.expert_flops or 0.0) / 2 / (hw.device_dequant_gelems * 1e9))
    hit = model.compute_bytes / gpu + (dequant if slot_format == "quantized" else 0.0)
    fetch = (hw.transfer_latency_s + model.expert_bytes / (hw.h2d_gbps * GB) + hit
             + (dequant if slot_format == "dequantized" else 0.0))
    cpu = model.expert_bytes / (hw.cpu_mem_gbps * GB)
    if model.expert_flops:
        on_ggml = ggml and model.quantized and hw.cpu_quant_gflops is not None
        rate = hw.cpu_quant_gflops if on_ggml else hw.cpu_gflops
        cpu = max(cpu, tokens * model.expert_flops / (rate * 1e9))
        if model.quantized and not ggml:
            cpu += model.expert_flops / 2 / (hw.cpu_dequant_gelems * 1e9)
    return {"hit": hit, "fetch": fetch, "cpu": cpu}


def prefer_cpu(model: ExpertCost, hw: Hardware, tokens: int, slot_format: str = "dequantized",
               ggml: bool = False) -> bool:
    """The ``auto`` miss path's choice for one missed expert routed ``tokens`` tokens."""
    t = miss_times(model, hw, slot_format, tokens, ggml)
    return t["cpu"] < t["fetch"]


def token_time(hits: float, misses: float, model: ExpertCost, hw: Hardware, *,
               layers: int = 0, miss_path: str = "auto", slot_format: str = "dequantized",
               ggml: bool = False) -> float:
    """Seconds per decode token given ``hits`` and ``misses`` per token (all layers)."""
    if miss_path not in MISS_PATHS:
        raise ValueError(f"unknown miss path {miss_path!r}; use one of {', '.join(MISS_PATHS)}")
    t = miss_times(model, hw, slot_format, ggml=ggml)
    t_miss = min(t["fetch"], t["cpu"]) if miss_path == "auto" else t[miss_path]
    dense = model.dense_bytes / (hw.gpu_mem_gbps * GB)
    return dense + layers * hw.layer_overhead_s + hits * t["hit"] + misses * t_miss


def tokens_per_second(hits: float, misses: float, model: ExpertCost, hw: Hardware, *,
                      layers: int = 0, miss_path: str = "auto", slot_format: str = "dequantized",
                      ggml: bool = False) -> float:
    return 1.0 / token_time(hits, misses, model, hw, layers=layers, miss_path=miss_path,
                            slot_format=slot_format, ggml=ggml)


def chosen_path(model: ExpertCost, hw: Hardware, miss_path: str = "auto",
                slot_format: str = "dequantized") -> str:
    """'fetch' or 'cpu': how misses are served (``auto`` takes the cheaper per expert)."""
    if miss_path != "auto":
        return miss_path
    t = miss_times(model, hw, slot_format)
    return "fetch" if t["fetch"] <= t["cpu"] else "cpu"


def bytes_moved(misses: int, loads: int, expert_bytes: int | None,
                path: str = "fetch") -> int | None:
    """Host -> GPU expert bytes; None when the expert size is unknown.

    Fetch path: every miss crosses PCIe once (loads and bypasses alike). CPU
    path: misses are computed on the host; only admitted keys (loads) are copied
    in, off the critical path. Activations are not counted.
    """
    if expert_bytes is None:
        return None
    return (misses if path == "fetch" else loads) * expert_bytes


def file_read_time(file_reads: float, model: ExpertCost, hw: Hardware) -> float:
    """Seconds per token the RAM tier spends reading ``file_reads`` experts per token from the file
    (host_memory='tiered': the reads of a step finish before the step computes)."""
    if hw.disk_gbps is None:
        raise ValueError(f"hardware {hw.name!r} has no disk_gbps: measure it with 'expertcache probe "
                         "--disk MODEL_FILE -o profile.json' (or give plan --disk-gbps)")
    return file_reads * model.expert_bytes / (hw.disk_gbps * GB)
