"""Sweeps: many policies at many sizes, as fast as exactness allows.

Plain ``lru`` at several sizes gets every size from one stack-distance pass; every
policy with a kernel (``policies.kernels``) runs it per size; every other policy
(including third-party entry-point policies) replays through ``SlotTable`` in
worker processes, one job per (policy, size). Policy names are resolved and every
size validated once, before any work.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

import numpy as np

from ..policies.admission import Always
from ..policies.belady import Belady
from ..trace.format import Trace
from .replay import (ReplayPolicy, Prepared, ReplayResult, check_size, check_table, kernel_for,
                     kernel_result, lru_all_sizes, resolve_policy, table_replay)

OPTIMUM = Belady.name
# MIN with bypass: the optimum of a cache that may serve a miss without caching it (no
# more misses than forced-admission Belady; the lower of the two is ``opt_misses``).
BYPASS_OPTIMUM = f"{Belady.name}+oracle"
OPTIMA = ((OPTIMUM, "always"), (OPTIMUM, "oracle"))
STACK_SIZES = 3  # from this many LRU sizes on, one stack-distance pass beats a kernel per size

_WORKER: Prepared | None = None  # the trace inside a worker process


def sweep(trace: Trace | Prepared, policies: Sequence[str | ReplayPolicy],
          slots_list: Sequence[int], partition: str = "global", *, workers: int | None = None,
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
            check_size(prep.trace, spec, slots, partition)
    kernels = [kernel_for(prep, spec) for spec in specs]
    slow = [(i, slots) for i, k in enumerate(kernels) if k is None for slots in slots_list]
    done: dict[tuple[int, int], ReplayResult] = {}
    total, tick = len(specs) * len(slots_list), _ticker(progress, len(specs) * len(slots_list))
    pool = _pool(prep, workers, len(slow))
    try:
        futures = {pool.submit(_table_job, specs[i], slots, partition): (i, slots)
                   for i, slots in slow} if pool else {}
        for i, (spec, kernel) in enumerate(zip(specs, kernels)):  # kernels here meanwhile
            if kernel is not None:
                for r in _kernel_results(prep, spec, kernel, slots_list, partition):
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


def optimum_misses(prep: Prepared, slots_list: Sequence[int], partition: str,
                   done: Sequence[ReplayResult] = ()) -> dict[int, int]:
    """The ``opt_misses`` every result is compared with: at each size the lower of Belady's
    (forced admission) and MIN with bypass's misses; runs of either already in ``done``
    are reused."""
    have = {(r.policy, r.admission, r.slots): r.misses for r in done
            if (r.policy, r.admission) in OPTIMA}
    for policy, admission in OPTIMA:
        missing = [s for s in slots_list if (policy, admission, s) not in have]
        if missing:
            name = OPTIMUM if admission == "always" else BYPASS_OPTIMUM
            for r in sweep(prep, [name], missing, partition, workers=1):
                have[policy, admission, r.slots] = r.misses
    return {s: min(have[p, a, s] for p, a in OPTIMA) for s in slots_list}


def sweep_sizes(trace: Trace, partition: str, points: int) -> list[int]:
    """``points`` evenly spaced sizes from the smallest legal one to every expert resident."""
    if points < 2:
        raise ValueError(f"a miss-ratio curve needs at least 2 points, got {points}")
    L, E, k = trace.num_layers, trace.num_experts, trace.top_k
    top = L * E if partition == "global" else E
    caps = np.unique(np.round(np.linspace(k, top, points)).astype(int))
    return [int(c) * (1 if partition == "global" else L) for c in caps]


# -- jobs -----------------------------------------------------------------------
def _kernel_results(prep: Prepared, spec: ReplayPolicy, kernel, slots_list,
                    partition) -> list[ReplayResult]:
    if len(slots_list) >= STACK_SIZES and _plain_lru(spec):  # one pass for every size
        return lru_all_sizes(prep, slots_list, partition, spec)
    return [kernel_result(prep, spec, kernel, slots, partition) for slots in slots_list]


def _plain_lru(spec: ReplayPolicy) -> bool:
    """LRU (hits reorder) with admission always: what ``sim.stack`` answers at every size."""
    return (spec.eviction_cls.kernel == "lru" and spec.eviction_cls.reorders
            and spec.admission_cls.kernel == Always.kernel)


def _table_result(prep: Prepared, spec: ReplayPolicy, slots: int, partition: str) -> ReplayResult:
    stats = table_replay(prep, check_table(prep.trace, spec, slots, partition))
    return ReplayResult(spec.eviction, spec.admission, partition, slots, stats, "table", spec.label,
                        spec)


def _table_job(spec: ReplayPolicy, slots: int, partition: str) -> ReplayResult:
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
