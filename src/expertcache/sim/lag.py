"""``expertcache sim --lag N``: replay a trace as ``planner="device"`` runs it, the policy N
forwards behind the device.

The same ``expertcache.lagged.LaggedTable`` the runtime drives (torch-free), fed the
trace's rows (a row = one forward, one step per layer) in the runtime's order:

- a decode row: ``begin()`` applies the decisions of the rows at least ``lag`` rows old,
  then the row is counted against the device's map as it then stands (``observe``);
- a prefill row: every pending decision first (``flush``), then the table plans each
  layer's step itself, as the host path does (lag 0).

Lag 0 is the ordinary replay (``sim/replay.py``). Counts are the device's (module doc of
``lagged.py``); a live run with the same trace, policy, size and lag counts the same, as
long as every decode batch fits the staging rows (otherwise the runtime plans that forward
on the host). Bytes: every miss is one expert copied into a staging row; a load is copied
from the staging row that still holds it, else once more from the host. A step is taken to
write its whole staging block (the fixed-width copy; rows past its misses then hold nothing
usable), as the runtime counts when batch x top-k fills the block.

Speed: the table's decisions do not depend on the lag (it steps through the same steps in
the same order, only later), so for a built-in policy one compiled replay logs them and
``sim/lagkernel.py`` replays the device from that log for every lag (tested equal to
``LaggedTable``); plug-in policies step ``LaggedTable`` itself, in Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..lagged import LaggedTable
from ..stats import PREFILL, Stats
from .replay import (Prepared, ReplayPolicy, check_size, check_table, kernel_for, replay,
                     resolve_policy, run_kernel)


@dataclass
class LagResult:
    label: str
    partition: str
    slots: int
    lag: int
    stats: Stats
    staged: int          # misses copied into staging rows (lag 0: every miss, one copy)
    staging_loads: int   # loads copied from a staging row (a device copy)
    host_loads: int      # loads copied from the host a second time
    planned: int         # misses of host-planned steps (prefill; every step at lag 0): one copy each
    spec: ReplayPolicy | None = None  # the policies as run
    engine: str = "table"             # "lagged-kernel": the compiled log; "table": LaggedTable

    @property
    def host_copies(self) -> int:
        """Experts copied from the host in all."""
        return self.staged + self.host_loads + self.planned

    def to_dict(self) -> dict:
        total, decode = self.stats.total(), self.stats.total("decode")
        return {"policy": self.label, "partition": self.partition, "slots": self.slots, "lag": self.lag,
                "hit_rate": total.hit_rate, "decode_hit_rate": decode.hit_rate,
                "accesses": total.accesses, "misses": total.misses, "loads": total.loads,
                "staged": self.staged, "staging_loads": self.staging_loads,
                "host_loads": self.host_loads, "planned": self.planned, "host_copies": self.host_copies}


def lag_replay(trace, policy, slots: int, partition: str = "global", lag: int = 1,
               staging: int | None = None, blocks: int = 1, engine: str = "auto") -> LagResult:
    """Replay ``trace`` (a ``Trace`` or ``Prepared``) under ``policy`` with the policy ``lag``
    forwards behind. ``staging``: the device's staging rows per block (default: the widest
    decode step); ``blocks``: staging blocks, layer l using block l % blocks (1: one block all
    layers share; L: one per layer, so every load finds its staging row). ``engine``: 'auto'
    (the compiled log where the policy is a built-in), 'table' (``LaggedTable`` step by step)."""
    return lag_replays(trace, policy, slots, partition, [lag], staging, blocks, engine)[0]


def lag_replays(trace, policy, slots: int, partition: str, lags: Sequence[int],
                staging: int | None = None, blocks: int = 1, engine: str = "auto") -> list[LagResult]:
    """``lag_replay`` at every lag in ``lags``; a built-in policy's table is replayed once."""
    prep = trace if isinstance(trace, Prepared) else Prepared(trace)
    spec = resolve_policy(policy)
    for lag in lags:
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
            raise ValueError(f"lag must be a whole number of forwards >= 0, got {lag!r}")
    check_blocks(blocks, prep.L)
    if engine not in ("auto", "table"):
        raise ValueError(f"unknown engine {engine!r}; use auto or table")
    if staging is None:
        staging = widest_decode_step(prep)
    kernel = kernel_for(prep, spec) if engine == "auto" else None
    if kernel is not None:
        return _kernel_lags(prep, spec, kernel, slots, partition, lags, staging, blocks)
    return [_table_lag(prep, spec, slots, partition, lag, staging, blocks) for lag in lags]


