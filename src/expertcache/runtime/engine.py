"""ExpertCache: what ``model.expertcache`` is. Owns the SlotTable, the host experts and
the slot pool of one offloaded model, sizes the pool, and keeps the live counters."""

from __future__ import annotations

import torch

from ..cache import SlotTable
from ..config import CacheConfig
from ..stats import DECODE, PREFILL
from .host import HostExperts
from .miss import CostModel
from .sizes import format_size
from .slots import SlotPool
from .stats import LiveStats


class ExpertCache:
    def __init__(self, config: CacheConfig, hosts: list[HostExperts], top_k: int,
                 device: torch.device, cost: CostModel | None = None) -> None:
        self.config = config
        run = config.effective()  # baselines resolved into plain settings
        self.hosts, self.top_k, self.device = hosts, top_k, torch.device(device)
        self.num_layers, self.num_experts = len(hosts), hosts[0].num_experts
        self.expert_bytes = hosts[0].expert_bytes
        self.miss, self.cost = run.miss, cost or CostModel()
        self._params = sum(t[0].numel() for t in hosts[0].tensors.values())
        slots, pool_slots, staging = self._size(run)
        self.table = SlotTable(self.num_layers, self.num_experts, slots, eviction=run.eviction,
                               admission=run.admission, partition=run.partition, top_k=top_k,
                               eviction_params=run.eviction_params,
                               admission_params=run.admission_params)
        self.pool = SlotPool(hosts[0].layout(), pool_slots, staging, self.device)
        self.h2d = [[0] * self.num_layers for _ in range(2)]  # [phase][layer] bytes
        self.phase: int | None = None  # set per forward by the model's pre-hook
        self.model = None  # set by offload(): report() reads the model's forward clock
        if config.baseline == "resident":
            self._preload_all()
        elif config.imatrix is not None:
            self._place_imatrix(config.imatrix, config.imatrix_mode, run)

    # -- sizing -----------------------------------------------------------------
    def _size(self, run: CacheConfig) -> tuple[int, int, int]:
        """(table slots, pool cache slots, staging slots) for this configuration."""
        L, E, k = self.num_layers, self.num_experts, self.top_k
        if run.baseline == "resident":
            self._check_free(L * E * self.expert_bytes, "baseline 'resident' (every expert on the device)")
            return L * E, L * E, 0
        staging = 0 if run.miss == "cpu" else (run.staging or k)
        if run.admission == "never":  # nothing is ever cached (baselines cpu, copy-every-pass):
            # the table only counts accesses; the pool keeps just the staging slots
            self._check_free(staging * self.expert_bytes, f"{staging} staging slots")
            return (k * L if run.partition == "per-layer" else k), 0, staging
        if run.slots is None and run.gpu_memory is None:
            raise ValueError("the cache needs a size: give slots=N or gpu_memory='8GiB' "
                             "(or baseline='resident' / 'cpu')")
        slots = run.slots if run.gpu_memory is None else self._slots_in_budget(run, staging)
        slots = min(slots, L * E)  # more slots than experts would only waste memory
        if run.partition == "per-layer":
            slots = min(slots // L, E) * L or slots  # whole slots per layer; the table checks the rest
        self._check_free((slots + staging) * self.expert_bytes, f"a pool of {slots}+{staging} slots")
        return slots, slots, staging

    def _slots_in_budget(self, run: CacheConfig, staging: int) -> int:
        """Cache slots that fit ``gpu_memory`` next to the staging slots."""
        budget, k = run.gpu_memory_bytes, self.top_k
        self._check_free(budget, f"gpu_memory={run.gpu_memory!r}")
        slots = budget // self.expert_bytes - staging
        per_layer = run.partition == "per-layer"
        need = k * (self.num_layers if per_layer else 1)
        if slots < need:
            raise ValueError(f"capacity below top-k: gpu_memory={run.gpu_memory!r} holds {max(slots, 0)} "
                             f"experts of {format_size(self.expert_bytes)} after {staging} staging slots, "
                             f"but a step needs {k} per {'layer' if per_layer else 'pool'}; give at least "
                             f"{format_size((need + staging) * self.expert_bytes)}")
        return slots

    def _check_free(self, nbytes: int, what: str) -> None:
        free = free_memory(self.device)
        if free is not None and nbytes > free:
            raise ValueError(f"{what} needs {format_size(nbytes)} but {self.device} has only "
                             f"{format_size(free)} free; give a smaller gpu_memory or fewer slots")

    def _preload_all(self) -> None:
        plan = self.table.seed(range(self.num_layers * self.num_experts))
        for key, slot in plan.loads.items():
            layer, expert = divmod(key, self.num_experts)
            self.pool.load(slot, self.hosts[layer], expert)  # setup, not counted as traffic
        self.pool.ready()

    def _place_imatrix(self, source, mode: str, run: CacheConfig) -> None:
        """Pin or seed the imatrix plan (docs/imatrix.md) and copy those experts in now."""
        if run.admission == "never" or self.pool.slots == 0:
            raise ValueError(f"imatrix placement needs cache slots; baseline {self.config.baseline!r} "
                             "keeps none (give slots or gpu_memory without a baseline)")
        from ..imatrix import place

        for key, slot in place(self.table, source, mode).loads.items():
            layer, expert = divmod(key, self.num_experts)
            self.pool.load(slot, self.hosts[layer], expert)  # setup, not counted as traffic
        self.pool.ready()

    # -- what the experts function asks -------------------------------------------
    def compute_on_cpu(self, expert: int, tokens) -> bool:
        if self.miss == "fetch":
            return False
        if self.miss == "cpu":
            return True
        return self.cost.prefer_cpu(self.expert_bytes, self._params, tokens[expert])

    def set_phase(self, seq_len: int | None) -> None:
        self.phase = None if seq_len is None else (PREFILL if seq_len > 1 else DECODE)

    # -- public surface -----------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        """Device memory the slot pool holds (cache and staging slots)."""
        return self.pool.slot_bytes

    def stats(self) -> LiveStats:
        return LiveStats(self.table.stats(), self.h2d)

    def reset_stats(self) -> None:
        self.table.reset_stats()
        self.h2d = [[0] * self.num_layers for _ in range(2)]

    def report(self):
        """The latest generation's prefill and cold / warm / steady decode speeds, hit rates and
        H2D bytes per token (what ``expertcache generate`` prints); prints as a table."""
        from .generate import report

        if self.model is None:
            raise ValueError("this cache is not attached to a model (use expertcache.offload)")
        return report(self.model)

    def summary(self) -> dict:
        return {"layers": self.num_layers, "experts": self.num_experts, "top_k": self.top_k,
                "slots": self.pool.slots, "staging": self.pool.staging,
                "slot_bytes": self.slot_bytes, "expert_bytes": self.expert_bytes,
                "device": str(self.device), "config": self.config.to_dict()}

    def __repr__(self) -> str:
        return (f"ExpertCache({self.num_layers} layers x {self.num_experts} experts, "
                f"{self.pool.slots} slots + {self.pool.staging} staging = {format_size(self.slot_bytes)} "
                f"on {self.device}, {self.config.eviction}+{self.config.admission}, miss={self.miss})")


def free_memory(device: torch.device) -> int | None:
    """Free bytes on the device (host: MemAvailable); None when it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None
