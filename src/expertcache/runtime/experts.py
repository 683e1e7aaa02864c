"""The transformers experts function: plan one step, execute the plan, compute.

Registered as ``ExpertsInterface`` implementation "expertcache". Per MoE layer
forward: read the router's choices to the host (the one device-to-host sync of the
step), ask the SlotTable for a plan, copy loads into their slots, then compute hits
and fetched experts from the pool in grouped matmuls over slot ids (on CUDA the hits
first, while the misses' copies run), stream excess bypasses through staging slots
(two alternating banks on CUDA), and hand CPU-path experts to the host, with the
activations copied there only for such a step.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from itertools import chain
from typing import Sequence

import torch

from ..stats import DECODE, PREFILL
from .compute import grouped_over_slots
from .cpukernel import ggml_experts
from .fused import fused_experts
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
    idx_h = _ids_to_host(top_k_index)
    idx_rows = idx_h.tolist()
    phase = cache.phase if cache.phase is not None else (PREFILL if len(idx_rows) > 1 else DECODE)
    experts = list(dict.fromkeys(chain.from_iterable(idx_rows)))
    plan = cache.table.step(layer, experts, phase) if planner is None else planner.host_step(layer, experts, phase)
    base, host, pool = layer * cache.num_experts, cache.hosts[layer], cache.pool
    tiered = getattr(host, "tiered", False)  # host_memory='tiered': a RAM tier over the file
    if cache.host_resident:  # every expert is its own row of the host's bytes: no slots, no loads,
        # no per-pair lookup (the plan above only counts the hits)
        if tiered:  # ... of the RAM tier's rows, read from the file where missing (runtime/tiered.py)
            return host.routed(cache.kernels[layer], module, hidden, idx_h, top_k_weights, experts, phase)
        return cache.kernels[layer].routed(module, hidden, top_k_index, top_k_weights, host.tensors)
    row = None
    if tiered:  # slot misses are served from the RAM tier, else read from the file into it
        host.count_tokens(phase, len(idx_rows))
        need = [key - base for key in chain(plan.loads, plan.bypasses)]
        if need:
            host = host.fetch(need, phase)
            row = host.rows
    for key, slot in plan.loads.items():  # the table now counts these resident: always copy
        cache.h2d[phase][layer] += pool.load(slot, host, key - base if row is None else row[key - base])

    hits = {key - base: slot for key, slot in plan.hits.items()}
    loads, staged, on_cpu = {}, [], []
    tokens = Counter(chain.from_iterable(idx_rows)) if cache.miss == "auto" else None
    for key, slot in plan.loads.items():
        if cache.compute_on_cpu(key - base, tokens):
            on_cpu.append(key - base)  # its copy still lands in the slot, for later hits
        else:
            loads[key - base] = slot
    for key in plan.bypasses:
        (on_cpu if cache.compute_on_cpu(key - base, tokens) else staged).append(key - base)

    # the activations go to the host only for a step that computes there; fetched before any
    # device pass is queued, so the copy waits for nothing but itself
    hidden_h, weights_h = _acts_to_host(hidden, top_k_weights) if on_cpu else (None, None)
    out = _device_rounds(cache, layer, phase, module, hidden, top_k_index, top_k_weights,
                         idx_rows, hits, loads, staged, host, row)
    if on_cpu:  # runs on the host while the device works through the rounds queued above
        if cache.kernels is not None and not hits and not loads and not staged:
            # every pair of the step on the host's bytes (baseline cpu, a step of misses): the
            # routed pass, no per-pair Python
            ids = idx_h if row is None else host.remap(idx_h)
            y = cache.kernels[layer].routed(module, hidden_h, ids, weights_h, host.tensors)
        elif cache.kernels is not None:
            y = ggml_experts(cache.kernels[layer], module, hidden_h, weights_h, idx_rows,
                             {e: e if row is None else row[e] for e in on_cpu}, host.tensors)
        else:
            pairs = defaultdict(list)
            for t, row in enumerate(idx_rows):
                for k, e in enumerate(row):
                    pairs[e].append((t, k))
            y = cpu_experts(module, host, on_cpu, pairs, hidden_h, weights_h)
        y = y.pin_memory().to(hidden.device, non_blocking=True) if pool.cuda else y.to(hidden.device)
        out = y if out is None else out + y
    return out


def plan_rounds(hits: dict[int, int], loads: dict[int, int], staged: list[int], staging: Sequence[int],
                max_view: int | None, overlap: bool) -> list[tuple[dict[int, int], list[tuple[int, int]]]]:
    """A step's device passes: (expert -> slot each pass computes, (expert, staging slot) copies
    issued just before it).

    ``max_view`` (quantized slots) caps the experts of a pass: the scratch they are dequantized
    into. With ``overlap`` (CUDA, where copies run beside compute):
    - hits get a pass of their own, ahead of the loaded experts: it waits for no copy, so the
      device computes what is resident while the misses cross PCIe;
    - bypasses beyond the staging slots alternate between two banks of them, so one round's
      copies run while the round before it computes (one bank: each copy would wait for it).
    Without a scratch cap the first staged experts join the last pass that waits for copies anyway.
    """
    if overlap and hits and loads:
        passes = _chunks(list(hits.items()), max_view) + _chunks(list(loads.items()), max_view)
    else:
        passes = _chunks([*hits.items(), *loads.items()], max_view)
    rounds = [(dict(p), []) for p in passes] or [({}, [])]
    if staged and not staging:
        raise RuntimeError("a bypassed expert needs a staging slot but the pool has none")
    staging = list(staging)
    half = len(staging) // 2
    banks = [staging[:half], staging[half:]] if overlap and len(staged) > len(staging) and half else [staging]
    width = min(len(banks[0]) or 1, max_view or len(banks[0]) or 1)
    staged_rounds = [list(zip(staged[i:i + width], banks[(i // width) % len(banks)]))
                     for i in range(0, len(staged), width)]
    joins = max_view is None and not (overlap and hits and not loads)  # never make hits wait
    if staged_rounds and joins:
        first = staged_rounds.pop(0)
        rounds[-1] = ({**rounds[-1][0], **dict(first)}, first)
    return rounds + [(dict(c), c) for c in staged_rounds]


def _device_rounds(cache, layer, phase, module, hidden, top_k_index, top_k_weights, idx_rows,
                   hits: dict[int, int], loads: dict[int, int], staged: list[int], host,
                   row: dict[int, int] | None = None) -> torch.Tensor | None:
    """Compute the device's experts in the passes ``plan_rounds`` lays out; ``host`` holds the
    bytes staged experts are copied from (expert ``e`` at ``row[e]``, or at ``e`` without ``row``)."""
    pool = cache.pool
    # the fused kernel (runtime/fused.py, CUDA with Triton) reads quantized slots in place: no
    # scratch, so no cap on the experts of a pass (the layout from the layer's own codec)
    fused = None if cache.direct else pool.fused_layout(module, cache.hosts[layer])
    max_view = pool.max_view if fused is None else None
    out = None
    for mapping, copies in plan_rounds(hits, loads, staged, pool.staging_ids, max_view, pool.cuda):
        for expert, slot in copies:
            cache.h2d[phase][layer] += pool.load(slot, host, expert if row is None else row[expert])
        if not mapping:
            continue
        pool.ready(mapping.values())  # compute waits for copies into the slots it reads, only those
        if cache.direct:  # ggml on the slots' bytes (CPU): no dequantization, no scratch
            y = ggml_experts(cache.kernels[layer], module, hidden, top_k_weights, idx_rows, mapping, pool.tensors)
            out = y if out is None else out + y
            continue
        if fused is not None:
            y = fused_experts(hidden, top_k_weights, _slot_index(mapping, cache.num_experts, pool.size, top_k_index),
                              fused)
            pool.mark_read(mapping.values())
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


def _ids_to_host(top_k_index: torch.Tensor) -> torch.Tensor:
    """Router choices [T, K] on the host: the one device-to-host sync of a step."""
    if top_k_index.device.type != "cuda":
        return top_k_index
    ids = top_k_index.to("cpu", non_blocking=True)
    torch.cuda.current_stream(top_k_index.device).synchronize()
    return ids


def _acts_to_host(hidden: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H] and routing weights [T, K] on the host, for the experts computed there."""
    return hidden.to("cpu"), weights.to("cpu")  # no-ops on the CPU