def check_blocks(blocks: int, layers: int, name: str = "staging blocks") -> None:
    """Staging blocks: 1 (all layers share the rows) to one per layer."""
    if isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks <= layers:
        raise ValueError(f"{name} must be a whole number in 1..{layers} (1: every layer shares "
                         f"the staging rows; {layers}: one block per layer), got {blocks!r}")


def widest_decode_step(prep: Prepared) -> int:
    """Most experts one decode step needs (the device's staging rows per block); 1 if none."""
    wide = (prep.keys >= 0).sum(axis=1).reshape(-1, prep.L)            # [R, L]
    decode = np.asarray(prep.row_phases) != PREFILL
    return int(wide[decode].max()) if decode.any() else 1


def _kernel_lags(prep: Prepared, spec: ReplayPolicy, kernel, slots: int, partition: str,
                 lags: Sequence[int], staging: int, blocks: int) -> list[LagResult]:
    from .lagkernel import lagged_counts
    cap = check_size(prep.trace, spec, slots, partition)
    parts = 1 if partition == "global" else prep.L
    log = np.empty(prep.keys.shape, np.int32)
    plain = Stats(run_kernel(prep, kernel, spec, parts, cap, log).tolist())
    row_phase = np.asarray(prep.row_phases, np.uint8)
    out = []
    for lag in lags:
        if lag == 0:  # the plain replay: every miss planned on the host, one copy each
            out.append(LagResult(spec.label, partition, slots, 0, plain, 0, 0, 0, plain.total().misses,
                                 spec, "lagged-kernel"))
            continue
        counts, (staged, staging_loads, host_loads) = lagged_counts(
            prep.keys, row_phase, log, prep.L, prep.L * prep.E, parts, cap, lag, staging, blocks)
        stats = Stats(counts.tolist())
        out.append(LagResult(spec.label, partition, slots, lag, stats, int(staged), int(staging_loads),
                             int(host_loads), stats.total("prefill").misses, spec, "lagged-kernel"))
    return out


def _table_lag(prep: Prepared, spec: ReplayPolicy, slots: int, partition: str, lag: int,
               staging: int, blocks: int) -> LagResult:
    if lag == 0:  # the plain replay (a compiled kernel where one applies)
        stats = replay(prep, spec, slots, partition).stats
        return LagResult(spec.label, partition, slots, 0, stats, 0, 0, 0, stats.total().misses, spec)
    table = check_table(prep.trace, spec, slots, partition)
    if table.needs_future:
        table.bind_future(prep.future())
    lagged = LaggedTable(table, lag, staging * blocks, blocks)
    replay_rows(lagged, prep.step_lists, prep.row_phases)
    stats = lagged.stats()
    return LagResult(spec.label, partition, slots, lag, stats, lagged.staged, lagged.staging_loads,
                     lagged.host_loads, stats.total("prefill").misses, spec)


def replay_rows(lagged: LaggedTable, rows: Sequence[Sequence[Sequence[int]]], phases: Sequence[int]) -> None:
    """Drive ``lagged`` through rows (per row, per layer: unique experts in rank order)."""
    for row, phase in zip(rows, phases):
        if phase == PREFILL:
            lagged.flush()
            for layer, experts in enumerate(row):
                lagged.host_step(layer, experts, phase)
        else:
            lagged.begin()
            lagged.observe(row, phase, lagged.width)  # a step writes its whole staging block
