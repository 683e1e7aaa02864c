"""The transformers experts function: plan one step, execute the plan, compute.

Registered as ``ExpertsInterface`` implementation "expertcache". Per MoE layer
forward: read the router's choices to the host (the one device-to-host sync of the
step), ask the SlotTable for a plan, copy loads into their slots, then compute hits
and fetched experts from the pool in one grouped matmul over slot ids, stream
excess bypasses through staging slots, and hand CPU-path experts to the host.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from itertools import chain

import torch

from ..stats import DECODE, PREFILL
from .compute import grouped_over_slots
from .cpukernel import ggml_experts
from .miss import cpu_experts

IMPLEMENTATION = "expertcache"


def expertcache_experts_forward(module: torch.nn.Module, hidden_states: torch.Tensor,
                                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """``fn(self, hidden [T, H], top_k_index [T, K] int64, top_k_weights [T, K]) -> [T, H]``."""
    handle = getattr(module, "_expertcache", None)
    if handle is None:
        raise RuntimeError(f"{type(module).__name__} runs the 'expertcache' experts implementation but "
                           "was not prepared by expertcache.offload(); call offload() on the model")
    cache, layer = handle
    return run_step(cache, layer, module, hidden_states, top_k_index, top_k_weights)


def run_step(cache, layer: int, module: torch.nn.Module, hidden: torch.Tensor,
             top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    # T tokens, K top-k, H hidden, E experts of this layer, S pool slots (cache + staging)
    planner = cache.planner
    if planner is not None and planner.active:  # planner='device': no host read (devicepath.py)
        return planner.run(layer, module, hidden, top_k_index, top_k_weights)
    want_acts = cache.miss != "fetch"
    idx_h, hidden_h, weights_h = _to_host(top_k_index, hidden, top_k_weights, want_acts)
    idx_rows = idx_h.tolist()
    phase = cache.phase if cache.phase is not None else (PREFILL if len(idx_rows) > 1 else DECODE)
    experts = list(dict.fromkeys(chain.from_iterable(idx_rows)))
    plan = cache.table.step(layer, experts, phase) if planner is None else planner.host_step(layer, experts, phase)
    base, host, pool = layer * cache.num_experts, cache.hosts[layer], cache.pool
    if cache.host_resident:  # every expert is its own row of the host's bytes: no slots, no loads,
        # no per-pair lookup (the plan above only counts the hits)
        return cache.kernels[layer].routed(module, hidden, top_k_index, top_k_weights, host.tensors)
    for key, slot in plan.loads.items():  # the table now counts these resident: always copy
        cache.h2d[phase][layer] += pool.load(slot, host, key - base)

    on_device = {key - base: slot for key, slot in plan.hits.items()}
    staged, on_cpu = [], []
    tokens = Counter(chain.from_iterable(idx_rows)) if cache.miss == "auto" else None
    for key, slot in plan.loads.items():
        if cache.compute_on_cpu(key - base, tokens):
            on_cpu.append(key - base)  # its copy still lands in the slot, for later hits
        else:
            on_device[key - base] = slot
    for key in plan.bypasses:
        (on_cpu if cache.compute_on_cpu(key - base, tokens) else staged).append(key - base)

    out = _device_rounds(cache, layer, phase, module, hidden, top_k_index, top_k_weights,
                         idx_rows, on_device, staged)
    if on_cpu:  # runs on the host while the device works through the rounds queued above
        if cache.kernels is not None and not on_device and not staged:
            # every pair of the step on the host's bytes (baseline cpu, a step of misses): the
            # routed pass, no per-pair Python
            y = cache.kernels[layer].routed(module, hidden_h, idx_h, weights_h, host.tensors)
        elif cache.kernels is not None:
            y = ggml_experts(cache.kernels[layer], module, hidden_h, weights_h, idx_rows,
                             {e: e for e in on_cpu}, host.tensors)
        else:
            pairs = defaultdict(list)
            for t, row in enumerate(idx_rows):
                for k, e in enumerate(row):
                    pairs[e].append((t, k))
            y = cpu_experts(module, host, on_cpu, pairs, hidden_h, weights_h)
        y = y.pin_memory().to(hidden.device, non_blocking=True) if pool.cuda else y.to(hidden.device)
        out = y if out is None else out + y
    return out


def _device_rounds(cache, layer, phase, module, hidden, top_k_index, top_k_weights, idx_rows,
                   on_device: dict[int, int], staged: list[int]) -> torch.Tensor | None:
    """Compute device experts; bypasses beyond the staging slots go in further rounds.

    With quantized slots a round also holds at most ``pool.max_view`` experts: the
    scratch they are dequantized into for the round.
    """
    pool, host = cache.pool, cache.hosts[layer]
    staging = pool.staging_ids
    if staged and not staging:
        raise RuntimeError("a bypassed expert needs a staging slot but the pool has none")
    width = min(len(staging) or 1, pool.max_view or len(staging) or 1)
    staged_rounds = [list(zip(staged[i:i + width], staging)) for i in range(0, len(staged), width)]
    rounds = [(dict(c), []) for c in _chunks(list(on_device.items()), pool.max_view)] or [({}, [])]
    if staged_rounds and pool.max_view is None:  # the first staged experts join the slots' matmul
        first = staged_rounds.pop(0)
        rounds[-1] = ({**rounds[-1][0], **dict(first)}, first)
    rounds += [(dict(c), c) for c in staged_rounds]
    out = None
    for mapping, loads in rounds:
        for expert, slot in loads:
            cache.h2d[phase][layer] += pool.load(slot, host, expert)
        if not mapping:
            continue
        pool.ready(mapping.values())  # compute waits for copies into the slots it reads
        if cache.direct:  # ggml on the slots' bytes (CPU): no dequantization, no scratch
            y = ggml_experts(cache.kernels[layer], module, hidden, top_k_weights, idx_rows, mapping, pool.tensors)
            out = y if out is None else out + y
            continue
        weights, rows = pool.view(mapping, host)
        size = next(iter(weights.values())).shape[0]
        slot_idx = _slot_index(rows, cache.num_experts, size, top_k_index)
        # (row, pairs routed to it) in row order, from the host copy of the routing: no sync
        groups = sorted(Counter(rows[e] for row in idx_rows for e in row if e in rows).items())
        y = grouped_over_slots(module, hidden, slot_idx, top_k_weights, weights, groups, pool.grouped,
                               host.transposed)
        pool.mark_read(mapping.values())  # the next load into these slots waits for this
        out = y if out is None else out + y
    return out


def _chunks(items: list, size: int | None) -> list[list]:
    if not items:
        return []
    size = size or len(items)
    return [items[i:i + size] for i in range(0, len(items), size)]


def _slot_index(mapping: dict[int, int], num_experts: int, size: int,
                top_k_index: torch.Tensor) -> torch.Tensor:
    """Expert ids [T, K] -> slot ids [T, K]; experts not in ``mapping`` get ``size`` (skipped)."""
    lut = torch.full((num_experts,), size, dtype=torch.int64)
    lut[list(mapping)] = torch.tensor(list(mapping.values()), dtype=torch.int64)
    if top_k_index.device.type == "cuda":  # pinned + async: no sync on the way up
        lut = lut.pin_memory().to(top_k_index.device, non_blocking=True)
    return lut[top_k_index]


def _to_host(top_k_index: torch.Tensor, hidden: torch.Tensor, weights: torch.Tensor, want_acts: bool):
    """Router choices [T, K] on the host (+ activations for the CPU path), with one sync at most."""
    if top_k_index.device.type != "cuda":
        return top_k_index, hidden, weights
    moved = [t.to("cpu", non_blocking=True) for t in ((top_k_index, hidden, weights) if want_acts
                                                      else (top_k_index,))]
    torch.cuda.current_stream(top_k_index.device).synchronize()  # the one D2H sync of this step
    return moved[0], *(moved[1:] if want_acts else (None, None))
