"""The policy one forward behind: a ``SlotTable`` fed finished forwards, a mirror of the device.

With the step on the device (``runtime/devicestep.py``) the device decides hits itself, from
its slot map, and stages every miss; the host only learns a forward's routing after the
forward. ``LaggedTable`` keeps both worlds in step, torch-free, so that the runtime and the
simulator (``sim/lag.py``, ``expertcache sim --lag N``) run the same code:

- ``resident`` mirrors the device's slot map: key -> slot. It changes only between
  forwards, when updates are applied.
- ``observe(steps, phase)``: a finished forward's steps (per layer, the unique experts in
  rank order) are counted against ``resident``, as the device met them: a hit is a key in
  the map when its step ran; every miss was staged. The forward is queued.
- ``begin()``: at the start of a forward, every queued forward at least ``lag`` forwards
  old goes through the table's ``step()``, under the user's eviction and admission policy,
  and the net slot changes come back as ``Update``s (key, slot or -1, source staging row or
  -1 for the host) to apply on the device before the forward runs. With ``lag = 1``,
  forward t's decisions are in place for forward t + 1.
- ``host_step(layer, experts, phase)``: a step the host plans itself (prefill, or a batch
  too wide for the staging rows): ``flush()`` first, then the table's own plan (lag 0).

Counts per phase and layer (``stats()``, the ``Stats`` fields): accesses, hits and misses as
the device met them; loads and evictions the policy decided at that step (applied ``lag``
forwards later); bypasses the misses it did not admit. Host steps count the plan.

Bytes: every miss is one copy from the host into a staging row; a load is a device copy
from the staging row that still holds the key when the update is applied (staging rows are
shared by all layers: a later step may have reused it), else a second copy from the host
(``staging_loads`` / ``host_loads``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from .cache import SlotTable
from .stats import FIELDS, Stats

ACCESSES, HITS, MISSES, LOADS, EVICTIONS, BYPASSES = range(len(FIELDS))


class Update(tuple):
    """One slot change: ``(layer, expert, slot, source)``; slot -1 drops the expert from the
    map; source is the staging row to copy from, or -1 for the host store."""

    __slots__ = ()

    def __new__(cls, layer: int, expert: int, slot: int, source: int):
        return super().__new__(cls, (layer, expert, slot, source))


class LaggedTable:
    """``table`` driven ``lag`` forwards behind a device that stages its own misses.

    ``staging``: the device's staging rows (R), for the byte count; ``blocks``: they form that
    many blocks of R // blocks rows, layer l staging into block l % blocks (1: all layers
    share them; a block per layer: a forward's misses all survive to be loaded from there).
    """

    def __init__(self, table: SlotTable, lag: int = 1, staging: int = 0, blocks: int = 1) -> None:
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 1:
            raise ValueError(f"lag must be a whole number of forwards >= 1, got {lag!r}")
        self.table, self.lag = table, lag
        self.num_layers, self.num_experts = table.num_layers, table.num_experts
        self.resident: dict[int, int] = table.resident()  # the device's map: key -> slot
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1 or (staging and blocks > staging):
            raise ValueError(f"staging blocks must be a whole number in 1..{max(staging, 1)}, got {blocks!r}")
        self.staging: list[int | None] = [None] * staging  # key each staging row holds
        self.blocks, self.width = blocks, staging // blocks
        self._queue: deque = deque()                        # observed forwards, oldest first
        self._counts = [[[0] * len(FIELDS) for _ in range(self.num_layers)] for _ in range(2)]
        self.staging_loads = 0  # loads applied from a staging row (device copies)
        self.host_loads = 0     # loads applied from the host store (second copies)
        self.staged = 0         # misses copied into staging rows
        self.forwards = 0       # forwards observed

    # -- a forward on the device -----------------------------------------------------------
    def observe(self, steps: Sequence[Sequence[int]], phase: int, rows_written: int | None = None) -> None:
        """Count a finished device forward (``steps[layer]``: unique experts in rank order) and
        queue it for the table. ``rows_written``: staging rows each step wrote (the device's
        fixed width; rows past its misses then hold nothing known); None: only the misses'."""
        E = self.num_experts
        resident, counts, staging = self.resident, self._counts[phase], self.staging
        misses = []
        for layer, experts in enumerate(steps):
            base = layer * E
            missed = sorted(e for e in experts if base + e not in resident)  # device order: by id
            row = counts[layer]
            row[ACCESSES] += len(experts)
            row[HITS] += len(experts) - len(missed)
            row[MISSES] += len(missed)
            first = (layer % self.blocks) * self.width
            for r, e in enumerate(missed[:self.width]):
                staging[first + r] = base + e
            for r in range(len(missed), min(rows_written or 0, self.width)):
                staging[first + r] = None
            self.staged += len(missed)
            misses.append({base + e for e in missed})
        self._queue.append((phase, [list(s) for s in steps], misses))
        self.forwards += 1

    def begin(self) -> list[Update]:
        """At a forward's start: decide every queued forward ``lag`` or more forwards old;
        returns the slot changes to apply on the device first."""
        ready = len(self._queue) - self.lag + 1
        return self._decide(max(ready, 0))

    def flush(self) -> list[Update]:
        """Decide every queued forward now (before a host-planned forward)."""
        return self._decide(len(self._queue))

    def _decide(self, n: int) -> list[Update]:
        if n <= 0:
            return []
        table = self.table
        touched: dict[int, None] = {}
        for _ in range(n):
            phase, steps, misses = self._queue.popleft()
            counts = self._counts[phase]
            for layer, (experts, missed) in enumerate(zip(steps, misses)):
                plan = table._step(layer, dict.fromkeys(experts), phase)  # ids: a router's or a checked trace's
                row = counts[layer]
                row[LOADS] += len(plan.loads)
                row[EVICTIONS] += len(plan.evictions)
                row[BYPASSES] += len(missed) - len(missed.intersection(plan.loads))
                touched.update(dict.fromkeys(plan.evictions))
                touched.update(dict.fromkeys(plan.loads))
        return self._diff(touched)

    def _diff(self, touched: dict[int, None]) -> list[Update]:
        """The net changes between the device's map and the table, over the keys touched."""
        E, resident, slot_of = self.num_experts, self.resident, self.table.slot_of
        where = {key: r for r, key in enumerate(self.staging) if key is not None}
        updates = []
        for key in touched:
            new, old = slot_of(key), resident.get(key)
            if new == old:
                continue
            layer, expert = divmod(key, E)
            if new is None:
                del resident[key]
                updates.append(Update(layer, expert, -1, -1))
                continue
            resident[key] = new
            source = where.get(key, -1)
            if source >= 0:
                self.staging_loads += 1
            else:
                self.host_loads += 1
            updates.append(Update(layer, expert, new, source))
        return updates

    # -- a forward the host plans -----------------------------------------------------------
    def host_step(self, layer: int, experts: Sequence[int], phase: int):
        """The table's own plan for one step (call ``flush()`` before the forward): counted as
        planned; the mirror follows it at once. Returns the ``Plan``. The host path may stream
        bypasses through the staging rows, so none is trusted to hold a key any more."""
        plan = self.table.step(layer, experts, phase)
        self.staging[:] = [None] * len(self.staging)
        row = self._counts[phase][layer]
        row[ACCESSES] += len(plan.hits) + len(plan.loads) + len(plan.bypasses)
        row[HITS] += len(plan.hits)
        row[MISSES] += len(plan.loads) + len(plan.bypasses)
        row[LOADS] += len(plan.loads)
        row[EVICTIONS] += len(plan.evictions)
        row[BYPASSES] += len(plan.bypasses)
        for key in plan.evictions:
            self.resident.pop(key, None)
        self.resident.update(plan.loads)
        return plan

    # -- counters ---------------------------------------------------------------------------
    def stats(self) -> Stats:
        return Stats(self._counts)

    def reset_stats(self) -> None:
        for phase in self._counts:
            for row in phase:
                row[:] = [0] * len(FIELDS)
        self.staging_loads = self.host_loads = self.staged = 0

    @property
    def pending(self) -> int:
        """Forwards observed but not yet decided."""
        return len(self._queue)
