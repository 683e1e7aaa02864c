"""``planner: device``: the layer step runs on the device, the policy ``lag`` engine steps behind.

Built on the engine-agnostic device step (``runtime/devicestep.py``) and the lagged policy
(``lagged.py``) that the transformers runtime uses too; this module wires them into vLLM.

The layer step (``layer_step``) is fixed-shape tensor work only: no host read, no Python
branch on a tensor value, no data-dependent shape. So it traces into vLLM's compiled
graph on the CPU (no opaque op) and can be captured in a CUDA graph:

1. look the ids up in the layer's row of the slot map (expert -> slot, -1 if absent);
2. the experts that missed get staging rows ``S..S+W-1`` in ascending id order,
   ``W = min(T*K, E, R)`` (a shape, not a value: the most distinct experts T tokens can miss);
3. gather those experts' rows from the host store into the staging rows: eager on the CPU
   the missed rows only; traced on the CPU all W rows; on CUDA, through a device view of
   the pinned host memory, a Triton kernel whose masked loads skip rows without a miss;
4. remap the ids to slot or staging rows, record them for the host, call the kernel once.

Exact by construction: every expert the step needs is in a slot or a staging row when the
kernel runs, so the logits are vLLM's (one kernel call, no rounds). Staging rows number
``min(E, max_num_batched_tokens * K)`` so that any step fits.

The host side (``DevicePlanner``) runs around each engine step (``_model_forward`` of
vLLM's model runner, outside any graph). After step t it reads step t's recorded ids of
the real tokens; ``LaggedTable`` counts the live hits and misses against the map the device
used and queues the step; before step t + lag it plans the queued step with the same
``SlotTable`` (every eviction and admission rule) and the net slot changes are applied:
slot-map entries, and rows copied from the host into their slots. With lag 1 a decision
taken at step t serves from step t+1: within one forward a layer's key is needed at most
once, so that lag costs no hit a lag-0 table could have had (DESIGN.md, last section).
"""

from __future__ import annotations

import time

import torch

from ..lagged import LaggedTable
from ..runtime.devicestep import assign_staging, cuda_view, gather_rows
from ..stats import DECODE, PREFILL, Stats


def staging_rows(num_experts: int, top_k: int, max_tokens: int) -> int:
    """Staging rows a device step needs so that every step fits: its distinct experts."""
    return min(num_experts, max_tokens * top_k)


def layer_step(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               slot_row: torch.Tensor, hosts: tuple[torch.Tensor, ...], pool: tuple[torch.Tensor, ...],
               record: torch.Tensor, slots: int, experts: torch.Tensor, kernel) -> torch.Tensor:
    """One MoE layer step on the device; ``kernel(x, weights, rows) -> [T, H]`` runs on the pool.

    The shared device step's pure parts (runtime/devicestep.py): ``assign_staging`` (lookup,
    misses ranked by expert id into staging rows S.., remap) and ``gather_rows`` (the copy:
    eager on the CPU the missed rows only; traced on the CPU all W rows; on CUDA a Triton
    kernel whose masked loads skip the rows without a miss). The tensors come in as the
    layer's buffers, so that vLLM's compiled graph takes them as inputs.

    x [T, H]; topk_weights [T, K]; topk_ids [T, K] int32 (expert ids 0..E-1);
    slot_row [E] int32 (slot, or -1); hosts / pool: per weight kind [E, ...] / [S + R, ...];
    record [Tmax, K] int32 (this step's ids, read by the host after the step);
    experts [E] = arange(E) on the device.
    """
    T, K = topk_ids.shape
    E, R = slot_row.shape[0], pool[0].shape[0] - slots
    W = min(T * K, E, R)                                          # staging rows this step writes
    rows, staged = assign_staging(slot_row, topk_ids, slots, W, experts)  # [T, K], [W] (E: none)
    for host, dst in zip(hosts, pool):
        gather_rows(host, staged, dst.narrow(0, slots, W))
    record[:T] = topk_ids
    return kernel(x, topk_weights, rows)


