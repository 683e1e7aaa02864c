"""``expertcache trace``: import, synthesise, inspect and record routing traces."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from .paths import check_output


def add_parser(sub) -> None:
    parser = sub.add_parser("trace", help="import, synthesise, inspect or record routing traces",
                            description="Routing traces (.npz): the simulator's input.")
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
    tsub = parser.add_subparsers(dest="trace_command", metavar="ACTION")

    p = tsub.add_parser("import", help="convert a route_trace CSV or JSONL log to .npz")
    p.add_argument("--format", required=True, choices=("route-csv", "jsonl"), dest="fmt")
    p.add_argument("input", metavar="IN")
    p.add_argument("output", metavar="OUT.npz")
    p.add_argument("--num-experts", type=int, help="jsonl: experts per layer (else from a meta line, "
                   "else max id + 1)")
    p.add_argument("--model", help="jsonl: model name for meta")
    p.set_defaults(func=_import)

    p = tsub.add_parser("synth", help="write a synthetic trace calibrated to a model preset")
    from ..trace.profiles import FITTED
    p.add_argument("--preset", required=True, choices=sorted(FITTED))
    p.add_argument("--tokens", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", type=int, default=0, help="the first N tokens are prompt (phase 0)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.npz")
    p.set_defaults(func=_synth)

    p = tsub.add_parser("batch", help="interleave B requests into a grouped trace (batched decode)",
                        description="Make a grouped trace of B requests decoded together: one "
                        "trace's tokens cut into B stretches, or several traces (each cut into its "
                        "share of B). sim and plan replay it as an engine's batches; bench replays "
                        "any trace one token per step (docs/traces.md).")
    p.add_argument("inputs", nargs="+", metavar="IN.npz")
    p.add_argument("--requests", type=int, required=True, metavar="B", help="requests decoded together")
    p.add_argument("--prompt", type=int, default=0, metavar="N",
                   help="the first N tokens of each request are its prompt (default 0: all decode)")
    p.add_argument("--prompt-chunk", type=int, metavar="N", help="prompt tokens one step prefills, "
                   "mixed into the running requests' decode steps (vLLM's chunked prefill; default: "
                   "the whole prompt in one step)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.npz")
    p.set_defaults(func=_batch)

    p = tsub.add_parser("info", help="summary and per-layer locality of a trace")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--json", metavar="OUT", help="also write the figures as JSON ('-' for stdout)")
    p.set_defaults(func=_info)

    p = tsub.add_parser("record", help="run a Hugging Face MoE model and record its routing")
    p.add_argument("model", metavar="MODEL", help="what generate takes: a GGUF file, a local checkpoint "
                   "directory (save_pretrained layout) or an HF-quantized one (MXFP4, block FP8)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", metavar="F", help="read the prompt from a file")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--device", default=None, help="torch device to run on, e.g. cuda (default: where the model loads, the CPU)")
    p.add_argument("--router-logits", action="store_true",
                   help="also save every expert's raw router score per layer and token "
                        "(float16 [layers, tokens, experts]) for policy research")
    p.add_argument("-o", "--output", required=True, metavar="trace.npz")
    p.set_defaults(func=_record)


def _batch(args) -> int:
    check_output(args.output, "OUT.npz")
    out = Path(args.output).resolve()
    for name in args.inputs:  # the inputs are read whole first, but a typo must not lose one
        if Path(name).resolve() == out:
            raise ValueError(f"-o {args.output} is an input trace; write the batched trace to "
                             "another file")
    from ..trace import load_trace, save_trace
    from ..trace.batch import batch_traces
    trace = batch_traces([load_trace(p) for p in args.inputs], args.requests, args.prompt,
                         args.prompt_chunk, names=list(args.inputs))
    save_trace(trace, args.output)
    steps = trace.meta["step_tokens"]
    print(f"wrote {args.output}: {args.requests} requests, {trace.num_tokens} tokens in "
          f"{len(steps)} steps (up to {max(steps)} tokens a step)")
    return 0


def _import(args) -> int:
    check_output(args.output, "OUT.npz")
    from ..trace import save_trace
    from ..trace.importers import import_trace
    options = {}
    if args.fmt == "jsonl":
        options = {"num_experts": args.num_experts, "model": args.model}
    elif args.num_experts or args.model:
        raise ValueError("--num-experts and --model apply to --format jsonl; route-csv reads them "
                         "from its header")
    result = import_trace(args.input, args.fmt, **options)
    trace = result.trace
    save_trace(trace, args.output)
    print(f"wrote {args.output}: {trace.num_tokens} tokens x {trace.num_layers} layers, top-{trace.top_k} "
          f"of {trace.num_experts} experts ({result.records} records read)")
    if result.dropped:
        print(f"dropped {result.dropped} incomplete token(s): their records do not cover all "
              f"{trace.num_layers} layers x top-{trace.top_k}")
    if trace.meta.get("num_experts_inferred"):
        print(f"note: num_experts={trace.num_experts} inferred as max id + 1; pass --num-experts "
              "if the model has more", file=sys.stderr)
    return 0


def _synth(args) -> int:
    check_output(args.output, "-o")
    from ..trace import save_trace
    from ..trace.synth import synth_trace
    trace = synth_trace(args.preset, args.tokens, seed=args.seed, prompt=args.prompt)
    save_trace(trace, args.output)
    print(f"wrote {args.output}: {args.preset}, {trace.num_tokens} tokens x {trace.num_layers} "
          f"layers, top-{trace.top_k} of {trace.num_experts}, seed {args.seed}")
    return 0


def _info(args) -> int:
    check_output(args.json, "--json")
    from ..trace import load_trace
    from ..trace.locality import locality, top_share
    trace = load_trace(args.file)
    stats = locality(trace)
    stats["top1_share"] = top_share(trace.experts, trace.num_experts, 1)
    phases = trace.phases
    summary = {**_short(trace.summary()), "prompt_tokens": int((phases == 0).sum()),
               "generated_tokens": int((phases == 1).sum()),
               "chance_lag1_reuse": trace.top_k / trace.num_experts,
               "router_logits": trace.logits is not None}
    if args.json:
        doc = {"trace": summary, "layers": {k: [round(float(x), 4) for x in v] for k, v in stats.items()}}
        text = json.dumps(doc, indent=1)
        if args.json == "-":
            print(text)
            return 0
        with open(args.json, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    for key, value in summary.items():
        print(f"{key:>20}: {value}")
    names = [k for k in ("lag1_reuse", "top8_share", "top1_share") if k in stats]
    print("\n layer " + " ".join(f"{n:>11}" for n in names))
    for layer in range(trace.num_layers):
        print(f"{layer:6d} " + " ".join(f"{stats[n][layer]:11.3f}" for n in names))
    print("  mean " + " ".join(f"{np.mean(stats[n]):11.3f}" for n in names))
    print(f"lag1_reuse: share of a token's experts the token before it in the file also selected "
          f"(chance {summary['chance_lag1_reuse']:.3f})"
          + ("; tokens are in step order here, so neighbours are mostly different requests' tokens, "
             "not one request's consecutive ones" if "steps" in summary else ""))
    return 0


def _short(summary: dict) -> dict:
    """A grouped trace's ``step_tokens`` (one number per step) as its count and range."""
    sizes = summary.pop("step_tokens", None)
    if isinstance(sizes, list) and sizes:
        summary["steps"] = len(sizes)
        summary["step_tokens"] = (f"{min(sizes)}..{max(sizes)} tokens a step, "
                                  f"mean {sum(sizes) / len(sizes):.2f}")
    return summary


def _record(args) -> int:
    check_output(args.output, "-o")
    prompt = args.prompt
    if args.prompt_file is not None:
        file = Path(args.prompt_file)
        if not file.is_file():
            raise FileNotFoundError(f"prompt file not found: {file}")
        prompt = file.read_text()
    try:
        from ..integrations.record import record_trace
    except ModuleNotFoundError as err:
        if err.name and err.name.startswith(("expertcache", "torch", "transformers")):
            raise ValueError(f"trace record needs the runtime (torch and transformers: "
                             f"pip install 'expertcache[torch]'); missing module {err.name}") from None
        raise
    trace = record_trace(args.model, prompt, args.output, args.max_new_tokens, device=args.device,
                         router_logits=args.router_logits)
    print(f"wrote {args.output}: {trace.num_layers} MoE layers x {trace.num_tokens} tokens "
          f"({int((trace.phases == 0).sum())} prompt), top-{trace.top_k} of {trace.num_experts}")
    return 0
