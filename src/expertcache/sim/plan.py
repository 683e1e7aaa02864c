"""``expertcache plan``: what a model will do in a memory budget, before anything is loaded.

From the model's header (a GGUF file) or a preset, the budget and a routing trace:
expert bytes, slots per slot format (the runtime's own sizing: ``costmodel.pool``, with
the compute dtype and slot format the run defaults to on the planned device), hit rates
per policy from the simulator, predicted steady decode tok/s per policy, slot format
and miss path from the cost model, the baselines beside them, and the fastest
configuration. Torch-free; nothing but the header is read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..config import MISS_PATHS, host_budget_rows
from ..sizes import parse_size
from ..stats import DECODE
from ..trace.format import Trace
from ..costmodel import Hardware, ModelExperts, PoolSizing, tokens_per_second
from ..costmodel.model import file_read_time
from ..costmodel.pool import cap_slots, resolve_slot_format, staging_slots
from ..quant.formats import QuantFormat, quant_format
from ..quant.ggml import choose


@dataclass(frozen=True)
class PlanRow:
    config: str          # e.g. 'default, quantized slots, fetch' or 'copy-every-pass'
    slot_format: str
    slots: int
    hit_rate: float | None
    miss_path: str
    tok_s: float | None
    # host_memory='tiered' (plan --host-budget): the RAM tier's decode hit rate, experts read from
    # the file per token, and tok_s with those reads at the profile's disk_gbps
    ram_hit_rate: float | None = None
    file_reads_per_token: float | None = None


def formats_for(model: ModelExperts) -> tuple[str, ...]:
    return ("quantized", "dequantized") if model.cost.quantized else ("plain",)


def cpu_kernel(model: ModelExperts, choice: str = "auto") -> tuple[str, str]:
    """('ggml' or 'torch', why): how the run computes quantized experts on the CPU, resolved as
    the runtime resolves it (``quant.ggml.choose``) from the header's expert types."""
    if not model.cost.quantized:
        return "torch", "float experts"
    formats = []
    for name in model.quant.split("/"):
        try:
            formats.append(quant_format(name))
        except ValueError:  # a type ggml does not name: it has no kernel
            formats.append(QuantFormat(name, -1, 1, 1))
    return choose(choice, formats)


def pool_slots(model: ModelExperts, budget: int, slot_format: str, miss: str = "fetch",
               partition: str = "global", direct: bool = False) -> int:
    """Cache slots the runtime builds in ``budget`` (its own sizing, default staging; ``direct``:
    ggml computes on 'quantized' CPU slots, so no scratch)."""
    k = model.top_k
    sizing = PoolSizing(model.cost, slot_format, k, staging_slots(miss, None, k), direct)
    return cap_slots(max(0, sizing.slots_in(budget)), model.layers, model.experts, partition)