class DevicePlanner:
    """The host half around each engine step: ``lagged.LaggedTable`` (the SlotTable ``lag``
    engine steps behind, a mirror of the device's map) fed the recorded routing of the real
    tokens, and its slot changes applied to the device between steps.

    Loads are always copied from the host store, never from a staging row: vLLM pads a
    step's batch (CUDA graph sizes), and the padding tokens' misses take staging rows the
    host does not see, so the host cannot know which row holds which expert.
    """

    def __init__(self, session, max_tokens: int) -> None:
        self.session = session
        L, E, K = len(session.layers), session.num_experts, session.top_k
        device = session.pool.device
        self.lagged = LaggedTable(session.table, lag=session.config.lag)  # staging=0: loads from the host
        self.lag = self.lagged.lag
        self.slot_map = torch.full((L, E), -1, dtype=torch.int32, device=device)
        for key, slot in self.lagged.resident.items():  # placed before the first step (imatrix)
            self.slot_map[divmod(key, E)] = slot
        self.experts = torch.arange(E, device=device)
        # token-major, so that a step's first n tokens are one contiguous block to copy out
        self.records = torch.zeros((max_tokens, L, K), dtype=torch.int32, device=device)
        self.h2d = [[0] * L for _ in (PREFILL, DECODE)]
        self._pending = []       # CUDA: (tokens, phase, host copy, event) of steps not yet observed
        self._host_records = (torch.empty_like(self.records, device="cpu", pin_memory=True)
                              if device.type == "cuda" else None)
        self._phase = DECODE

    # -- around each engine step (outside any graph) --------------------------------------
    def before_forward(self) -> None:
        """Observe the finished steps, then apply the decisions ``lag`` steps old."""
        self._observe_pending()
        self._apply(self.lagged.begin())

    def after_forward(self, tokens: int, phase: int) -> None:
        """Step t ran with ``tokens`` real tokens: take its ids (non-blocking on CUDA)."""
        if self._host_records is None:  # CPU: the step is done
            self._observe(self.records[:tokens].numpy(), phase)
            return
        # one pinned buffer: observed at the next before_forward, before the next step writes
        self._host_records[:tokens].copy_(self.records[:tokens], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((tokens, phase, self._host_records, event))

    def flush(self) -> None:
        """Count what ran (for stats): the steps recorded but not yet observed."""
        self._observe_pending()

    def _observe_pending(self) -> None:
        for tokens, phase, records, event in self._pending:
            event.synchronize()  # step t is done by now in all but the fastest steps
            self._observe(records[:tokens].numpy(), phase)
        self._pending.clear()

    def _observe(self, ids, phase: int) -> None:
        """``ids`` [n, L, K]: one counted step's routing of its real tokens."""
        s, E = self.session, self.session.num_experts
        resident = self.lagged.resident
        steps = []
        for layer in range(ids.shape[1]):
            experts = list(dict.fromkeys(ids[:, layer].reshape(-1).tolist()))  # token-major rank order
            base = layer * E
            missed = sum(base + e not in resident for e in experts)  # each was staged from the host
            self.h2d[phase][layer] += missed * s.hosts[layer].expert_bytes
            steps.append(experts)
        self.lagged.observe(steps, phase)
        self._phase = phase

    def _apply(self, updates) -> None:
        """Slot-map entries and slot rows, before the next step (pool copies ordered on CUDA)."""
        if not updates:
            return
        s = self.session
        s.pool.begin()  # the copies wait for the kernels of the step that read the old rows
        layers, experts, slots, _ = zip(*updates)
        self.slot_map[list(layers), list(experts)] = torch.tensor(slots, dtype=torch.int32).to(
            self.slot_map.device, non_blocking=True)
        for layer, expert, slot, source in updates:
            if slot >= 0:
                self.h2d[self._phase][layer] += s.pool.load(slot, s.hosts[layer], expert)
        s.pool.ready()

    def stats(self) -> Stats:
        return self.lagged.stats()


def attach(layer, session, index: int) -> None:
    """Give ``layer`` what its traced step reads, as buffers (graph inputs, fixed addresses).

    Its row of the slot map and of the records are views of the planner's tensors (the
    host updates them in place between steps); the host store is the layer's experts on
    the host, read on CUDA through a device view of the pinned memory (``cuda_view``).
    """
    planner = session.planner
    hosts = [session.hosts[index].tensors[kind] for kind in session.pool.params]
    if session.pool.device.type == "cuda":
        hosts = [cuda_view(t, session.pool.device) for t in hosts]
    layer.register_buffer("_ec_slot_row", planner.slot_map[index], persistent=False)
    layer.register_buffer("_ec_record", planner.records[:, index], persistent=False)  # [Tmax, K] view
    layer.register_buffer("_ec_experts", planner.experts, persistent=False)
    for i, t in enumerate(hosts):
        layer.register_buffer(f"_ec_host{i}", t, persistent=False)
    layer._ec_slots = session.pool.slots
    layer._ec_device = True
    ACTIVE[0] = session
    _hook_model_runner()


def run_layer(layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The layer's device step (traceable: buffers, ints and vLLM's kernel only)."""
    hosts = (layer._ec_host0, layer._ec_host1)
    pool = (layer.w13_weight, layer.w2_weight)
    return layer_step(x, topk_weights, topk_ids, layer._ec_slot_row, hosts, pool, layer._ec_record,
                      layer._ec_slots, layer._ec_experts, layer._expertcache_kernel)


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
