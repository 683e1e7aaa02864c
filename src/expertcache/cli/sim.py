"""``expertcache sim TRACE``: score policies on a routing trace against the optimum.

Sizes come from ``--slots``, ``--fraction`` or ``--sweep POINTS`` (a miss-ratio
curve from the smallest legal size to every expert resident). Every result
carries the optimum's misses at the same size (``opt_misses``): the lower of Belady's
(forced admission) and MIN with bypass's (``belady+oracle``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .paths import check_output


def add_parser(sub) -> None:
    from ..config import IMATRIX_MODES, MISS_PATHS, PARTITIONS, QUANT_SLOT_FORMATS
    p = sub.add_parser("sim", help="replay a routing trace: hit rates, optimum, predicted tok/s",
                       description=__doc__)
    p.add_argument("trace", help="trace .npz, or synth:PRESET for a synthetic trace")
    p.add_argument("--policy", default="default",
                   help="EVICTION[:KEY=VALUE...][+ADMISSION[:KEY=VALUE...]][,...], e.g. "
                        "lru,slru:protected=0.5+second-hit,belady (default: the registry's default policy)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--slots", help="total slots, comma separated (e.g. 768,1536)")
    size.add_argument("--fraction", help="share of all L x E experts, in (0, 1] (e.g. 0.125,0.25)")
    size.add_argument("--sweep", type=int, metavar="POINTS", nargs="?", const=12,
                      help="miss-ratio curve over POINTS sizes (default 12)")
    p.add_argument("--partition", default="global", choices=PARTITIONS)
    p.add_argument("--tokens", type=int, help="replay only the first N tokens")
    p.add_argument("--steps", default="auto", choices=("auto", "token", "batched"),
                   help="step order: batched = the prompt as one step per layer, as the runtime "
                        "runs it; token = one step per token; auto (default) = the trace's meta "
                        "(recorded traces are batched)")
    p.add_argument("--json", metavar="OUT", help="write results as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="draw hit rate against slots")
    p.add_argument("--hardware", default="pcie4-consumer",
                   help="cost-model profile: pcie4-consumer, pcie5-consumer, h200, or a JSON "
                        "file from 'expertcache probe'")
    p.add_argument("--miss-path", default="auto", choices=MISS_PATHS)
    p.add_argument("--expert-bytes", type=int, help="bytes of one expert (else trace meta or --model)")
    p.add_argument("--model", help="expert size and FLOPs from a model preset (see presets) or a GGUF "
                   "file (header only, nothing loaded)")
    p.add_argument("--quant", metavar="TYPE", help="size a preset's experts in a ggml type, e.g. Q4_K, "
                   "Q8_0, MXFP4 (with --model PRESET)")
    p.add_argument("--slot-format", default="dequantized", choices=QUANT_SLOT_FORMATS,
                   help="quantized experts: slots hold the stored bytes (dequantized per use) or the "
                        "compute dtype (dequantized per load); changes the predicted tok/s")
    p.add_argument("--dense-bytes", type=int, default=0,
                   help="non-expert weight bytes read per token (attention, shared experts); default 0")
    p.add_argument("--workers", type=int, help="processes for SlotTable replays (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="seed for synth:PRESET traces")
    p.add_argument("--imatrix", metavar="FILE", help="expert counts (imatrix .gguf, trace, popularity "
                   "JSON, .npy) whose placement plan is pinned or seeded first (docs/imatrix.md)")
    p.add_argument("--imatrix-mode", default="pin", choices=IMATRIX_MODES,
                   help="pin: never evicted (default: at most half the cache); seed: preloaded, evictable")
    p.add_argument("--imatrix-slots", type=int, metavar="N", help="slots the plan may take")
    p.add_argument("--lag", metavar="N[,N...]",
                   help="replay as planner='device' runs: the policy N forwards behind the device "
                        "(0 = the plain replay); prints hits and experts copied per lag (sim/lag.py)")
    p.add_argument("--lag-blocks", type=int, metavar="B",
                   help="with --lag: staging blocks, 1 to the trace's layers (layer l stages into block "
                        "l %% B; default 1: every layer shares the staging rows)")
    p.add_argument("--host-budget", metavar="SIZE",
                   help="replay a RAM tier (host_memory tiered) behind the slots: a share (25%%) or bytes; "
                        "--slots 0 = no device tier (the CPU engine); prints RAM hits and file reads")
    p.add_argument("--host-policy", default="default", help="with --host-budget: the RAM tier's eviction")
    p.set_defaults(func=run)


def run(args) -> int:
    check_output(args.json, "--json")  # a finished sweep must have somewhere to go
    check_output(args.plot, "--plot")
    from ..costmodel.hardware import load_hardware
    from ..sim.mrc import OPTIMA, optimum_misses, sweep, sweep_sizes
    from ..sim.replay import Prepared, resolve_policy, slots_for_fraction
    from ..sim.report import document, expert_cost, rows

    if args.plot:
        from ..sim.plot import plot_curves  # matplotlib missing: say so before the sweep
    if args.lag_blocks is not None and args.lag is None:
        raise ValueError("--lag-blocks applies to --lag (the device planner's replay): add --lag N "
                         "or drop --lag-blocks")
    ignored = [flag for flag, value in (("--imatrix", args.imatrix), ("--plot", args.plot)) if value]
    if args.lag is not None and ignored:  # said, not silently dropped
        raise ValueError(f"--lag replays without {' or '.join(ignored)} (no placement, no plot): "
                         f"drop {' and '.join(ignored)} or run them without --lag")
    trace = _load(args.trace, args.tokens, args.seed)
    policies = [s for s in args.policy.split(",") if s.strip()]
    if not policies:
        raise ValueError("--policy is empty; name at least one, e.g. --policy lru,belady")
    specs = [resolve_policy(spec) for spec in policies]  # unknown names fail before any replay
    hw = load_hardware(args.hardware)
    cost = expert_cost(trace, args.expert_bytes, args.model, args.dense_bytes, args.quant)
    if args.sweep is not None:
        slots = sweep_sizes(trace, args.partition, args.sweep)
    elif args.slots:
        slots = _numbers(args.slots, int, "--slots")
    else:
        fractions = _numbers(args.fraction or "0.125,0.25", float, "--fraction")
        slots = [slots_for_fraction(trace, f) for f in fractions]
    prep = Prepared(trace, None if args.steps == "auto" else args.steps)
    if args.lag is not None:
        from .simlag import run_lags
        doc = document(trace, [], hw, args.miss_path, cost, args.slot_format, prep)
        with _progress(len(specs) * len(slots), always=True) as tick:
            return run_lags(prep, specs, slots, args.partition, _numbers(args.lag, int, "--lag"),
                            1 if args.lag_blocks is None else args.lag_blocks, args.json, doc, tick)
    if args.host_budget is not None:
        from .simtiers import run_tiers
        return run_tiers(prep, specs, slots, args.partition, args.host_budget, args.host_policy,
                         None if cost is None else cost.expert_bytes, args.json)
    if args.imatrix:  # placement changes every replay, so no shared sweep kernels
        from ..sim.imatrix import imatrix_replays
        results = imatrix_replays(prep, specs, slots, args.partition, args.imatrix,
                                  args.imatrix_mode, args.imatrix_slots)
    else:
        with _progress(len(policies) * len(slots)) as tick:
            results = sweep(prep, specs, slots, args.partition, workers=args.workers,
                            progress=tick)
    # The optima's runs give opt_misses (and the plot's optimum); a pinned belady is no optimum.
    optimum = [r for r in results if (r.policy, r.admission) in OPTIMA and not args.imatrix]
    opt = optimum_misses(prep, slots, args.partition, optimum)
    extra = [] if optimum or not args.plot else sweep(prep, [OPTIMA[0][0]], slots, args.partition,
                                                       workers=1)
    table = rows(trace, results, opt, cost, hw, args.miss_path, args.slot_format)
    _print_table(prep, table, hw.name, cost is not None)
    if args.json:
        Path(args.json).write_text(json.dumps(document(trace, table, hw, args.miss_path, cost,
                                                       args.slot_format, prep), indent=2) + "\n")
    if args.plot:
        title = f"{trace.meta.get('model', 'trace')}: {trace.num_tokens} tokens, {args.partition}"
        plot_curves(results + extra, args.plot, title=title,
                    total_experts=trace.num_layers * trace.num_experts)
    return 0


def _load(source: str, tokens: int | None, seed: int):
    from ..trace.format import load_trace
    if tokens is not None and tokens < 1:
        raise ValueError(f"--tokens must be at least 1, got {tokens}")
    if source.startswith("synth:"):
        from ..trace.synth import synth_trace
        trace = synth_trace(source[len("synth:"):], tokens or 2000, seed=seed)
    else:
        trace = load_trace(source)
    if tokens is not None and tokens < trace.num_tokens:
        trace = trace.slice_tokens(tokens)
    return trace


def _numbers(text: str, kind, flag: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated {kind.__name__}s, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag} is empty")
    return values


class _progress:
    """A rich progress bar on stderr for sweeps with more than a handful of jobs (``always``:
    from two jobs on, each being a long replay)."""

    def __init__(self, total: int, always: bool = False) -> None:
        self.total, self.bar = total, None
        self.least = 1 if always else 4

    def __enter__(self):
        if self.total > self.least and sys.stderr.isatty():
            from rich.progress import Progress
            self.bar = Progress(transient=True)
            self.bar.start()
            self.task = self.bar.add_task("replaying", total=self.total)
        return self.tick

    def tick(self, done: int, total: int) -> None:
        if self.bar:
            self.bar.update(self.task, completed=done)

    def __exit__(self, *exc) -> None:
        if self.bar:
            self.bar.stop()


COLUMNS = ("policy", "partition", "slots", "hit rate", "misses", "opt misses", "x opt", "tok/s")
# Box characters as rich draws a heavy-headed table; plain ASCII where stdout cannot encode them.
_BOX = {"utf": ("┏━┳┓", "┃", "┡━╇┩", "│", "└─┴┘"), "ascii": ("+-++", "|", "+=++", "|", "+-++")}


def _print_table(prep, table: list[dict], hw_name: str, has_cost: bool) -> None:
    """The results as a text table on stdout (written out here: importing rich for it
    took a quarter of a whole ``expertcache sim`` run)."""
    from ..sim.report import trace_header
    rows = []
    for row in table:
        opt = row["opt_misses"]
        rows.append((row["label"], row["partition"], str(row["slots"]), f"{row['hit_rate']:.4f}",
                     str(row["misses"]), str(opt), f"{row['misses'] / opt:.2f}" if opt else "-",
                     f"{row['predicted_tok_s']:.1f}" if row["predicted_tok_s"] else "-"))
    widths = [max([len(col)] + [len(r[i]) for r in rows]) for i, col in enumerate(COLUMNS)]
    encoding = (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "")
    top, head_bar, rule, bar, bottom = _BOX["utf" if encoding.startswith("utf") else "ascii"]

    def border(chars: str) -> str:
        left, fill, mid, right = chars
        return left + mid.join(fill * (w + 2) for w in widths) + right

    def cells(values, sep: str) -> str:
        return sep + sep.join(f" {v:<{w}} " if i < 2 else f" {v:>{w}} "  # names left, numbers right
                              for i, (v, w) in enumerate(zip(values, widths))) + sep

    width = sum(widths) + 3 * len(widths) + 1
    caption = (f"x opt: misses / the optimum's (the lower of Belady and MIN with bypass); "
               f"tok/s: cost model on {hw_name}")
    lines = [trace_header(prep.trace), border(top), cells(COLUMNS, head_bar), border(rule),
             *(cells(r, bar) for r in rows), border(bottom), caption.center(width).rstrip()]
    if not has_cost:
        lines.append("tok/s and bytes moved need the expert size: give --expert-bytes or --model")
    sys.stdout.write("\n".join(lines) + "\n")
