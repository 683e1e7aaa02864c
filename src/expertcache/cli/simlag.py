"""``expertcache sim --lag N[,N...]``: the cost of running the policy N forwards behind the
device (``planner="device"``), per policy and size: hit rates and experts copied."""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = ("policy", "partition", "slots", "lag", "hit rate", "decode hit rate", "misses",
           "host copies", "from staging")
# Why a lag can score above lag 0 (one line under the table).
WHY_LAG = ("lag >= 1: the policy decides once a forward has finished, so no step evicts an expert a "
           "later layer of the same forward needs (a global pool); lag 1 can score above lag 0")


def run_lags(prep, specs, slots: list[int], partition: str, lags: list[int], blocks: int,
             json_out: str | None, doc: dict | None = None, progress=None) -> int:
    """The table on stdout; ``doc`` (``sim.report.document``'s top, without results) gets the
    rows of every lag as ``results``, the layout of a plain ``sim --json``."""
    from ..sim.lag import check_blocks, lag_replays, widest_decode_step

    if any(lag < 0 for lag in lags):
        raise ValueError(f"--lag takes whole numbers >= 0, got {lags}")
    check_blocks(blocks, prep.L, "--lag-blocks")
    decode_forwards = sum(1 for p in prep.row_phases if p != 0)
    for lag in sorted({lag for lag in lags if lag >= max(decode_forwards, 1)}):
        print(f"warning: --lag {lag} is not below the {decode_forwards} decode forwards this replay has: "
              "no decision of the policy reaches the device before the replay ends (give more --tokens "
              "or a smaller --lag)", file=sys.stderr)
    results = []
    for i, (spec, n) in enumerate((spec, n) for spec in specs for n in slots):
        results += lag_replays(prep, spec, n, partition, lags, blocks=blocks)
        if progress:
            progress(i + 1, len(specs) * len(slots))
    _print(prep.trace, results, blocks, widest_decode_step(prep), lags)
    if json_out:
        from ..sim.report import batch_summary
        out = dict(doc or {})
        out.setdefault("trace", {**prep.trace.summary(), **batch_summary(prep)})
        out["lag"] = {"blocks": blocks, "staging_rows": widest_decode_step(prep)}
        out["results"] = [lag_row(r) for r in results]
        Path(json_out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def lag_row(r) -> dict:
    """One lag result in the row layout of ``sim --json`` (``sim.report.rows``) plus the lag's
    own fields."""
    total, decode, spec = r.stats.total(), r.stats.total("decode"), r.spec
    return {"policy": spec.eviction, "admission": spec.admission, "label": r.label,
            "eviction_params": dict(spec.eviction_params), "admission_params": dict(spec.admission_params),
            "partition": r.partition, "slots": r.slots, "accesses": total.accesses, "hits": total.hits,
            "misses": total.misses, "hit_rate": total.hit_rate, "engine": r.engine,
            "prefill": r.stats.total("prefill").to_dict(), "decode": decode.to_dict(),
            "lag": r.lag, "decode_hit_rate": decode.hit_rate, "loads": total.loads,
            "staged": r.staged, "staging_loads": r.staging_loads, "host_loads": r.host_loads,
            "planned": r.planned, "host_copies": r.host_copies}


def _print(trace, results, blocks: int, staging: int, lags: list[int]) -> None:
    from ..sim.report import trace_header
    rows = [(r.label, r.partition, str(r.slots), str(r.lag), f"{r.stats.total().hit_rate:.4f}",
             f"{r.stats.total('decode').hit_rate:.4f}", str(r.stats.total().misses), str(r.host_copies),
             str(r.staging_loads)) for r in results]
    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(COLUMNS)]
    lines = [f"{trace_header(trace)}; staging: {blocks} block(s) of {staging} rows",
             "  ".join(f"{c:<{w}}" for c, w in zip(COLUMNS, widths))]
    lines += ["  ".join(f"{v:<{w}}" if i < 2 else f"{v:>{w}}" for i, (v, w) in enumerate(zip(row, widths)))
              for row in rows]
    lines.append("host copies: experts copied from the host (staged misses + loads without a staging "
                 "row; lag 0: every miss once)")
    if any(lag >= 1 for lag in lags):
        lines.append(WHY_LAG)
    sys.stdout.write("\n".join(lines) + "\n")