def plan(model: ModelExperts, gpu_memory: str | int, hw: Hardware, trace: Trace | None,
         policies: list[str], partition: str = "global", device: str = "cuda", cpu_kernel_choice: str = "auto",
         host_budget: str | int | float | None = None, host_policy: str = "default") -> dict:
    """Rows for every (policy, slot format, miss path) and the baselines; the best first.

    ``device`` ('cuda' or 'cpu') is where the run would go: it picks the slot format the
    run's 'auto' takes (``run_slot_format``); ``model`` carries the compute dtype;
    ``cpu_kernel_choice`` is the run's ``cpu_kernel`` (ggml on CPU slots needs no scratch)."""
    budget = parse_size(gpu_memory)
    kernel, kernel_reason = cpu_kernel(model, cpu_kernel_choice)
    ggml = kernel == "ggml"
    direct = {fmt: ggml and device == "cpu" and fmt == "quantized" for fmt in formats_for(model)}
    per_token = model.layers * model.top_k  # expert uses per decode token
    rows = []
    for path in ("fetch", "cpu"):  # the baselines: nothing cached, every use a miss
        name = "copy-every-pass" if path == "fetch" else "cpu"
        rows.append(PlanRow(name, "-", 0, 0.0, path, _tok_s(model, hw, 0, per_token, path, "dequantized", ggml)))
    sizes = {fmt: pool_slots(model, budget, fmt, "fetch", partition, direct[fmt]) for fmt in formats_for(model)}
    hit_rates: dict[tuple[str, int], float] = {}
    for fmt in sizes:
        for path in MISS_PATHS:  # misses on the CPU need no staging slots: a bigger cache
            slots = pool_slots(model, budget, fmt, path, partition, direct[fmt])
            if slots < model.top_k or trace is None:
                continue
            for policy in policies:
                if (policy, slots) not in hit_rates:
                    hit_rates[policy, slots] = _decode_hit_rate(trace, policy, slots, partition)
                hits = hit_rates[policy, slots]
                tok = _tok_s(model, hw, hits * per_token, (1 - hits) * per_token, path, fmt, ggml)
                rows.append(PlanRow(f"{policy}, {fmt} slots, miss {path}", fmt, slots, hits, path, tok))
    ram_rows = None
    if host_budget is not None:  # a RAM tier under the slots: each row pays its file reads too
        ram_rows = host_budget_rows(host_budget, model.layers * model.experts, model.cost.expert_bytes)
        if ram_rows < model.top_k:
            raise ValueError(f"host_budget={host_budget!r} holds {ram_rows} experts, fewer than the "
                             f"top_k={model.top_k} one step needs")
        if trace is not None:
            from .replay import resolve_policy
            specs = {str(p): resolve_policy(p) for p in policies}
            rows = [_with_tier(r, trace, ram_rows, host_policy, partition, model, hw, specs) for r in rows]
    ranked = sorted(rows, key=lambda r: -(r.tok_s or 0.0))
    return {"model": model.name, "layers": model.layers, "experts": model.experts, "top_k": model.top_k,
            "quant": model.quant, "expert_bytes": model.cost.expert_bytes,
            "compute_bytes": model.cost.compute_bytes, "gpu_memory": budget, "hardware": hw.name,
            "device": device, "compute_dtype": model.compute_dtype,
            "run_slot_format": resolve_slot_format("auto", model.cost.quantized, device, ggml and device == "cpu"),
            "cpu_kernel": kernel, "cpu_kernel_reason": kernel_reason,
            "slots": sizes, "trace": None if trace is None else trace.meta.get("source", "trace"),
            "host_budget": host_budget, "ram_rows": ram_rows, "host_policy": host_policy if ram_rows else None,
            "disk_gbps": hw.disk_gbps,
            "rows": [asdict(r) for r in ranked],
            # without hit rates there is no cache row to weigh against the baselines: no verdict
            "best": asdict(ranked[0]) if trace is not None else None}


def _with_tier(row: PlanRow, trace: Trace, ram_rows: int, host_policy: str, partition: str,
               model: ModelExperts, hw: Hardware, specs: dict) -> PlanRow:
    """``row`` with a RAM tier of ``ram_rows`` under its slots: the tier replayed (``sim/tiers.py``)
    behind the row's policy and slots, its file reads per decode token added at ``hw.disk_gbps``."""
    from .tiers import replay_tiers

    spec = specs.get(row.config.split(", ")[0]) if row.slots else None
    gpu = (spec.spec.eviction, spec.spec.admission) if spec is not None else ("default", "always")
    slots = row.slots if spec is not None else 0  # the baselines cache nothing: every use reaches RAM
    tiers = replay_tiers(trace, ram_rows, host_policy, slots, gpu[0], partition, gpu[1]).phase(DECODE)
    tokens = tiers["tokens"] or 1
    reads = tiers["file_reads"] / tokens
    tok = row.tok_s
    if tok:
        tok = 1.0 / (1.0 / tok + file_read_time(reads, model.cost, hw))
    return replace(row, tok_s=tok, ram_hit_rate=tiers["ram_hit_rate"], file_reads_per_token=reads)


def _decode_hit_rate(trace: Trace, policy: str, slots: int, partition: str) -> float:
    from .replay import replay

    stats = replay(trace, policy, slots, partition).stats.total(DECODE)
    return stats.hits / stats.accesses if stats.accesses else 0.0


def _tok_s(model: ModelExperts, hw: Hardware, hits: float, misses: float, path: str, fmt: str,
           ggml: bool = False) -> float:
    return tokens_per_second(hits, misses, model.cost, hw, layers=model.layers, miss_path=path,
                             slot_format=fmt, ggml=ggml)


def default_trace(model: ModelExperts, tokens: int, seed: int = 0) -> tuple[Trace | None, str]:
    """A synthetic trace when a preset of the same shape has a calibrated profile; else None, why."""
    from ..presets import PRESETS
    from ..trace.profiles import FITTED
    from ..trace.synth import synth_trace

    for name, shape in PRESETS.items():
        if (shape.layers, shape.experts, shape.top_k) == (model.layers, model.experts, model.top_k) \
                and name in FITTED:
            return synth_trace(name, tokens, seed=seed), f"synthetic {name} trace ({tokens} tokens)"
    return None, (f"no routing trace for {model.layers} layers x {model.experts} experts, top-{model.top_k}: "
                  "give --trace (record one with 'expertcache trace record'); slot counts only")
