"""``planner="device"`` in our transformers runtime: decode steps on the device, the policy a
forward behind on the host.

``DevicePlanner`` joins the engine-agnostic step (``runtime/devicestep.py``) and the
host-side ``expertcache.lagged.LaggedTable``:

- the model's forward pre-hook (``begin_forward``) reads the previous device forward's
  routing (host memory by then), hands it to the lagged table, takes back the slot changes
  decided so far and applies them, then decides whether this forward runs on the device:
  decode (one new token per sequence) whose ``T x K`` pairs fit the staging rows.
  Otherwise (prefill, or a batch wider than the staging rows) the host path of
  ``runtime/experts.py`` runs, planned at once (lag 0) through ``host_step``, after every
  pending decision is applied;
- on the device path each MoE layer's step is ``DeviceStep.run`` with ``slots_kernel``: no
  host read, no data-dependent shape, so the block compiles with ``fullgraph=True``.

Only plain slots (float experts) and miss path ``fetch`` take the device path; other
configurations keep the host planner (``planner_reason`` says why).
"""

from __future__ import annotations

from itertools import chain

import torch

from ..lagged import LaggedTable
from ..stats import DECODE, Stats
from .compute import _activate
from .devicestep import DeviceStep


def device_planner_refusal(cache) -> str | None:
    """Why ``cache`` cannot run the device planner, or None when it can."""
    if cache.host_resident:
        return "every expert is computed on the host's bytes (resident, ggml): no slots to plan"
    if cache.slot_format != "plain":
        return f"slot format {cache.slot_format!r}: the device step stages plain (float) experts only"
    if cache.miss != "fetch":
        return f"miss path {cache.miss!r} computes misses on the host; the device step fetches them"
    if cache.pool.staging < 1:
        return "the pool has no staging rows"
    return None


