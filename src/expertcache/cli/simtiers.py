"""``expertcache sim TRACE --host-budget B``: device slots in front of a RAM tier in front of the
file (host_memory='tiered'), per policy and size: device hits, RAM hits, experts read from the
file and bytes per token, beside the RAM tier's Belady bound (``sim/tiers.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = ("device policy", "device slots", "RAM policy", "RAM rows", "device hits", "RAM hits",
           "file reads/token", "file bytes/token", "bound reads/token")


def run_tiers(prep, specs, slots: list[int], partition: str, budget: str, host_policy: str,
              expert_bytes: int | None, json_out: str | None) -> int:
    from ..config import host_budget_rows, host_budget_share
    from ..sim.tiers import bound, replay_tiers
    from ..sizes import format_size
    from .options import _budget

    trace = prep.trace
    total = trace.num_layers * trace.num_experts
    budget = _budget(budget)
    if host_budget_share(budget) is None and not expert_bytes:
        raise ValueError("--host-budget in bytes needs the expert size: give --expert-bytes, --model, or a "
                         "share such as 25%")
    rows_ram = host_budget_rows(budget, total, expert_bytes or 1)
    results, lines = [], []
    for spec in specs:
        for n in slots:
            gpu = (spec.spec.eviction, spec.spec.admission)
            got = replay_tiers(prep, rows_ram, host_policy, n, gpu[0], partition, gpu[1], expert_bytes)
            best, what = bound(prep, rows_ram, n, gpu[0], partition, gpu[1], expert_bytes)
            d, b = got.phase(1), best.phase(1)
            tok = d["tokens"] or 1
            results.append({"device_policy": spec.label, "device_slots": n, **got.to_dict(),
                            "bound": best.to_dict(), "bound_is": what})
            lines.append((spec.label if n else "-", str(n), got.ram_policy, str(rows_ram),
                          "-" if not n else f"{d['gpu_hits'] / d['gpu_accesses']:.4f}",
                          f"{d['ram_hit_rate']:.4f}", f"{d['file_reads'] / tok:.2f}",
                          "-" if not expert_bytes else format_size(d["file_bytes_per_token"]),
                          f"{b['file_reads'] / tok:.2f}"))
    widths = [max([len(c)] + [len(row[i]) for row in lines]) for i, c in enumerate(COLUMNS)]
    out = [f"{trace.meta.get('model', 'trace')}: {trace.num_layers} layers x {trace.num_experts} experts, "
           f"top-{trace.top_k}, {trace.num_tokens} tokens; RAM tier {rows_ram} of {total} experts; decode",
           "  ".join(f"{c:<{w}}" for c, w in zip(COLUMNS, widths))]
    out += ["  ".join(f"{v:<{w}}" if i in (0, 2) else f"{v:>{w}}" for i, (v, w) in enumerate(zip(row, widths)))
            for row in lines]
    out.append("bound: Belady on the RAM tier over the requests the device tier leaves (device slots 0: "
               "every step reaches RAM, the optimum of file reads; else the optimum given that device policy)")
    sys.stdout.write("\n".join(out) + "\n")
    if json_out:
        Path(json_out).write_text(json.dumps({"ram_rows": rows_ram, "results": results}, indent=2) + "\n")
    return 0
