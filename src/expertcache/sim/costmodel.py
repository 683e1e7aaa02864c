"""Per-token decode time from hits and misses: a small model others can import.

    t_token = t_dense + L * t_layer + hits * t_hit + misses * t_miss

    t_dense  = dense_bytes / gpu_mem            (attention, router, shared experts)
    t_hit    = expert_bytes / gpu_mem           (batch-1 expert matmul is memory bound)
    t_fetch  = latency + expert_bytes / h2d + t_hit      (copy over PCIe, then compute)
    t_cpu    = max(expert_bytes / cpu_mem, expert_flops / cpu_flops)
    t_miss   = t_fetch | t_cpu | min(t_fetch, t_cpu)     (miss path fetch | cpu | auto)

``hits`` and ``misses`` are per decode token, summed over layers. Assumptions
and sources are in docs/cost-model.md; bench/ checks them against measured
times.
"""

from __future__ import annotations

from dataclasses import dataclass

MISS_PATHS = ("auto", "fetch", "cpu")
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
    source: str = ""

    def __post_init__(self) -> None:
        for field in ("h2d_gbps", "gpu_mem_gbps", "cpu_mem_gbps", "cpu_gflops"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"hardware {self.name!r}: {field} must be a positive number, "
                                 f"got {value!r}")
        for field in ("transfer_latency_s", "layer_overhead_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"hardware {self.name!r}: {field} must not be negative")


@dataclass(frozen=True)
class ExpertCost:
    """The model side: bytes and FLOPs of one expert for one token."""

    expert_bytes: int
    expert_flops: float | None = None  # 2 x parameters; None: CPU cost from bandwidth alone
    dense_bytes: int = 0               # non-expert weights read per token

    def __post_init__(self) -> None:
        if not isinstance(self.expert_bytes, int) or self.expert_bytes < 1:
            raise ValueError(f"expert_bytes must be a positive whole number, got {self.expert_bytes!r}")


def miss_times(model: ExpertCost, hw: Hardware) -> dict[str, float]:
    """Seconds per expert for each way of serving it: hit, fetch, cpu."""
    hit = model.expert_bytes / (hw.gpu_mem_gbps * GB)
    fetch = hw.transfer_latency_s + model.expert_bytes / (hw.h2d_gbps * GB) + hit
    cpu = model.expert_bytes / (hw.cpu_mem_gbps * GB)
    if model.expert_flops:
        cpu = max(cpu, model.expert_flops / (hw.cpu_gflops * 1e9))
    return {"hit": hit, "fetch": fetch, "cpu": cpu}


def token_time(hits: float, misses: float, model: ExpertCost, hw: Hardware, *,
               layers: int = 0, miss_path: str = "auto") -> float:
    """Seconds per decode token given ``hits`` and ``misses`` per token (all layers)."""
    if miss_path not in MISS_PATHS:
        raise ValueError(f"unknown miss path {miss_path!r}; use one of {', '.join(MISS_PATHS)}")
    t = miss_times(model, hw)
    t_miss = min(t["fetch"], t["cpu"]) if miss_path == "auto" else t[miss_path]
    dense = model.dense_bytes / (hw.gpu_mem_gbps * GB)
    return dense + layers * hw.layer_overhead_s + hits * t["hit"] + misses * t_miss


def tokens_per_second(hits: float, misses: float, model: ExpertCost, hw: Hardware, *,
                      layers: int = 0, miss_path: str = "auto") -> float:
    return 1.0 / token_time(hits, misses, model, hw, layers=layers, miss_path=miss_path)


def chosen_path(model: ExpertCost, hw: Hardware, miss_path: str = "auto") -> str:
    """'fetch' or 'cpu': how misses are served (``auto`` takes the cheaper per expert)."""
    if miss_path != "auto":
        return miss_path
    t = miss_times(model, hw)
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
