"""Result rows for ``expertcache sim``: the JSON schema of docs/simulator.md plus the cost model."""

from __future__ import annotations

from collections.abc import Sequence

from ..stats import DECODE
from ..trace.format import Trace
from ..costmodel import ExpertCost, Hardware, bytes_moved, chosen_path, tokens_per_second
from .replay import ReplayResult


def expert_cost(trace: Trace, expert_bytes: int | None = None, model: str | None = None,
                dense_bytes: int = 0, quant: str | None = None) -> ExpertCost | None:
    """Bytes (and FLOPs) of one expert: ``expert_bytes`` > ``model`` (a preset, optionally in
    ``quant``, or a GGUF file's header) > trace meta.

    None when the size is unknown: then ``bytes_moved`` and ``predicted_tok_s`` are null.
    """
    if quant and not model:
        raise ValueError("--quant sizes a preset's experts: give --model too (e.g. --model qwen3-30b-a3b)")
    if model:
        from ..costmodel import model_experts
        found = model_experts(model, quant, dense_bytes)
        if (found.layers, found.experts) != (trace.num_layers, trace.num_experts):
            raise ValueError(f"model {model!r} has {found.layers} MoE layers x {found.experts} "
                             f"experts but the trace has {trace.num_layers} x {trace.num_experts}")
        if expert_bytes is None:
            return found.cost
        return ExpertCost(int(expert_bytes), found.cost.expert_flops, int(dense_bytes))
    size = expert_bytes or trace.expert_bytes
    if size is None:
        return None
    if dense_bytes < 0:
        raise ValueError(f"dense bytes must not be negative, got {dense_bytes}")
    return ExpertCost(int(size), None, int(dense_bytes))


def rows(trace: Trace, results: Sequence[ReplayResult], opt: dict[int, int],
         cost: ExpertCost | None, hw: Hardware, miss_path: str = "auto",
         slot_format: str = "dequantized") -> list[dict]:
    """One JSON-ready dict per result (schema: docs/simulator.md, "JSON")."""
    decode_tokens = int((trace.phases == DECODE).sum())
    path = chosen_path(cost, hw, miss_path, slot_format) if cost else miss_path
    out = []
    for r in results:
        total = r.total
        row = {"policy": r.policy, "admission": r.admission, "label": r.label or r.policy,
               # the rules as run: 'default' brings its own admission when none is named
               "eviction_params": dict(r.spec.eviction_params) if r.spec else None,
               "admission_params": dict(r.spec.admission_params) if r.spec else None,
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
                layers=trace.num_layers, miss_path=miss_path, slot_format=slot_format)
        out.append(row)
    return out


def trace_header(trace: Trace) -> str:
    """The trace's shape, and a batched trace's batch size and engine steps."""
    text = (f"{trace.meta.get('model', 'trace')}: {trace.num_layers} layers x {trace.num_experts} "
            f"experts, top-{trace.top_k}, {trace.num_tokens} tokens")
    sizes = trace.meta.get("step_tokens")
    if trace.meta.get("prefill_steps") == "grouped" and isinstance(sizes, list) and sizes:
        batch = trace.meta.get("batch")
        who = (f"B = {batch['requests']} requests decoded together" if isinstance(batch, dict)
               and "requests" in batch else "recorded batches")
        text += f" ({who}: {len(sizes)} steps of {min(sizes)}..{max(sizes)} tokens)"
    return text


def batch_requests(trace: Trace) -> int | None:
    """Requests decoded together: B of a ``trace batch`` trace, 1 for one stream, None for a
    recorded grouped trace (its batches vary)."""
    batch = trace.meta.get("batch")
    if isinstance(batch, dict) and "requests" in batch:
        return batch["requests"]
    return None if trace.meta.get("prefill_steps") == "grouped" else 1


def batch_summary(prep) -> dict:
    """A replay's ``requests`` (``batch_requests``) and ``steps``, the forwards it replays
    (one step per layer each; ``prep`` a ``Prepared``)."""
    return {"requests": batch_requests(prep.trace), "steps": len(prep.row_phases)}


def document(trace: Trace, table: list[dict], hw: Hardware, miss_path: str,
             cost: ExpertCost | None, slot_format: str = "dequantized", prep=None) -> dict:
    """The whole ``--json`` document (``prep``: the replay's ``Prepared``, for its batch size
    and steps)."""
    used = chosen_path(cost, hw, miss_path, slot_format) if cost else None
    summary = trace.summary() if prep is None else {**trace.summary(), **batch_summary(prep)}
    return {"trace": summary, "results": table,
            "cost_model": {"hardware": hw.name, "miss_path": miss_path, "miss_path_used": used,
                           "slot_format": slot_format,
                           "expert_bytes": cost.expert_bytes if cost else None,
                           "compute_bytes": cost.compute_bytes if cost else None,
                           "expert_flops": cost.expert_flops if cost else None}}
