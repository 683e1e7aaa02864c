"""``run_bench``: the whole benchmark from plain options; ``expertcache bench`` calls it.

Picks the workload (trace file, synthetic preset or the built-in trace), turns policies
x sizes into strategies, checks every cache size against the trace before any weight is
built, runs every strategy (``run.run_strategies``, torch) and returns the JSON document
with its self-checks (``checks``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from .strategies import BASELINES

FRACTIONS = (0.125, 0.25, 0.5)  # default cache sizes: shares of all L x E experts


def run_bench(*, trace: str | Path | None = None, preset: str | None = None, tokens: int | None = 256,
              layers: int | None = None, scale: float = 0.125, dtype: str = "bf16",
              policies: Sequence[str] | None = None, slots: Sequence[int] | None = None,
              fractions: Sequence[float] = FRACTIONS, partition: str = "global",
              baselines: Sequence[str] = BASELINES, belady: bool = True, device: str = "auto",
              hardware: str | None = "calibrate", threads: int | None = None, clock: str = "auto",
              seed: int = 0, progress: Callable[[str], None] = lambda _msg: None) -> dict:
    """Run the benchmark and return its document (what ``bench --json`` writes).

    ``policies`` default to ``default`` (else ``lru``); ``slots`` are total slot counts, else
    ``fractions`` of all experts; ``hardware``: ``calibrate`` (measure here), a preset name,
    a profile JSON path, or None for no predictions."""
    from ..sim.replay import check_table, slots_for_fraction
    from .strategies import default_policy, plan
    from .workload import load_workload

    bad = [b for b in baselines if b not in BASELINES]
    if bad:
        raise ValueError(f"unknown baseline(s) {', '.join(bad)}; use {', '.join(BASELINES)} or 'none'")
    tr, model = load_workload(trace, preset, tokens, layers, seed)
    sizes = list(slots) if slots else [slots_for_fraction(tr, f) for f in fractions]
    strategies = plan(list(policies or [default_policy()]), sorted(set(sizes)), baselines=baselines,
                      optimum=belady)
    for s in strategies:  # bad sizes (below top-k, ...) fail before any weight is built
        if s.slots is not None:
            check_table(tr, s.sim_policy, s.slots, partition)
    from .run import run_strategies  # torch: imported only once the options are known good

    result = run_strategies(tr, model, strategies, scale=scale, dtype=dtype, device=device,
                            partition=partition, hardware=hardware, seed=seed, threads=threads,
                            clock=clock, progress=progress)
    doc = _document(result, scale)
    total = tr.num_layers * tr.num_experts
    over = sorted({n for n in sizes if n > total})
    if over:  # the runtime's pool never holds more slots than experts (costmodel.pool.cap_slots)
        doc.setdefault("notes", []).append(
            f"--slots {','.join(map(str, over))} above the {total} experts ({tr.num_layers} x "
            f"{tr.num_experts}): the pool holds {total}, every expert resident")
    return doc


def _document(result, scale: float) -> dict:
    from .checks import run_checks
    from .report import document, row

    doc = document(result, [row(r, result) for r in result.runs])
    doc["scale"] = scale
    doc["checks"] = run_checks(result)
    return doc
