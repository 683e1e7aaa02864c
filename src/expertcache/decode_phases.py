"""Decode phases of a run: cold start, warm-up and steady state.

Over the N decode tokens of a run, in order:

* cold: tokens ``0 .. 15`` (the cache starts empty, nearly every expert misses);
* warm-up: tokens ``16 .. N/4 - 1`` (the cache fills, hit rate still rising);
* steady: tokens ``N/4 .. N - 1`` (the figure that decides throughput).

A phase with no tokens (short runs) reports None. Torch-free and at the bottom of the
package, so the bench (``bench/``) and ``generate`` (``runtime/generate.py``) split a run
the same way from one definition.
"""

from __future__ import annotations

from collections.abc import Sequence

COLD_TOKENS = 16  # the cache starts empty: these decode tokens mostly miss
PHASES = ("cold", "warm", "steady")


def bounds(n: int) -> dict[str, range]:
    """Token index ranges of each phase for a run of ``n`` decode tokens."""
    cold_end = min(COLD_TOKENS, n)
    warm_end = max(cold_end, n // 4)
    return {"cold": range(0, cold_end), "warm": range(cold_end, warm_end),
            "steady": range(warm_end, n)}


def ms_per_token(seconds: Sequence[float]) -> dict[str, float | None]:
    """Mean milliseconds per token in each phase (mean, not median: throughput counts spikes)."""
    out = {}
    for name, idx in bounds(len(seconds)).items():
        out[name] = 1e3 * sum(seconds[i] for i in idx) / len(idx) if len(idx) else None
    return out


def steady_start(n: int) -> int:
    return bounds(n)["steady"].start


def steady_blocks(seconds: Sequence[float], blocks: int = 4) -> list[float]:
    """Mean ms per token of ``blocks`` consecutive equal parts of the steady phase.

    One mean hides how much it moved: on a shared CPU two strategies a few percent apart
    swap places between runs. The blocks' range is the spread a verdict must clear
    before it calls one strategy faster than another."""
    steady = list(seconds)[steady_start(len(seconds)):]
    n = min(blocks, len(steady))
    edges = [round(i * len(steady) / n) for i in range(n + 1)] if n else []
    return [1e3 * sum(steady[a:b]) / (b - a) for a, b in zip(edges, edges[1:])]
