"""ExpertCache: what ``model.expertcache`` is. Owns the SlotTable, the host experts and
the slot pool of one offloaded model, sizes the pool, and keeps the live counters."""

from __future__ import annotations

import torch

from ..cache import SlotTable
from ..config import CacheConfig
from ..costmodel import (DEFAULT, PRESETS, ExpertCost, Hardware, PoolSizing, prefer_cpu, resolve_slot_format,
                         staging_slots)
from ..costmodel.pool import cap_slots
from ..imatrix.apply import place
from ..quant.ggml import choose
from ..sizes import format_size
from ..stats import DECODE, PREFILL
from .cpudense import report_of
from .cpukernel import GgmlExperts
from .device import free_memory
from .graphs import DecodeGraphs
from .host import HostExperts
from .slots import SlotPool
from .stats import LiveStats


class ExpertCache:
    """``config`` is validated already (``CacheConfig``); ``counts``: imatrix counts, read once."""

    def __init__(self, config: CacheConfig, hosts: list[HostExperts], top_k: int,
                 device: torch.device, hardware: Hardware | None = None, counts=None) -> None:
        self.config = config
        run = config.effective()  # baselines resolved into plain settings
        self.hosts, self.top_k, self.device = hosts, top_k, torch.device(device)
        # host_memory='tiered': the RAM tier all layers share (runtime/tiered.py)
        self.tier = hosts[0].store if getattr(hosts[0], "tiered", False) else None
        self.num_layers, self.num_experts = len(hosts), hosts[0].num_experts
        # bytes one load moves (quantized: the stored bytes; the largest layer's if types differ)
        self.expert_bytes = max(host.expert_bytes for host in hosts)
        self.codec = hosts[0].codec
        # how experts computed on the CPU do their math (ggml on the bytes, or torch), resolved once
        self.cpu_kernel, self.cpu_kernel_reason = self._cpu_kernel(config.cpu_kernel)
        self.kernels = [GgmlExperts(h.codec) for h in hosts] if self.cpu_kernel == "ggml" else None
        ggml_here = self.kernels is not None and self.device.type == "cpu"
        # the slot format, resolved once; the compute dtype came with the hosts (loaders/)
        self.slot_format = resolve_slot_format(config.slot_format, self.codec is not None, self.device.type,
                                               ggml_here)
        # ggml reads quantized CPU slots in place (no scratch); a resident run on the host then
        # needs no slots at all: every expert is computed from the host's own bytes
        self.direct = ggml_here and self.slot_format == "quantized"
        self.host_resident = self.direct and run.baseline == "resident"
        self.miss, self.hardware = run.miss, hardware or PRESETS[DEFAULT]
        self.cost = self._expert_cost(hosts[0])
        # 'host' or 'device', resolved once ('auto': device where decode is captured)
        self.planner_mode, self._planner_auto = self._planner_mode(config)
        # what the pool's slots, staging and scratch take: the same object plan sizes with
        staging, self.staging_blocks = self._staging(config, run)
        self.sizing = PoolSizing(self.cost, self.slot_format, top_k, staging, self.direct)
        slots, pool_slots, staging = self._size(run)
        self.table = SlotTable(self.num_layers, self.num_experts, slots, eviction=run.eviction,
                               admission=run.admission, partition=run.partition, top_k=top_k)
        self.pool = SlotPool(hosts[0].layout() if self.codec is None else {}, pool_slots, staging, self.device,
                             None if self.codec is None else [h.codec for h in hosts], self.slot_format,
                             self.sizing.scratch_experts)
        if self.tier is not None and self.pool.cuda:  # rows are overwritten only after their copies
            self.tier.before_write = self.pool.copy_stream.synchronize
        self.h2d = [[0] * self.num_layers for _ in range(2)]  # [phase][layer] bytes
        self.phase: int | None = None  # set per forward by the model's pre-hook
        self.model = None  # set by offload(): report() reads the model's forward clock
        # decode as one ggml graph a token (runtime/ggmlgraph.py): set when attached on the CPU
        self.cpu_graph, self.cpu_graph_reason = "off", "not a CPU run with ggml's kernels"
        if config.baseline == "resident":
            self._preload_all()
        elif counts is not None:
            self._place_imatrix(counts, config.imatrix_mode, run)
        self.planner, self.planner_reason = self._planner(config)  # after placement: the map starts full
        self.graphs = DecodeGraphs(self)  # decode replayed from captured graphs (runtime/graphs.py)

    def _staging(self, config: CacheConfig, run: CacheConfig) -> tuple[int, int]:
        """(staging rows of the pool, staging blocks of the device planner).

        The device planner's default (``staging_blocks=None``) is a block per layer, each of
        ``staging`` rows (default top-k): a layer's misses then survive until the policy's
        decisions are applied, so an admitted miss crosses once, as on the host planner
        (issue 29: one shared block made it cross twice). Without admissions (copy-every-pass)
        one shared block does."""
        if run.baseline == "resident":
            return 0, 1
        rows = staging_slots(run.miss, run.staging, self.top_k)
        if config.staging_blocks is not None:
            return rows, config.staging_blocks
        if self.planner_mode != "device" or run.admission.name == "never" or not rows:
            return rows, 1
        from .devicepath import settings_refusal
        if settings_refusal(self) is not None:  # the host planner runs: no per-layer rows
            return rows, 1
        return rows * self.num_layers, self.num_layers

    def _planner_mode(self, config: CacheConfig) -> tuple[str, str | None]:
        """('host' | 'device', why 'auto' chose it or None). 'auto' takes the device planner
        where decode will be captured in graphs (CUDA unless graphs='off'; graphs='on' on the
        CPU): capture needs it, and a captured step is where it pays."""
        if config.planner != "auto":
            return config.planner, None
        captured = config.graphs == "on" or (config.graphs == "auto" and self.device.type == "cuda")
        if not captured:
            return "host", (f"planner='auto': host, decode is not captured here (graphs={config.graphs!r} "
                            f"on {self.device.type})")
        from .devicepath import host_refusal
        refusal = host_refusal(self)
        if refusal is not None:
            return "host", f"planner='auto': host, the device step cannot run: {refusal}"
        return "device", None

    def _planner(self, config: CacheConfig):
        """(the ``DevicePlanner`` or None, why this planner): runtime/devicepath.py."""
        if self.planner_mode == "host":
            return None, self._planner_auto or "planner='host': each step's routing is read back and planned at once"
        from .devicepath import DevicePlanner, device_planner_refusal
        refusal = device_planner_refusal(self)
        if refusal is not None:
            if config.planner == "auto":
                return None, f"planner='auto': host, the device step cannot run: {refusal}"
            return None, f"planner='device' refused, host planner used: {refusal}"
        how = "planner='auto' (decode captured): device" if config.planner == "auto" else "planner='device'"
        why = f"{how}: decode steps on the device, the policy {config.lag} forward(s) behind"
        return DevicePlanner(self, config.lag, self.staging_blocks), why

    def _cpu_kernel(self, choice: str) -> tuple[str, str]:
        if self.codec is None:
            return "torch", "float experts: torch matmuls on their own weights"
        return choose(choice, [p.fmt for h in self.hosts for p in h.codec.parts])

    def _expert_cost(self, host: HostExperts) -> ExpertCost:
        if self.codec is None:
            params = sum(t[0].numel() for t in host.tensors.values())
            return ExpertCost(self.expert_bytes, 2.0 * params)
        return ExpertCost(self.expert_bytes, 2.0 * self.codec.params, compute_bytes=self.codec.compute_bytes)

    # -- sizing -----------------------------------------------------------------
    def _size(self, run: CacheConfig) -> tuple[int, int, int]:
        """(table slots, pool cache slots, staging slots) for this configuration."""
        L, E, k, sizing = self.num_layers, self.num_experts, self.top_k, self.sizing
        staging = sizing.staging
        if self.host_resident:  # the host bytes are the slots: nothing to allocate
            return L * E, 0, 0
        if run.baseline == "resident":
            self._refuse_resident_over_tier()
            self._check_free(sizing.device_bytes(L * E), "baseline 'resident' (every expert on the device)")
            return L * E, L * E, 0
        if run.admission.name == "never":  # nothing is ever cached (baselines cpu, copy-every-pass):
            # the table only counts accesses; the pool keeps just the staging slots
            self._check_free(sizing.device_bytes(0), f"{staging} staging slots")
            return (k * L if run.partition == "per-layer" else k), 0, staging
        slots = cap_slots(run.slots if run.gpu_memory is None else self._slots_in_budget(run), L, E, run.partition)
        self._check_free(sizing.device_bytes(slots), f"a pool of {slots}+{staging} slots")
        return slots, slots, staging

    def _refuse_resident_over_tier(self) -> None:
        """On the CPU, slots are RAM: resident slots over a RAM tier would hold every expert in RAM
        (dequantized, here), past the ``host_budget`` the tier was asked to keep."""
        if self.tier is None or self.device.type != "cpu":
            return
        raise ValueError(
            f"baseline='resident' with host_memory='tiered' on the CPU computes every expert from the RAM "
            f"tier's rows with ggml's kernels, but this run has {self.slot_format} slots "
            f"(cpu_kernel {self.cpu_kernel!r}: {self.cpu_kernel_reason}): every expert would be copied into "
            f"RAM slots ({format_size(self.sizing.device_bytes(self.num_layers * self.num_experts))}), past "
            f"host_budget. Use baseline='cpu' (every expert computed from the tier's rows), or "
            f"cpu_kernel='ggml' with slot_format='auto', or give slots or gpu_memory instead")

    def _slots_in_budget(self, run: CacheConfig) -> int:
        """Cache slots that fit ``gpu_memory`` next to the staging slots and the scratch."""
        budget, k, sizing = run.gpu_memory_bytes, self.top_k, self.sizing
        self._check_free(budget, f"gpu_memory={run.gpu_memory!r}")
        slots, extra = sizing.slots_in(budget), sizing.extra_bytes
        per_layer = run.partition == "per-layer"
        need = k * (self.num_layers if per_layer else 1)
        if slots < need:
            raise ValueError(f"capacity below top-k: gpu_memory={run.gpu_memory!r} holds {max(slots, 0)} "
                             f"experts of {format_size(sizing.slot_bytes)} after {sizing.staging} staging slots"
                             f"{f' and {format_size(extra)} of scratch' if extra else ''}, "
                             f"but a step needs {k} per {'layer' if per_layer else 'pool'}; give at least "
                             f"{format_size(sizing.device_bytes(need))}")
        return slots

    def _check_free(self, nbytes: int, what: str) -> None:
        free = free_memory(self.device)
        if free is not None and nbytes > free:
            raise ValueError(f"{what} needs {format_size(nbytes)} but {self.device} has only "
                             f"{format_size(free)} free; give a smaller gpu_memory or fewer slots")

    def _preload_all(self) -> None:
        plan = self.table.seed(range(self.num_layers * self.num_experts))
        if self.host_resident:
            return  # computed from the host bytes in place
        self._setup_loads(plan.loads)

    def _setup_loads(self, loads: dict[int, int]) -> None:
        """Copy ``loads`` (key -> slot) in before the first step: setup, not counted as traffic
        (a RAM tier reads them through itself, layer by layer, and counts those reads)."""
        by_layer: dict[int, dict[int, int]] = {}
        for key, slot in loads.items():
            layer, expert = divmod(key, self.num_experts)
            by_layer.setdefault(layer, {})[expert] = slot
        for layer, slots in by_layer.items():
            host = self.hosts[layer]
            if getattr(host, "tiered", False):  # in chunks the tier can hold at once
                experts = list(slots)
                for i in range(0, len(experts), self.top_k):
                    view = host.fetch(experts[i:i + self.top_k], PREFILL)
                    for e in experts[i:i + self.top_k]:
                        self.pool.load(slots[e], view, view.rows[e])
                continue
            for expert, slot in slots.items():
                self.pool.load(slot, host, expert)
        self.pool.ready()

    def _place_imatrix(self, counts, mode: str, run: CacheConfig) -> None:
        """Pin or seed the imatrix plan (docs/imatrix.md) and copy those experts in now."""
        if run.admission.name == "never" or self.pool.slots == 0:
            raise ValueError(f"imatrix placement needs cache slots; baseline {self.config.baseline!r} "
                             "keeps none (give slots or gpu_memory without a baseline)")
        self._setup_loads(place(self.table, counts, mode).loads)

    # -- what the experts function asks -------------------------------------------
    def compute_on_cpu(self, expert: int, tokens) -> bool:
        if self.miss == "fetch":
            return False
        if self.miss == "cpu":
            return True
        return prefer_cpu(self.cost, self.hardware, tokens[expert], self.slot_format, self.kernels is not None)

    def set_phase(self, seq_len: int | None, tokens: int | None = None) -> None:
        """Before a forward: its phase from ``seq_len`` new tokens per sequence; ``tokens``: all
        of them (batch x seq_len), which decides the device planner's path."""
        self.phase = None if seq_len is None else (PREFILL if seq_len > 1 else DECODE)
        if self.planner is not None:
            self.planner.begin_forward(tokens, self.phase)

    # -- public surface -----------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        """Device memory the slot pool holds (cache and staging slots)."""
        return self.pool.slot_bytes

    def stats(self) -> LiveStats:
        mode, reason = self.host_mode
        dense = report_of(self.model)
        table, h2d, planner = self.table.stats(), self.h2d, {"planner": "host"}
        if self.planner is not None:  # counts as the device met them (lagged.py)
            table = self.planner.stats()
            h2d = [[a + b for a, b in zip(mine, dev)]
                   for mine, dev in zip(self.h2d, self.planner.h2d(self.expert_bytes))]
            p, lagged = self.planner, self.planner.lagged
            planner = {"planner": "device", "lag": lagged.lag, "staging_blocks": p.step.blocks,
                       "device_forwards": p.device_forwards, "host_forwards": p.host_forwards,
                       "pending_forwards": lagged.pending, "loads_from_staging": lagged.staging_loads,
                       "loads_from_host": lagged.host_loads}
        kernel, kernel_reason = self.expert_kernel()
        return LiveStats(table, h2d, {**planner, "expert_kernel": kernel, "expert_kernel_reason": kernel_reason,
            "slot_format": self.slot_format, "cpu_kernel": self.cpu_kernel,
            "cpu_kernel_reason": self.cpu_kernel_reason, "host_resident": self.host_resident,
            "cpu_graph": self.cpu_graph, "cpu_graph_reason": self.cpu_graph_reason,
            # the non-expert weights (a GGUF's lm_head, attention, embedding): runtime/cpudense.py
            "dense_kernel": dense.kernel, "dense_kernel_reason": dense.summary(),
            "bytes_per_slot": self.sizing.slot_bytes,
            "bytes_per_load": self.expert_bytes, "host_memory": mode, "host_memory_reason": reason,
            **({} if self.tier is None else {"tier": self.tier.stats(), "tier_summary": self.tier.summary_line()})})

    def expert_kernel(self) -> tuple[str, str]:
        """(what computes the experts on the slots, why): ``SlotPool.kernel_report``."""
        if self.direct:
            return "ggml", "ggml reads the quantized slots in place (CPU)"
        module = next((m for m in self.model.modules() if getattr(m, "_expertcache", None) is not None),
                      None) if self.model is not None else None
        return self.pool.kernel_report(module, self.hosts[0])

    def decode_counters(self) -> tuple[int, int, int, int, int, int]:
        """(hits, accesses, H2D bytes, RAM-tier hits, RAM-tier accesses, bytes read from the file) of
        decode so far: what the forward clock snapshots (the last three 0 without a tier)."""
        ram = (0, 0, 0)
        if self.tier is not None:
            tier = self.tier.table.stats().sums(DECODE)
            ram = (tier["hits"], tier["accesses"], self.tier.counts[DECODE].bytes)
        if self.planner is None:
            decode = self.table.stats().sums(DECODE)
            return decode["hits"], decode["accesses"], sum(self.h2d[DECODE]), *ram
        decode = self.planner.stats().sums(DECODE)
        return (decode["hits"], decode["accesses"],
                sum(self.h2d[DECODE]) + sum(self.planner.h2d(self.expert_bytes)[DECODE]), *ram)

    def reset_stats(self) -> None:
        self.table.reset_stats()
        if self.tier is not None:
            self.tier.reset_stats()
        if self.planner is not None:
            self.planner.reset_stats()
        self.h2d = [[0] * self.num_layers for _ in range(2)]

    def report(self):
        """The latest generation's prefill and cold / warm / steady decode speeds, hit rates and
        H2D bytes per token (what ``expertcache generate`` prints); prints as a table."""
        from .generate import report

        if self.model is None:
            raise ValueError("this cache is not attached to a model (use expertcache.offload)")
        return report(self.model)

    @property
    def host_mode(self) -> tuple[str, str]:
        """(where the host experts live: 'copy' / 'pinned' / 'mmap', why)."""
        return self.hosts[0].mode, self.hosts[0].mode_reason

    def summary(self) -> dict:
        mode, reason = self.host_mode
        kernel, kernel_reason = self.expert_kernel()
        return {"layers": self.num_layers, "experts": self.num_experts, "top_k": self.top_k,
                "slots": self.pool.slots, "staging": self.pool.staging,
                "slot_bytes": self.slot_bytes, "expert_bytes": self.expert_bytes,
                "slot_format": self.slot_format, "cpu_kernel": self.cpu_kernel,
                "cpu_kernel_reason": self.cpu_kernel_reason, "host_resident": self.host_resident,
                "cpu_graph": self.cpu_graph, "cpu_graph_reason": self.cpu_graph_reason,
                "dense_kernel": report_of(self.model).kernel,
                "expert_kernel": kernel, "expert_kernel_reason": kernel_reason,
                "scratch_bytes": self.pool.scratch_bytes,
                "bytes_per_slot": self.sizing.slot_bytes,
                "quant": None if self.codec is None else sorted({p.fmt.name for h in self.hosts
                                                                 for p in h.codec.parts}),
                "host_memory": mode, "host_memory_reason": reason,
                **({} if self.tier is None else {"tier": self.tier.stats()}),
                "hardware": self.hardware.name, "hardware_source": self.hardware.source,
                "planner": "host" if self.planner is None else "device", "planner_reason": self.planner_reason,
                "graphs": self.graphs.summary(),
                "device": str(self.device), "config": self.config.to_dict()}

    def __repr__(self) -> str:
        return (f"ExpertCache({self.num_layers} layers x {self.num_experts} experts, "
                f"{self.pool.slots} slots + {self.pool.staging} staging = {format_size(self.slot_bytes)} "
                f"({self.slot_format}) on {self.device}, {self.config.eviction}+{self.config.admission}, "
                f"miss={self.miss}, cpu_kernel={self.cpu_kernel}, host {self.host_mode[0]})")

