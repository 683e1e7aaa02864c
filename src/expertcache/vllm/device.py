"""``planner: device``: the layer step runs on the device, the policy one engine step behind.

The layer step (``layer_step``) is fixed-shape tensor work only: no host read, no Python
branch on a tensor value, no data-dependent shape. So it traces into vLLM's compiled
graph on the CPU (no opaque op) and can be captured in a CUDA graph:

1. look the ids up in the layer's row of the slot map (expert -> slot, -1 if absent);
2. the experts that missed get staging rows ``S..S+n-1`` in ascending id order, ``n =
   min(T*K, E)`` (a shape, not a value: the most distinct experts T tokens can miss);
3. gather those experts' rows from the host store into the staging rows (on the CPU an
   index copy; on CUDA through a device view of the pinned host memory). The grid is
   fixed: n rows every step. On CUDA a Triton kernel (stage.py) returns at once in the
   grid rows past the step's miss count (a device value), so only misses cross the bus;
   traced on the CPU, plain indexing copies all n rows; eager on the CPU, where reading a
   tensor is no device sync, only the missed rows are copied (the same rows);
4. remap the ids to slot or staging rows, record them for the host, call the kernel once.

Exact by construction: every expert the step needs is in a slot or a staging row when the
kernel runs, so the logits are vLLM's (one kernel call, no rounds). Staging rows number
``min(E, max_num_batched_tokens * K)`` so that any step fits.

The host side (``DevicePlanner``) runs around each engine step (``_model_forward`` of
vLLM's model runner, outside any graph). After step t it reads step t's recorded ids of
the real tokens, counts the live hits and misses against the map the device used, plans
the same ``SlotTable`` step the host planner would, and before step t+1 applies the
table's decisions: slot-map entries and rows copied from the host into their slots. A
decision taken at step t serves from step t+1 (the lag, 1 engine step): within one
forward a layer's key is needed at most once, so the lag costs no hit that a lag-0 table
could have had inside the same forward (DESIGN.md, last section).
"""

from __future__ import annotations

import time

import torch

from ..stats import DECODE, FIELDS, PREFILL, Stats


def staging_rows(num_experts: int, top_k: int, max_tokens: int) -> int:
    """Staging rows a device step needs so that every step fits: its distinct experts."""
    return min(num_experts, max_tokens * top_k)


def layer_step(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               slot_row: torch.Tensor, hosts: tuple[torch.Tensor, ...], pool: tuple[torch.Tensor, ...],
               record: torch.Tensor, slots: int, kernel, stage=None) -> torch.Tensor:
    """One MoE layer step on the device; ``kernel(x, weights, rows) -> [T, H]`` runs on the pool.

    ``stage(dst, src, order, count)``: the staging copy that skips rows past ``count``
    (stage.stage_rows on CUDA); None: plain indexing, the whole grid.

    x [T, H]; topk_weights [T, K]; topk_ids [T, K] int32 (expert ids 0..E-1);
    slot_row [E] int32 (slot, or -1); hosts / pool: per weight kind [E, ...] / [S + R, ...];
    record [Tmax, K] int32 (this step's ids, read by the host after the step).
    """
    T, K = topk_ids.shape
    E = slot_row.shape[0]
    ids = topk_ids.long()                                         # [T, K]
    slot = slot_row[ids]                                          # [T, K] int32, -1 = miss
    miss = slot < 0                                               # [T, K]
    missed = torch.zeros(E, dtype=torch.int32, device=ids.device)
    missed.index_put_((ids.reshape(-1),), miss.reshape(-1).to(torch.int32), accumulate=True)
    need = missed > 0                                             # [E] experts to stage
    staged = slots - 1 + torch.cumsum(need.to(torch.int32), 0)    # [E] staging row of a needed expert
    if ids.device.type == "cpu" and not torch.compiler.is_compiling():
        # eager on the CPU: reading a CPU tensor is no device sync, so copy the missed rows only
        order = need.nonzero().reshape(-1)                        # [misses] ascending ids
        n = order.shape[0]
    else:  # traced or on CUDA: a fixed grid, n = the most distinct experts T tokens can miss
        n = min(T * K, E)
        order = torch.sort((~need).to(torch.int8), stable=True).indices[:n]  # [n] needed first, ascending
    if stage is not None:  # CUDA: the grid's rows past the miss count are skipped (stage.py)
        count = need.sum(dtype=torch.int32)                       # 0-dim, stays on the device
        for host, rows in zip(hosts, pool):
            stage(rows[slots:slots + n], host, order, count)
    else:
        for host, rows in zip(hosts, pool):
            rows[slots:slots + n] = host[order]                   # staging rows S..S+n-1
    remapped = torch.where(miss, staged[ids].to(slot.dtype), slot)  # [T, K] slot or staging row
    record[:T] = topk_ids
    return kernel(x, topk_weights, remapped.to(topk_ids.dtype))


