"""Live-run counters: the SlotTable's hit/miss counts plus the bytes copied host -> device."""

from __future__ import annotations

from ..sizes import format_size
from ..stats import DECODE, FIELDS, PREFILL, Stats, format_table, phase_code


class LiveStats(Stats):
    """``Stats`` plus ``h2d_bytes`` per phase and layer (expert weights copied into slots)."""

    def __init__(self, table_stats: Stats, h2d: list[list[int]], pool: dict | None = None) -> None:
        raw = [[[getattr(table_stats.layer(layer, phase), f) for f in FIELDS]
                for layer in range(table_stats.num_layers)] for phase in (PREFILL, DECODE)]
        super().__init__(raw)
        self._h2d = [list(row) for row in h2d]
        # how the pool holds experts: slot format, bytes per slot and per load, where the host
        # experts live ('pinned', 'copy' or 'mmap') and why
        self.pool = dict(pool or {})

    def h2d_bytes(self, phase: int | str | None = None, layer: int | None = None) -> int:
        phases = (PREFILL, DECODE) if phase is None else (phase_code(phase),)
        layers = range(self.num_layers) if layer is None else (layer,)
        return sum(self._h2d[p][l] for p in phases for l in layers)

    def since(self, earlier: LiveStats) -> LiveStats:
        """Counters and bytes added after ``earlier`` (e.g. one request's share)."""
        h2d = [[now - before for now, before in zip(a, b)] for a, b in zip(self._h2d, earlier._h2d)]
        return LiveStats(super().since(earlier), h2d, self.pool)

    def __str__(self) -> str:
        h2d = [format_size(self.h2d_bytes(p)) for p in (PREFILL, DECODE, None)]
        table = format_table(self.rows(), f"{self.num_layers} MoE layers; .layer(i, phase) for one layer, "
                                          ".to_dict() for JSON", {"H2D": h2d})
        if not self.pool:
            return table
        p = self.pool
        tier = f"\n{p['tier_summary']}" if "tier_summary" in p else ""
        return (f"{table}\nslots: {p['slot_format']}, {format_size(p['bytes_per_slot'])} each, "
                f"{format_size(p['bytes_per_load'])} per load; host experts: {p['host_memory']} "
                f"({p['host_memory_reason']}){tier}"
                + (f"\nexpert kernel: {p['expert_kernel']} ({p['expert_kernel_reason']})" if "expert_kernel" in p else ""))

    __repr__ = __str__

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["pool"] = self.pool
        out["total"]["h2d_bytes"] = self.h2d_bytes()
        out["prefill"]["h2d_bytes"] = self.h2d_bytes(PREFILL)
        out["decode"]["h2d_bytes"] = self.h2d_bytes(DECODE)
        for row in out["layers"]:
            row["prefill"]["h2d_bytes"] = self.h2d_bytes(PREFILL, row["layer"])
            row["decode"]["h2d_bytes"] = self.h2d_bytes(DECODE, row["layer"])
        return out
