"""Result rows for ``expertcache sim``: the JSON schema of docs/simulator.md plus the cost model."""

from __future__ import annotations

from collections.abc import Sequence

from ..stats import DECODE
from ..trace.format import Trace
from .costmodel import ExpertCost, Hardware, bytes_moved, chosen_path, tokens_per_second
from .replay import ReplayResult


def expert_cost(trace: Trace, expert_bytes: int | None = None,
                model: str | None = None, dense_bytes: int = 0) -> ExpertCost | None:
    """Bytes (and FLOPs) of one expert: ``expert_bytes`` > trace meta > model preset.

    None when the size is unknown: then ``bytes_moved`` and ``predicted_tok_s`` are null.
    """
    shape = None
    if model:
        from ..presets import preset
        shape = preset(model)
        if (shape.layers, shape.experts) != (trace.num_layers, trace.num_experts):
            raise ValueError(f"model preset {model!r} has {shape.layers} layers x {shape.experts} "
                             f"experts but the trace has {trace.num_layers} x {trace.num_experts}")
    size = expert_bytes or trace.expert_bytes or (shape.expert_bytes if shape else None)
    if size is None:
        return None
    flops = 2.0 * 3 * shape.hidden * shape.expert_ff if shape else None  # gate, up, down
    if dense_bytes < 0:
        raise ValueError(f"dense bytes must not be negative, got {dense_bytes}")
    return ExpertCost(int(size), flops, int(dense_bytes))


def rows(trace: Trace, results: Sequence[ReplayResult], opt: dict[int, int],
         cost: ExpertCost | None, hw: Hardware, miss_path: str = "auto") -> list[dict]:
    """One JSON-ready dict per result (schema: docs/simulator.md, "JSON")."""
    decode_tokens = int((trace.phases == DECODE).sum())
    path = chosen_path(cost, hw, miss_path) if cost else miss_path
    out = []
    for r in results:
        total = r.total
        row = {"policy": r.policy, "admission": r.admission, "label": r.label or r.policy,
               "partition": r.partition, "slots": r.slots, "accesses": total.accesses,
               "hits": total.hits, "misses": total.misses, "hit_rate": total.hit_rate,
               "opt_misses": opt.get(r.slots),
               "bytes_moved": bytes_moved(total.misses, total.loads,
                                          cost.expert_bytes if cost else None, path),
               "predicted_tok_s": None, "engine": r.engine,
               "prefill": r.stats.total(0).to_dict(), "decode": r.stats.total(DECODE).to_dict()}
        if cost and decode_tokens:
            dec = r.stats.total(DECODE)
            row["predicted_tok_s"] = tokens_per_second(
                dec.hits / decode_tokens, dec.misses / decode_tokens, cost, hw,
                layers=trace.num_layers, miss_path=miss_path)
        out.append(row)
    return out


def document(trace: Trace, table: list[dict], hw: Hardware, miss_path: str,
             cost: ExpertCost | None) -> dict:
    """The whole ``--json`` document."""
    used = chosen_path(cost, hw, miss_path) if cost else None
    return {"trace": trace.summary(), "results": table,
            "cost_model": {"hardware": hw.name, "miss_path": miss_path, "miss_path_used": used,
                           "expert_bytes": cost.expert_bytes if cost else None,
                           "expert_flops": cost.expert_flops if cost else None}}
