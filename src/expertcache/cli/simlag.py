"""``expertcache sim --lag N[,N...]``: the cost of running the policy N forwards behind the
device (``planner="device"``), per policy and size: hit rates and experts copied."""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = ("policy", "partition", "slots", "lag", "hit rate", "decode hit rate", "misses",
           "host copies", "from staging")


def run_lags(prep, specs, slots: list[int], partition: str, lags: list[int], blocks: int,
             json_out: str | None) -> int:
    from ..sim.lag import lag_replay

    if any(lag < 0 for lag in lags):
        raise ValueError(f"--lag takes whole numbers >= 0, got {lags}")
    results = [lag_replay(prep, spec, n, partition, lag, blocks=blocks)
               for spec in specs for n in slots for lag in lags]
    rows = [(r.label, r.partition, str(r.slots), str(r.lag), f"{r.stats.total().hit_rate:.4f}",
             f"{r.stats.total('decode').hit_rate:.4f}", str(r.stats.total().misses), str(r.host_copies),
             str(r.staging_loads)) for r in results]
    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(COLUMNS)]
    trace = prep.trace
    lines = [f"{trace.meta.get('model', 'trace')}: {trace.num_layers} layers x {trace.num_experts} experts, "
             f"top-{trace.top_k}, {trace.num_tokens} tokens; staging blocks: {blocks}",
             "  ".join(f"{c:<{w}}" for c, w in zip(COLUMNS, widths))]
    lines += ["  ".join(f"{v:<{w}}" if i < 2 else f"{v:>{w}}" for i, (v, w) in enumerate(zip(row, widths)))
              for row in rows]
    lines.append("host copies: experts copied from the host (staged misses + loads without a staging "
                 "row; lag 0: every miss once)")
    sys.stdout.write("\n".join(lines) + "\n")
    if json_out:
        Path(json_out).write_text(json.dumps({"blocks": blocks, "results": [r.to_dict() for r in results]},
                                             indent=2) + "\n")
    return 0
