"""``expertcache plan MODEL --gpu-memory 8GiB``: slots, hit rates and predicted tok/s before loading."""

from __future__ import annotations

import json
from pathlib import Path


def add_parser(sub) -> None:
    from ..config import CPU_KERNELS, DTYPES, PARTITIONS

    p = sub.add_parser("plan", help="before loading: slots per slot format, predicted tok/s, a recommendation",
                       description="Reads only the model's header (a GGUF file, a safetensors checkpoint directory, "
                                   "or a preset name with --quant) "
                                   "and predicts, for a device memory budget, how many experts each slot "
                                   "format holds, the hit rate per policy (simulator, on --trace or a "
                                   "calibrated synthetic trace) and the steady decode tok/s per policy, "
                                   "slot format and miss path (cost model, --hardware), next to the "
                                   "copy-every-pass and cpu baselines; recommends the fastest.")
    p.add_argument("model", help="a .gguf model file, a safetensors checkpoint directory, or a preset "
                   "(see 'expertcache sim --help')")
    p.add_argument("--gpu-memory", required=True, metavar="SIZE", help="budget for the slot pool, e.g. 8GiB")
    p.add_argument("--quant", metavar="TYPE", help="with a preset: its experts in this ggml type, e.g. Q4_K")
    p.add_argument("--trace", help="routing trace .npz of this model (default: a calibrated synthetic one "
                   "when the model's shape has a profile)")
    p.add_argument("--tokens", type=int, default=2000, help="tokens of the trace to replay (default 2000)")
    p.add_argument("--policy", default="default,lru", help="eviction policies to compare (default: default,lru)")
    p.add_argument("--requests", type=int, default=1, metavar="B",
                   help="requests decoded together: hit rates come from the trace cut into B "
                        "interleaved requests ('expertcache trace batch'), as a batching server "
                        "sees it (default 1)")
    p.add_argument("--partition", default="global", choices=PARTITIONS)
    p.add_argument("--hardware", default="pcie4-consumer",
                   help="cost-model profile: pcie4-consumer, pcie5-consumer, h200, or 'expertcache probe' JSON")
    p.add_argument("--device", choices=("cuda", "cpu"), help="where the run goes: sizes slots in its default "
                   "compute dtype and slot format (default: cuda when this machine has a GPU driver)")
    p.add_argument("--dtype", choices=DTYPES, help="compute dtype of the run (default: bfloat16 on cuda, "
                   "float32 on cpu, as the run's)")
    p.add_argument("--cpu-kernel", default="auto", choices=CPU_KERNELS,
                   help="the run's cpu_kernel: with ggml, quantized CPU slots need no scratch (docs/cpu.md)")
    p.add_argument("--host-budget", metavar="SIZE",
                   help="a RAM tier under the slots (host_memory tiered): bytes (16GiB) or a share of the "
                        "experts (25%%); each row then pays its reads from the file at --disk-gbps")
    p.add_argument("--host-policy", default="default", help="the RAM tier's eviction policy (default: default)")
    p.add_argument("--disk-gbps", type=float, help="O_DIRECT read bandwidth of the model's drive, GB/s "
                   "(default: the hardware profile's disk_gbps, from 'expertcache probe --disk FILE')")
    p.add_argument("--json", metavar="OUT", help="also write the plan as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..costmodel import default_dtype, load_hardware, model_experts
    from ..costmodel.hardware import local_device
    from ..sim.plan import default_trace, plan
    from .paths import check_output
    from ..sim.replay import resolve_policy

    check_output(args.json, "--json")
    # resolved once: unknown names and bad parameters fail before any work, and the specs
    # themselves go on to the replays
    policies = [resolve_policy(p) for p in args.policy.split(",") if p.strip()]
    device = args.device or local_device()
    model = model_experts(args.model, args.quant, compute_dtype=args.dtype or default_dtype(device))
    hw = load_hardware(args.hardware)
    if args.disk_gbps is not None:
        from dataclasses import replace
        hw = replace(hw, disk_gbps=args.disk_gbps)
    budget = None
    if args.host_budget is not None:
        from ..config import host_budget_share
        from .options import _budget
        budget = _budget(args.host_budget)
        host_budget_share(budget)  # the spelling, before any replay
        if hw.disk_gbps is None:
            raise ValueError(f"--host-budget needs the drive's read rate: give --disk-gbps or a --hardware "
                             "profile with disk_gbps ('expertcache probe --disk MODEL_FILE -o FILE')")
    trace, why = _trace(args, model) if args.trace else default_trace(model, args.tokens)
    if args.requests != 1 and trace is not None:
        from ..trace.batch import batch_traces
        trace = batch_traces([trace], args.requests)
        why += f", cut into {args.requests} requests decoded together"
    if trace is not None and trace.meta.get("prefill_steps") == "grouped":
        from ..sim.report import trace_header
        why += f"; {trace_header(trace).split(': ', 1)[1]}"
    result = plan(model, args.gpu_memory, hw, trace, policies, args.partition, device, args.cpu_kernel,
                  budget, args.host_policy)
    # the cost model prices one token's top-k uses at the replay's hit rate (sim/plan.py)
    from ..sim.report import batch_requests
    result["requests"] = None if trace is None else batch_requests(trace)
    result["tok_s_is"] = TOK_S_IS
    _print(result, why)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


# What plan's tok/s is, batched or not (sim/plan.py prices each decode token's top-k uses).
TOK_S_IS = ("one request's decode tokens per second: each token's top-k expert uses priced at the "
            "replay's decode hit rate, as if the token ran alone (a batch step's shared experts "
            "are not priced once), not the batch's total")


def _trace(args, model):
    from ..trace.format import load_trace

    trace = load_trace(args.trace)
    if (trace.num_layers, trace.num_experts) != (model.layers, model.experts):
        raise ValueError(f"trace {args.trace} has {trace.num_layers} layers x {trace.num_experts} experts but "
                         f"the model has {model.layers} x {model.experts}; record a trace of this model")
    if args.tokens < trace.num_tokens:
        trace = trace.slice_tokens(args.tokens)
    return trace, f"trace {args.trace} ({trace.num_tokens} tokens)"


def _print(result: dict, why: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..sizes import format_size

    console = Console(width=max(Console().width, 100))
    total = result["layers"] * result["experts"]
    console.print(f"{result['model']}: {result['layers']} MoE layers x {result['experts']} experts, "
                  f"top-{result['top_k']}; experts {result['quant']}, "
                  f"{format_size(result['expert_bytes'])} stored, {format_size(result['compute_bytes'])} "
                  f"in {result['compute_dtype']}; budget {format_size(result['gpu_memory'])}, "
                  f"hardware {result['hardware']}; sized for a run on {result['device']}")
    for fmt, slots in result["slots"].items():
        console.print(f"  {fmt} slots: {slots} of {total} experts ({slots / total:.1%})"
                      + ("  - below top-k, cannot run" if slots < result["top_k"] else "")
                      + ("  (the run's default)" if fmt == result["run_slot_format"] else ""))
    console.print(f"hit rates from: {why}")
    t = Table(title_justify="left")
    t.caption = "tok/s: cost model, MoE part only (dense layers and overheads not counted): compare rows"
    tier = result.get("ram_rows") is not None
    cols = ["configuration", "slots", "decode hit rate", *(["RAM hit rate", "file reads/token"] if tier else []),
            "tok/s (predicted)"]
    for col in cols:
        t.add_column(col, justify="left" if col == "configuration" else "right")
    for row in result["rows"]:
        extra = [] if not tier else ["-" if row["ram_hit_rate"] is None else f"{row['ram_hit_rate']:.3f}",
                                     "-" if row["file_reads_per_token"] is None else f"{row['file_reads_per_token']:.2f}"]
        t.add_row(row["config"], str(row["slots"]) if row["slots"] else "-",
                  "-" if row["hit_rate"] is None else f"{row['hit_rate']:.3f}", *extra,
                  "-" if row["tok_s"] is None else f"{row['tok_s']:.1f}")
    if tier:
        console.print(f"RAM tier: {result['ram_rows']} of {total} experts under {result['host_policy']}, "
                      f"file read at {result['disk_gbps']:.2f} GB/s (O_DIRECT)")
    console.print(t)
    if result.get("trace") is not None and result.get("requests") != 1:
        console.print(f"tok/s: {TOK_S_IS}")
    best = result["best"]
    if best:
        console.print(f"recommended: {best['config']} ({best['tok_s']:.1f} tok/s predicted)")