class DevicePlanner:
    """The device step and the lagged table of one ``ExpertCache`` (``cache.planner``)."""

    def __init__(self, cache, lag: int, max_tokens: int = 256) -> None:
        pool = cache.pool
        self.cache = cache
        self.step = DeviceStep(pool.tensors, [h.tensors for h in cache.hosts], pool.slots,
                               top_k=cache.top_k, max_tokens=max_tokens, resident=cache.table.resident())
        self.lagged = LaggedTable(cache.table, lag, pool.staging)
        self.active = False  # whether the current forward runs on the device
        self._recorded = 0   # tokens of the last device forward, not yet observed (0: none)
        self.transposed = cache.hosts[0].transposed
        self.copies = [[0] * cache.num_layers for _ in range(2)]  # [phase][layer] experts copied
        self.device_forwards = self.host_forwards = 0

    # -- once per forward, on the host ---------------------------------------------------------
    def begin_forward(self, tokens: int | None, phase: int | None) -> None:
        """Before a forward of ``tokens`` new tokens in all (batch x new tokens)."""
        self.observe()
        device = phase == DECODE and tokens is not None and self.step.fits(tokens)
        updates = self.lagged.begin() if device else self.lagged.flush()
        self._count_loads(updates)
        self.step.apply(updates)
        self.active = device
        if device:
            self._recorded, self.device_forwards = tokens, self.device_forwards + 1
        else:
            self.host_forwards += 1

    def observe(self) -> None:
        """Hand the last device forward's routing to the lagged table (once)."""
        T, self._recorded = self._recorded, 0
        if not T:
            return
        if self.step.routed_event is not None:
            self.step.routed_event.synchronize()  # the forward's routing is in host memory
        steps = [list(dict.fromkeys(chain.from_iterable(self.step.routing(l, T).tolist())))
                 for l in range(self.cache.num_layers)]
        resident, E = self.lagged.resident, self.cache.num_experts
        for layer, experts in enumerate(steps):  # every miss is one copy into a staging row
            self.copies[DECODE][layer] += sum(1 for e in experts if layer * E + e not in resident)
        self.lagged.observe(steps, DECODE, self.step.staged_rows(T))

    def _count_loads(self, updates) -> None:
        for layer, _expert, slot, source in updates:
            if slot >= 0 and source < 0:
                self.copies[DECODE][layer] += 1

    # -- host-planned steps -------------------------------------------------------------------
    def host_step(self, layer: int, experts: list[int], phase: int):
        """The table's plan for a host-planned step; the device map follows it."""
        plan = self.lagged.host_step(layer, experts, phase)
        if plan.evictions or plan.loads:  # the host path copies the weights itself (pool.load)
            E = self.cache.num_experts
            entries = dict.fromkeys(plan.evictions, -1)
            entries.update(plan.loads)
            self.step.write_map([(k // E, k % E, s) for k, s in entries.items()])
        return plan

    # -- the device step ------------------------------------------------------------------------
    def run(self, layer: int, module: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
        """One MoE layer's step on the device (``DeviceStep.run``); no host read."""
        kernel = slots_kernel(module, self.step.pool, self.transposed)
        return self.step.run(layer, hidden, top_k_weights, top_k_index, kernel)

    # -- counters -------------------------------------------------------------------------------
    def stats(self) -> Stats:
        self.observe()
        return self.lagged.stats()

    def h2d(self, expert_bytes: int) -> list[list[int]]:
        """Bytes copied from the host per [phase][layer] on the device path (staged misses and
        loads that found no staging row), in the masked-copy accounting (module doc of
        runtime/devicestep.py: the CPU fallback copies fixed-width rows)."""
        self.observe()
        return [[n * expert_bytes for n in row] for row in self.copies]

    def reset_stats(self) -> None:
        self.observe()
        self.lagged.reset_stats()
        self.copies = [[0] * self.cache.num_layers for _ in range(2)]


def slots_kernel(module: torch.nn.Module, pool: dict[str, torch.Tensor], transposed: bool):
    """``kernel(x [T, H], weights [T, K], rows [T, K]) -> [T, H]``: every pair on the pool's row,
    one grouped matmul per projection over all S + R rows; fixed shapes, no host read."""
    first = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"

    def kernel(x: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # T tokens, K top-k, N = T*K pairs, S+R pool rows, H hidden
        w_up, w_down = pool[first], pool["down_proj"]
        T, K = rows.shape
        flat = rows.reshape(-1).long()                                       # [N]
        order, perm = torch.sort(flat, stable=True)                          # [N] pairs by row
        counts = torch.zeros(w_up.shape[0], dtype=torch.int32, device=flat.device)
        counts = counts.scatter_add(0, order, torch.ones_like(order, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)                    # [S+R]
        xs = x[perm // K].to(w_up.dtype)                                     # [N, H]
        proj = _mm(xs, w_up, offs, order, transposed)
        if first + "_bias" in pool:
            proj = proj + pool[first + "_bias"][order]
        out = _mm(_activate(module, proj), w_down, offs, order, transposed)
        if "down_proj_bias" in pool:
            out = out + pool["down_proj_bias"][order]
        if getattr(module, "has_post_expert_norm", False):
            out = module.post_expert_norm(out)
        out = out * weights.reshape(-1)[perm].unsqueeze(-1).to(out.dtype)   # [N, H]
        full = out.new_zeros(T * K, out.shape[-1]).index_copy(0, perm, out)  # back in pair order
        return full.view(T, K, -1).sum(dim=1).to(x.dtype)                    # [T, H]

    return kernel


def _mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, order: torch.Tensor,
        transposed: bool) -> torch.Tensor:
    """Row-sorted ``x`` [N, in] times the weights of each pair's row (``order`` [N] rows, sorted;
    ``offs``: group ends over ``w`` [S+R, ...]): one grouped matmul, reading the weights in place
    (bf16 on CUDA; any dtype on the CPU in eager mode). Where grouped_mm refuses the dtype (other
    dtypes on CUDA; float32 traced by torch.compile) a gather of the N rows' weights and a
    batched matmul, fixed shapes too (measured 3x slower in CPU decode: it copies the weights)."""
    w = w if transposed else w.transpose(-2, -1)                          # [S+R, in, out]
    if (w.device.type == "cuda" and w.dtype == torch.bfloat16) or \
            (w.device.type == "cpu" and not torch.compiler.is_compiling()):
        return torch.nn.functional.grouped_mm(x, w, offs=offs)
    return torch.bmm(x.unsqueeze(1), w.index_select(0, order)).squeeze(1)  # [N, out]