class DevicePlanner:
    """The host half: the SlotTable one engine step behind, its decisions applied between steps.

    ``slot_map`` [L, E] int32 on the device is what the layer steps read; ``mirror`` is the
    same map on the host (expert -> slot per layer), so live hits and misses are counted
    exactly from the recorded ids, with no device read but the ids themselves.
    """

    def __init__(self, session, max_tokens: int) -> None:
        self.session = session
        L, E, K = len(session.layers), session.num_experts, session.top_k
        device = session.pool.device
        self.slot_map = torch.full((L, E), -1, dtype=torch.int32, device=device)
        # token-major, so that a step's first n tokens are one contiguous block to copy out
        self.records = torch.zeros((max_tokens, L, K), dtype=torch.int32, device=device)
        self.mirror: list[dict[int, int]] = [{} for _ in range(L)]
        self.counts = [[[0] * len(FIELDS) for _ in range(L)] for _ in (PREFILL, DECODE)]
        self.h2d = [[0] * L for _ in (PREFILL, DECODE)]
        self.lag = 1
        self._pending = None     # (tokens, phase, host copy of the records, event) of the last step
        self._host_records = (torch.empty_like(self.records, device="cpu", pin_memory=True)
                              if device.type == "cuda" else None)

    # -- around each engine step (outside any graph) --------------------------------------
    def before_forward(self) -> None:
        """Apply what the last counted step decided: lag 1."""
        self.flush()

    def after_forward(self, tokens: int, phase: int) -> None:
        """Step t ran with ``tokens`` real tokens: take its ids (non-blocking on CUDA)."""
        if self._host_records is None:  # CPU: the step is done, its decisions are made now
            self._replay(self.records[:tokens].numpy(), phase)
            return
        self._host_records[:tokens].copy_(self.records[:tokens], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (tokens, phase, self._host_records, event)

    def flush(self) -> None:
        if self._pending is None:
            return
        tokens, phase, records, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()  # step t is done by now in all but the fastest steps
        self._replay(records[:tokens].numpy(), phase)

    # -- the policy -----------------------------------------------------------------------
    def _replay(self, ids, phase: int) -> None:
        """``ids`` [n, L, K]: one counted step's routing of its real tokens."""
        s = self.session
        table, E, counts = s.table, s.num_experts, self.counts[phase]
        changed: dict[tuple[int, int], int] = {}
        for layer in range(ids.shape[1]):
            experts = list(dict.fromkeys(ids[:, layer].reshape(-1).tolist()))  # token-major rank order
            resident = self.mirror[layer]
            hits = sum(e in resident for e in experts)
            row = counts[layer]
            row[0] += len(experts)
            row[1] += hits
            row[2] += len(experts) - hits
            # every miss was staged (copied into a staging row) in the step itself
            self.h2d[phase][layer] += (len(experts) - hits) * s.hosts[layer].expert_bytes
            plan = table.step(layer, experts, phase)
            row[5] += len(plan.bypasses)  # not admitted: as the host planner counts them
            for key in plan.evictions:
                victim_layer, expert = divmod(key, E)
                del self.mirror[victim_layer][expert]
                changed[(victim_layer, expert)] = -1
                counts[victim_layer][4] += 1
            for key, slot in plan.loads.items():
                self.mirror[layer][key - layer * E] = slot
                changed[(layer, key - layer * E)] = slot
                row[3] += 1
        self._apply(changed, phase)

    def _apply(self, changed: dict[tuple[int, int], int], phase: int) -> None:
        """Slot-map entries and slot rows, before the next step (same stream on CUDA)."""
        if not changed:
            return
        s = self.session
        s.pool.begin()  # the copies wait for the kernels of the step that read the old rows
        layers, experts, slots = zip(*((l, e, v) for (l, e), v in changed.items()))
        self.slot_map[list(layers), list(experts)] = torch.tensor(slots, dtype=torch.int32).to(
            self.slot_map.device, non_blocking=True)
        for (layer, expert), slot in changed.items():
            if slot >= 0:
                self.h2d[phase][layer] += s.pool.load(slot, s.hosts[layer], expert)
        s.pool.ready()

    def seed(self) -> None:
        """Take the table's placement made before the first step (imatrix pinning)."""
        E = self.session.num_experts
        for key, slot in self.session.table.resident().items():
            layer, expert = divmod(key, E)
            self.mirror[layer][expert] = slot
            self.slot_map[layer, expert] = slot

    def stats(self) -> Stats:
        return Stats(self.counts)


def attach(layer, session, index: int) -> None:
    """Give ``layer`` what its traced step reads, as buffers (graph inputs, fixed addresses).

    Its row of the slot map and of the records are views of the planner's tensors (the
    host updates them in place between steps); the host store is the layer's experts on
    the host, read on CUDA through a device view of the pinned memory (vLLM's UVA helper,
    as ``--cpu-offload-params`` uses).
    """
    planner = session.planner
    hosts = [session.hosts[index].tensors[kind] for kind in session.pool.params]
    if session.pool.device.type == "cuda":
        from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor
        hosts = [get_accelerator_view_from_cpu_tensor(t) for t in hosts]
    layer.register_buffer("_ec_slot_row", planner.slot_map[index], persistent=False)
    layer.register_buffer("_ec_record", planner.records[:, index], persistent=False)  # [Tmax, K] view
    for i, t in enumerate(hosts):
        layer.register_buffer(f"_ec_host{i}", t, persistent=False)
    layer._ec_slots = session.pool.slots
    layer._ec_stage = None
    if session.pool.device.type == "cuda":
        from .stage import stage_rows
        layer._ec_stage = stage_rows
    layer._ec_device = True
    ACTIVE[0] = session
    _hook_model_runner()


def run_layer(layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The layer's device step (traceable: buffers, ints and vLLM's kernel only)."""
    hosts = (layer._ec_host0, layer._ec_host1)
    pool = (layer.w13_weight, layer.w2_weight)
    return layer_step(x, topk_weights, topk_ids, layer._ec_slot_row, hosts, pool, layer._ec_record,
                      layer._ec_slots, layer._expertcache_kernel, layer._ec_stage)


_HOOKED = False
ACTIVE: list = [None]  # the session whose planner runs around engine steps in this process


def _hook_model_runner() -> None:
    """Run the planner's host half around each engine step, outside any graph.

    ``GPUModelRunner._model_forward`` (the CPU runner inherits it) is vLLM's documented
    override point for model execution; it runs in Python for every step, also when the
    model itself is a replayed CUDA graph, inside the step's forward context.
    """
    global _HOOKED
    if _HOOKED:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._model_forward

    def _model_forward(self, *args, **kwargs):
        session = ACTIVE[0]
        if session is None or session.planner is None or session.vllm_config is not self.vllm_config:
            return original(self, *args, **kwargs)
        from .step import step_context
        t0 = time.perf_counter()
        counted, tokens, phase = step_context()
        session.planner.before_forward()
        t1 = time.perf_counter()
        out = original(self, *args, **kwargs)
        t2 = time.perf_counter()
        if not counted:
            session.warmup_steps += 1
            return out
        tokens = tokens or 1
        phase = phase if phase is not None else (PREFILL if tokens > 1 else DECODE)
        session.begin_forward(tokens, phase)
        session.planner.after_forward(tokens, phase)
        session.end_forward()
        session.host_s += (t1 - t0) + (time.perf_counter() - t2)  # the planner's host work, model excluded
        return out

    GPUModelRunner._model_forward = _model_forward
    _HOOKED = True
