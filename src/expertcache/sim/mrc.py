"""Sweeps: many policies at many sizes, as fast as exactness allows.

Plain ``lru`` gets every size from one stack-distance pass; ``fifo``, ``slru``, ``arc``, ``lfu``,
``s3fifo``, ``belady`` and lru / fifo with second-hit or window admission run exact numba
kernels per size; every other policy (including
third-party entry-point policies) replays through ``SlotTable`` in worker
processes, one job per (policy, size).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

import numpy as np

from ..stats import Stats
from ..trace.format import Trace
from .replay import (PolicySpec, Prepared, ReplayResult, check_table, fast_counts, has_kernel,
                     kernel_fits, lru_all_sizes, resolve_policy, table_replay)

OPTIMUM = "belady"

_WORKER: Prepared | None = None  # the trace inside a worker process


def sweep(trace: Trace | Prepared, policies: Sequence[str], slots_list: Sequence[int],
          partition: str = "global", *, workers: int | None = None,
          progress: Callable[[int, int], None] | None = None) -> list[ReplayResult]:
    """Every policy spec at every size; results in (policy, size) order.

    ``progress(done, total)`` is called as jobs finish (the CLI draws a bar).
    """
    prep = trace if isinstance(trace, Prepared) else Prepared(trace)
    specs = [resolve_policy(p) for p in policies]
    slots_list = list(dict.fromkeys(int(s) for s in slots_list))
    if not specs or not slots_list:
        raise ValueError("a sweep needs at least one policy and one size")
    for spec in specs:  # fail fast on bad sizes or parameters, before any work
        for slots in slots_list:
            check_table(prep.trace, spec, slots, partition)
    fits = kernel_fits(prep)
    slow = [(i, slots) for i, spec in enumerate(specs) if not (fits and _fast(spec))
            for slots in slots_list]
    done: dict[tuple[int, int], ReplayResult] = {}
    total, tick = len(specs) * len(slots_list), _ticker(progress, len(specs) * len(slots_list))
    pool = _pool(prep, workers, len(slow))
    try:
        futures = {pool.submit(_table_job, specs[i], slots, partition): (i, slots)
                   for i, slots in slow} if pool else {}
        for i, spec in enumerate(specs):  # fast ones here while the pool works
            if fits and _fast(spec):
                for r in _fast_results(prep, spec, slots_list, partition):
                    done[i, r.slots] = r
                    tick()
        if pool:
            for fut in as_completed(futures):
                done[futures[fut]] = fut.result()
                tick()
        else:
            for i, slots in slow:
                done[i, slots] = _table_result(prep, specs[i], slots, partition)
                tick()
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    assert len(done) == total
    return [done[i, s] for i in range(len(specs)) for s in slots_list]


def optimum_misses(prep: Prepared, slots_list: Sequence[int], partition: str) -> dict[int, int]:
    """Belady's misses at each size: the ``opt_misses`` every result is compared with."""
    spec = resolve_policy(OPTIMUM)
    if not kernel_fits(prep):
        return {s: _table_result(prep, spec, s, partition).misses for s in slots_list}
    return {r.slots: r.misses for r in _fast_results(prep, spec, slots_list, partition)}


def sweep_sizes(trace: Trace, partition: str, points: int) -> list[int]:
    """``points`` evenly spaced sizes from the smallest legal one to every expert resident."""
    if points < 2:
        raise ValueError(f"a miss-ratio curve needs at least 2 points, got {points}")
    L, E, k = trace.num_layers, trace.num_experts, trace.top_k
    top = L * E if partition == "global" else E
    caps = np.unique(np.round(np.linspace(k, top, points)).astype(int))
    return [int(c) * (1 if partition == "global" else L) for c in caps]


# -- jobs -----------------------------------------------------------------------
def _fast(spec: PolicySpec) -> bool:
    return has_kernel(spec)


def _fast_results(prep: Prepared, spec: PolicySpec, slots_list, partition) -> list[ReplayResult]:
    if (spec.eviction, spec.admission) == ("lru", "always"):
        out = lru_all_sizes(prep, slots_list, partition)
    else:
        out = []
        for slots in slots_list:
            counts, engine = fast_counts(prep, spec, slots, partition)
            out.append(ReplayResult(spec.eviction, spec.admission, partition, slots,
                                    Stats(counts.tolist()), engine, spec.label))
    for r in out:
        r.label = spec.label
    return out


def _table_result(prep: Prepared, spec: PolicySpec, slots: int, partition: str) -> ReplayResult:
    table = check_table(prep.trace, spec, slots, partition)
    stats = table_replay(prep, table)
    return ReplayResult(spec.eviction, spec.admission, partition, slots, stats, "table", spec.label)


def _table_job(spec: PolicySpec, slots: int, partition: str) -> ReplayResult:
    return _table_result(_WORKER, spec, slots, partition)


def _init_worker(experts, meta, phase, order) -> None:
    global _WORKER
    _WORKER = Prepared(Trace(experts, meta, None, phase), order)


def _pool(prep: Prepared, workers: int | None, jobs: int) -> ProcessPoolExecutor | None:
    """Worker processes for SlotTable jobs; None when one process is enough."""
    workers = min(workers or os.cpu_count() or 1, jobs)
    if workers <= 1:
        return None
    tr = prep.trace
    return ProcessPoolExecutor(workers, initializer=_init_worker,
                               initargs=(tr.experts, tr.meta, tr.phase, prep.order))


def _ticker(progress, total):
    count = [0]

    def tick():
        count[0] += 1
        if progress:
            progress(count[0], total)
    return tick
