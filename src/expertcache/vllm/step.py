"""One MoE layer step inside vLLM: plan, copy misses, remap ids, run vLLM's kernel on the pool.

The step's experts are the union of its real tokens' top-k ids (token-major, rank order),
exactly as ``SlotTable.step`` takes them from the transformers runtime. Hits and loads
live in cache slots; the bypasses (the union is larger than the partition, or admission
said no) go through the staging slots. When the bypasses outnumber the staging slots the
step runs in rounds: each round calls the same kernel on the pool with the weights of
the pairs outside the round set to zero, and the rounds' outputs are added. That is
exact arithmetic (vLLM's expert parallelism sums partial outputs the same way); only the
summation order of a token's experts changes, so a step with rounds can differ from
vLLM's single call in the last bits. A step without rounds is the single call.
"""

from __future__ import annotations

import time
from itertools import chain

import torch

from ..stats import DECODE, PREFILL


def step_context() -> tuple[bool, int | None, int | None]:
    """(counted, real tokens, phase) of the current forward from vLLM's forward context.

    vLLM builds attention metadata for real steps only: profile, warm-up and compile
    runs have none, so they are not counted (nor planned).
    """
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return False, None, None
    meta = get_forward_context().attn_metadata
    if not meta:
        return False, None, None
    if isinstance(meta, list):  # dual micro-batches: one dict each
        meta = meta[0]
    first = next(iter(meta.values()))
    tokens = getattr(first, "num_actual_tokens", None)
    longest = getattr(first, "max_query_len", None)
    phase = None if longest is None else (PREFILL if longest > 1 else DECODE)
    return True, tokens, phase


def run(session, index: int, layer, kernel, x: torch.Tensor, topk_weights: torch.Tensor,
        topk_ids: torch.Tensor) -> torch.Tensor:
    """``kernel(x, weights, slot_ids) -> [T, H]`` is vLLM's modular path on the pool.

    x [T, H]; topk_weights [T, K] float; topk_ids [T, K] int (expert ids 0..E-1).
    """
    counted, n, phase = step_context()
    if not counted:
        if index == 0:
            session.warmup_steps += 1
        return kernel(x, topk_weights, _warmup_ids(topk_ids, session.pool))
    if session.table is None:
        session.start()
    t0 = time.perf_counter()
    n = topk_ids.shape[0] if n is None else min(n, topk_ids.shape[0])
    rows = topk_ids[:n].tolist()                 # the one device -> host read of the step
    if phase is None:
        phase = PREFILL if n > 1 else DECODE
    if index == 0:
        session.begin_forward(n, phase)
    timed = _Timed(kernel)
    out = _planned(session, index, layer, timed, x, topk_weights, topk_ids, rows, phase)
    if session.recorder is not None:
        session.recorder.add(index, rows, phase)
    session.host_s += time.perf_counter() - t0 - timed.seconds  # the step's own cost, kernel excluded
    if index == len(session.layers) - 1:
        session.end_forward()
    return out


def _planned(session, index, layer, kernel, x, topk_weights, topk_ids, rows, phase):
    table, pool, host = session.table, session.pool, session.hosts[index]
    plan = table.step(index, list(dict.fromkeys(chain.from_iterable(rows))), phase)
    base = index * session.num_experts
    pool.begin()
    for key, slot in plan.loads.items():
        session.h2d[phase][index] += pool.load(slot, host, key - base)
    resident = {key - base: slot for key, slot in chain(plan.hits.items(), plan.loads.items())}
    bypass = [key - base for key in plan.bypasses]
    staging = pool.staging_ids
    rounds = [bypass[i:i + len(staging)] for i in range(0, len(bypass), len(staging))] or [[]]
    out = None
    for r, extra in enumerate(rounds):
        mapping = dict(resident) if r == 0 else {}
        for expert, slot in zip(extra, staging):
            session.h2d[phase][index] += pool.load(slot, host, expert)
            mapping[expert] = slot
        pool.ready()
        if len(rounds) == 1:  # the plain single call: vLLM's own arithmetic
            y = kernel(x, topk_weights, session.slot_map.ids(index, mapping, topk_ids))
        else:
            ids = _lut(mapping, session.num_experts, topk_ids.device)[topk_ids.long()].to(topk_ids.dtype)
            inside = _inside(mapping, session.num_experts, topk_ids.device)[topk_ids.long()]
            y = kernel(x, topk_weights * inside.to(topk_weights.dtype), ids)
        out = y if out is None else out + y
        if r + 1 < len(rounds):
            pool.begin()  # the next round's loads wait for this round's kernel
    return out


class _Timed:
    """The kernel, with the wall time spent in it (on CUDA: launch time; the host cost is what counts)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.seconds = kernel, 0.0

    def __call__(self, *args):
        t = time.perf_counter()
        out = self.kernel(*args)
        self.seconds += time.perf_counter() - t
        return out


class SlotMap:
    """Expert id -> slot per layer, kept across steps: a step writes only the entries that
    changed (its loads and staged experts), so an all-hit step costs one gather.

    ``known`` (Python lists, cheap to compare) is the map as last written; ``table`` int32
    [L, E] on the device is what the gather reads. Entries of experts not in the current
    step may be stale, but they always name a valid slot (padding rows read them; their
    output is discarded). A fresh lookup table per step cost ~100 us per layer step on the CPU.
    """

    def __init__(self, layers: int, num_experts: int, device) -> None:
        self.known = [[0] * num_experts for _ in range(layers)]
        self.table = torch.zeros((layers, num_experts), dtype=torch.int32, device=device)
        self.rows = list(self.table)  # per-layer views, made once
        # on the CPU, numpy views of the same memory: element writes without a torch op each
        self.host_rows = [r.numpy() for r in self.rows] if self.table.device.type == "cpu" else None

    def ids(self, layer: int, mapping: dict[int, int], topk_ids: torch.Tensor) -> torch.Tensor:
        """``topk_ids`` [T, K] int32 expert ids -> slot ids, with ``mapping`` (expert -> slot) applied."""
        known = self.known[layer]
        changed = [e for e, s in mapping.items() if known[e] != s]
        if changed:
            slots = [mapping[e] for e in changed]
            for e, s in zip(changed, slots):
                known[e] = s
            if self.host_rows is not None:
                self.host_rows[layer][changed] = slots
            else:  # one small host -> device copy, ordered on the compute stream before the gather
                row = self.rows[layer]
                row[changed] = torch.tensor(slots, dtype=torch.int32).to(row.device, non_blocking=True)
        return self.rows[layer][topk_ids].to(topk_ids.dtype)


def _lut(mapping: dict[int, int], num_experts: int, device) -> torch.Tensor:
    """Expert id -> slot; experts outside ``mapping`` (padding rows, other rounds) -> slot 0."""
    lut = torch.zeros(num_experts, dtype=torch.long)
    if mapping:
        lut[list(mapping)] = torch.tensor(list(mapping.values()), dtype=torch.long)
    return lut.to(device, non_blocking=True)


def _inside(mapping: dict[int, int], num_experts: int, device) -> torch.Tensor:
    mask = torch.zeros(num_experts, dtype=torch.bool)
    mask[list(mapping)] = True
    return mask.to(device, non_blocking=True)


def _warmup_ids(topk_ids: torch.Tensor, pool) -> torch.Tensor:
    """Any valid slot per id: warm-up output is discarded, only shapes and timing matter."""
    return torch.remainder(topk_ids, pool.slots + pool.staging).to(topk_ids.dtype)
