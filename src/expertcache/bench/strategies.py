"""What the benchmark runs side by side: baselines and the cache, as configurations.

Baselines are configurations, not separate code (docs/architecture.md). ``resident``,
``copy-every-pass`` and ``cpu`` are ``CacheConfig`` baselines the runtime already
knows; a cache strategy is one (policy, slots) pair; ``belady`` is the cache with
the offline optimum, which only a replayed trace makes possible. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import BASELINES, CacheConfig  # noqa: F401  (BASELINES: re-exported for bench/)
from ..sim.mrc import OPTIMUM  # noqa: F401  (re-exported for bench/)
from ..sim.replay import ReplayPolicy, resolve_policy


@dataclass(frozen=True)
class Strategy:
    """One column of the benchmark. ``kind`` is a baseline name, ``cache`` or ``belady``;
    ``spec`` the resolved policies of a cache (both ``PolicySpec``s and the label)."""

    kind: str
    slots: int | None = None
    spec: ReplayPolicy | None = None

    @property
    def name(self) -> str:
        """Row name in tables and the JSON ``strategy`` field."""
        return self.kind

    @property
    def eviction(self) -> str | None:
        return None if self.spec is None else self.spec.eviction

    @property
    def label(self) -> str:
        """What the user asked for, e.g. "default (next-use)"."""
        return "" if self.spec is None else self.spec.label

    @property
    def policy(self) -> str | None:
        """The JSON ``policy`` field: the policy label for caches, None for baselines."""
        if self.kind == "cache":
            return self.label
        return OPTIMUM if self.kind == OPTIMUM else None

    @property
    def title(self) -> str:
        return self.kind if self.slots is None else f"{self.policy} @ {self.slots}"

    def config(self, partition: str = "global") -> CacheConfig:
        """The runtime configuration (belady runs as lru here; the bench swaps in the oracle table).
        The host planner always: the policy decides each step as it runs, which the oracle table
        and the simulator's replay assume (planner='auto' would take the lagged device planner
        on CUDA)."""
        if self.kind in BASELINES:
            return CacheConfig(baseline=self.kind, partition=partition, planner="host")
        if self.kind == OPTIMUM:
            return CacheConfig(slots=self.slots, eviction="lru", partition=partition, planner="host")
        return CacheConfig(slots=self.slots, eviction=self.spec.spec.eviction,
                           admission=self.spec.spec.admission, partition=partition, planner="host")

    @property
    def sim_policy(self) -> ReplayPolicy:
        """What ``replay`` runs for the same configuration (resolved once, passed as is)."""
        return self.spec


def plan(policies: list[str], slots: list[int], *, baselines=BASELINES,
         optimum: bool = True) -> list[Strategy]:
    """Baselines first (those named, in the usual order), then every policy at every size,
    then belady at every size."""
    if not slots and policies:
        raise ValueError("give at least one slot count for the cache strategies")
    out = [Strategy(b) for b in BASELINES if b in baselines]
    for spec in policies:
        if str(spec).strip() == OPTIMUM:
            continue  # belady is added once below, not as a causal policy
        resolved = resolve_policy(spec)
        out += [Strategy("cache", n, resolved) for n in slots]
    if optimum:
        oracle = resolve_policy(OPTIMUM)
        out += [Strategy(OPTIMUM, n, oracle) for n in slots]
    return out


def default_policy() -> str:
    """``default`` when that policy is registered (the researched one), else ``lru``."""
    from ..policies.registry import eviction_policies
    return "default" if "default" in eviction_policies() else "lru"
