"""One cached model in one vLLM process: its layers, SlotTable, slot pool and counters.

Layers join in construction order (that order is the MoE layer index). The pool is
made when the first layer's weights are loaded and repacked (its shape is known then);
the table when the first counted step runs (every layer has joined by then), or with
``planner: device`` when the last layer is loaded (device.DevicePlanner). Warm-up,
profile and compile steps (vLLM builds no attention metadata for them) never reach the
table: they compute on whatever the slots hold and their output is discarded.
"""

from __future__ import annotations

import atexit

import torch

from ..cache import SlotTable
from ..runtime.stats import LiveStats
from .pool import HostExperts, SlotPool, check_pool_fits
from .settings import Settings

_current: Session | None = None
LAYERS: dict[str, torch.nn.Module] = {}   # layer name -> its layer (the op looks it up)


def session_for(settings: Settings, vllm_config) -> Session:
    """The session of the model being built under ``vllm_config`` (a new model: a new session)."""
    global _current
    if _current is None or _current.vllm_config is not vllm_config:
        if _current is not None:
            _current.close()
        _current = Session(settings, vllm_config)
    return _current


class Session:
    def __init__(self, settings: Settings, vllm_config) -> None:
        self.settings, self.config = settings, settings.cache
        self.vllm_config = vllm_config
        self.device = torch.device(vllm_config.device_config.device)  # where the pool lives
        self.layers: list[torch.nn.Module] = []
        self.hosts: list[HostExperts | None] = []
        self.top_k = self.num_experts = None
        self.pool: SlotPool | None = None
        self.table: SlotTable | None = None
        self.slot_map = None      # expert -> slot per layer (step.SlotMap), made with the table
        self.h2d: list[list[int]] | None = None
        self.steps = 0            # counted forward passes (engine steps)
        self.tokens = [0, 0]      # counted tokens per phase (prefill, decode)
        self.host_s = 0.0         # seconds counted steps spent outside vLLM's kernel (plan, copies, remap)
        self.warmup_steps = 0     # forward passes kept out of the statistics
        self.recorder = None
        self.telemetry = None
        self.planner = None       # planner 'device': device.DevicePlanner, made when the last layer loaded
        self._closed = False
        atexit.register(self.close)

    # -- building -------------------------------------------------------------------
    def join(self, layer) -> int:
        self.layers.append(layer)
        self.hosts.append(None)
        self.top_k, self.num_experts = layer.top_k, layer.global_num_experts
        LAYERS[layer.layer_name] = layer
        return len(self.layers) - 1

    def take_weights(self, index: int, layer) -> None:
        """After vLLM repacked ``layer``'s experts (on the host): keep them there, give the layer the pool."""
        if layer.quant_method.mk_can_overlap_shared_experts:
            # the kernel would run the shared experts inside it, and step.py calls it without them
            raise ValueError(f"expertcache: {layer.layer_name}: vLLM chose a prepare/finalize that runs "
                             "the shared experts inside the experts kernel (expert or data parallelism); "
                             "the plug-in supports neither")
        host = HostExperts.take(layer)
        if self.pool is None:
            self.pool = self._make_pool(host, layer)
        elif host.layout() != self.pool.layout:
            raise ValueError(f"expertcache: {layer.layer_name} has expert tensors {host.layout()} but the "
                             f"first MoE layer has {self.pool.layout}; one pool needs equal layers")
        self.hosts[index] = host
        for kind, param in self.pool.params.items():
            delattr(layer, kind)
            layer.register_parameter(kind, param)  # the same Parameter in every layer
        if self.settings.planner == "device" and all(h is not None for h in self.hosts):
            self.start()  # the device step's buffers must exist before vLLM compiles and warms up

    def _make_pool(self, host: HostExperts, layer) -> SlotPool:
        L, E, k = len(self.layers), self.num_experts, self.top_k
        run = self.config
        staging = run.staging or k
        if self.settings.planner == "device":
            from .device import staging_rows
            need = staging_rows(E, k, self.vllm_config.scheduler_config.max_num_batched_tokens)
            if run.staging is not None and run.staging < need:
                raise ValueError(f"expertcache: staging={run.staging}: planner 'device' stages every miss of a "
                                 f"step, up to min(E, max_num_batched_tokens x top-k) = {need} experts; "
                                 "drop the 'staging' key or lower --max-num-batched-tokens")
            staging = need
        if run.gpu_memory is not None:
            slots = run.gpu_memory_bytes // host.expert_bytes - staging
            if slots < k:
                raise ValueError(f"expertcache: gpu_memory={run.gpu_memory!r} holds {max(slots, 0)} "
                                 f"experts of {host.expert_bytes} bytes after {staging} staging slots; "
                                 f"a step needs {k}")
        else:
            slots = run.slots
        slots = min(slots, L * E)  # more slots than experts would only waste memory
        if run.partition == "per-layer":
            slots = min(slots // L, E) * L
        check_pool_fits((slots + staging) * host.expert_bytes, self.device)
        return SlotPool(host.layout(), slots, staging, self.device)

    def start(self) -> None:
        """Every layer has joined and been loaded: at the first counted step (host planner), or
        when the last layer's weights are taken (device planner: its buffers must exist before
        vLLM compiles and warms the model up)."""
        L, E = len(self.layers), self.num_experts
        run = self.config
        self.table = SlotTable(L, E, self.pool.slots, eviction=run.eviction, admission=run.admission,
                               partition=run.partition, top_k=self.top_k)
        self.h2d = [[0] * L for _ in range(2)]
        from .step import SlotMap
        self.slot_map = SlotMap(L, E, self.pool.device)
        if run.imatrix is not None:
            self._place_imatrix()
        if self.settings.planner == "device":
            from .device import DevicePlanner, attach
            self.planner = DevicePlanner(self, self.vllm_config.scheduler_config.max_num_batched_tokens)
            for index, layer in enumerate(self.layers):
                attach(layer, self, index)
        from .telemetry import Telemetry
        self.telemetry = Telemetry(self)
        if self.settings.record_trace:
            from .recorder import Recorder
            self.recorder = Recorder(L, E, self.top_k)

    def _place_imatrix(self) -> None:
        from ..imatrix.apply import check_source, place
        counts = check_source(self.config.imatrix, len(self.layers), self.num_experts)
        for key, slot in place(self.table, counts, self.config.imatrix_mode).loads.items():
            layer, expert = divmod(key, self.num_experts)
            self.pool.load(slot, self.hosts[layer], expert)  # setup, not counted as traffic

    # -- per forward --------------------------------------------------------------
    def begin_forward(self, tokens: int, phase: int) -> None:
        """At the first layer of a counted forward pass."""
        self.tokens[phase] += tokens

    def end_forward(self) -> None:
        """After the last layer of a counted forward pass."""
        self.steps += 1
        if self.telemetry is not None and self.steps % self.settings.stats_every == 0:
            self.telemetry.write()

    # -- public surface -------------------------------------------------------------
    def stats(self) -> LiveStats | None:
        if self.table is None:
            return None
        if self.planner is not None:  # live counts: the map the device used, one step behind the table
            self.planner.flush()
            counts, h2d = self.planner.stats(), self.planner.h2d
        else:
            counts, h2d = self.table.stats(), self.h2d
        return LiveStats(counts, h2d, {
            "slot_format": "plain", "bytes_per_slot": self.hosts[0].expert_bytes,
            "bytes_per_load": self.hosts[0].expert_bytes, "host_memory": "pinned" if self.pool.cuda
            else "copy", "host_memory_reason": "vLLM's repacked expert tensors"})

    def summary(self) -> dict:
        pool = self.pool
        return {"layers": len(self.layers), "experts": self.num_experts, "top_k": self.top_k,
                "slots": None if pool is None else pool.slots,
                "staging": None if pool is None else pool.staging,
                "slot_bytes": None if pool is None else pool.slot_bytes,
                "steps": self.steps, "warmup_steps": self.warmup_steps,
                "planner": self.settings.planner, "lag": None if self.planner is None else self.planner.lag,
                "host_us_per_layer_step": 1e6 * self.host_s / max(self.steps * len(self.layers), 1),
                "config": self.config.to_dict()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.planner is not None:
            from .device import ACTIVE
            if ACTIVE[0] is self:
                self.planner.flush()
                ACTIVE[0] = None
        if self.telemetry is not None:
            self.telemetry.write()
        if self.recorder is not None:
            self.recorder.save(self.settings.record_trace, self)
