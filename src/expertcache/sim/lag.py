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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..lagged import LaggedTable
from ..stats import PREFILL, Stats
from .replay import Prepared, check_table, replay, resolve_policy


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
               staging: int | None = None, blocks: int = 1) -> LagResult:
    """Replay ``trace`` (a ``Trace`` or ``Prepared``) under ``policy`` with the policy ``lag``
    forwards behind. ``staging``: the device's staging rows per block (default: the widest
    decode step); ``blocks``: staging blocks, layer l using block l % blocks (1: one block all
    layers share; L: one per layer, so every load finds its staging row)."""
    prep = trace if isinstance(trace, Prepared) else Prepared(trace)
    spec = resolve_policy(policy)
    if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
        raise ValueError(f"lag must be a whole number of forwards >= 0, got {lag!r}")
    if lag == 0:  # the plain replay (a compiled kernel where one applies)
        stats = replay(prep, spec, slots, partition).stats
        return LagResult(spec.label, partition, slots, 0, stats, 0, 0, 0, stats.total().misses)
    table = check_table(prep.trace, spec, slots, partition)
    if table.needs_future:
        table.bind_future(prep.future())
    rows, phases = prep.step_lists, prep.row_phases
    if staging is None:
        staging = max((len(s) for row, p in zip(rows, phases) if p != PREFILL for s in row), default=1)
    lagged = LaggedTable(table, lag, staging * blocks, blocks)
    replay_rows(lagged, rows, phases)
    stats = lagged.stats()
    return LagResult(spec.label, partition, slots, lag, stats, lagged.staged, lagged.staging_loads,
                     lagged.host_loads, stats.total("prefill").misses)


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

