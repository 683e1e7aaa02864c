"""Cache counters per layer and per phase (prefill / decode), with derived rates."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

PREFILL, DECODE = 0, 1  # same codes as a trace's ``phase`` array (0 prompt, 1 generation)
PHASES = {"prefill": PREFILL, "decode": DECODE}
FIELDS = ("accesses", "hits", "misses", "loads", "evictions", "bypasses")


def phase_code(phase: int | str) -> int:
    """Accept 0/1 or 'prefill'/'decode' (also 'prompt'/'generation')."""
    if isinstance(phase, str):
        name = {"prompt": "prefill", "generation": "decode"}.get(phase, phase)
        if name in PHASES:
            return PHASES[name]
    elif phase in (PREFILL, DECODE):
        return int(phase)
    raise ValueError(f"unknown phase {phase!r}; use 'prefill' (0) or 'decode' (1)")


@dataclass
class Counts:
    accesses: int = 0
    hits: int = 0
    misses: int = 0
    loads: int = 0
    evictions: int = 0
    bypasses: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    def __add__(self, other: Counts) -> Counts:
        return Counts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}


class Stats:
    """A snapshot of counters: ``raw[phase][layer]`` is a list in ``FIELDS`` order."""

    def __init__(self, raw: list[list[list[int]]]) -> None:
        self._raw = [[list(row) for row in phase] for phase in raw]

    @property
    def num_layers(self) -> int:
        return len(self._raw[0])

    def layer(self, layer: int, phase: int | str | None = None) -> Counts:
        phases = (PREFILL, DECODE) if phase is None else (phase_code(phase),)
        total = Counts()
        for p in phases:
            total = total + Counts(*self._raw[p][layer])
        return total

    def total(self, phase: int | str | None = None) -> Counts:
        total = Counts()
        for layer in range(self.num_layers):
            total = total + self.layer(layer, phase)
        return total

    def sums(self, phase: int | str) -> dict[str, int]:
        """Totals of one phase over all layers, cheaply (per-forward snapshots use it)."""
        return dict(zip(FIELDS, map(sum, zip(*self._raw[phase_code(phase)]))))

    def since(self, earlier: Stats) -> Stats:
        """The counts added after ``earlier`` (a snapshot of the same table)."""
        return Stats(_minus(self._raw, earlier._raw))

    def rows(self) -> list[tuple[str, Counts]]:
        return [("prefill", self.total(PREFILL)), ("decode", self.total(DECODE)), ("total", self.total())]

    def __str__(self) -> str:
        return format_table(self.rows(), f"{self.num_layers} layers; .layer(i, phase) for one layer")

    __repr__ = __str__

    def to_dict(self) -> dict:
        """JSON-ready: totals, per phase, and per layer per phase."""
        return {
            "total": self.total().to_dict(),
            "prefill": self.total(PREFILL).to_dict(),
            "decode": self.total(DECODE).to_dict(),
            "layers": [
                {"layer": layer,
                 "prefill": self.layer(layer, PREFILL).to_dict(),
                 "decode": self.layer(layer, DECODE).to_dict()}
                for layer in range(self.num_layers)
            ],
        }


def _minus(now: list, before: list) -> list:
    if isinstance(now, list):
        return [_minus(a, b) for a, b in zip(now, before)]
    return now - before


def format_table(rows: list[tuple[str, Counts]], note: str, extra: dict[str, list[str]] | None = None) -> str:
    """A plain-text table of counters, one row per label; ``extra`` adds columns (already formatted)."""
    extra = extra or {}
    head = ["", *FIELDS, "hit rate", *extra]
    body = [[label, *(str(getattr(c, f)) for f in FIELDS), f"{c.hit_rate:.3f}",
             *(col[i] for col in extra.values())] for i, (label, c) in enumerate(rows)]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                       enumerate(zip(r, widths))) for r in [head, *body]]
    return "\n".join([*lines, f"({note})"])
