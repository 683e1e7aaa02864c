"""Does imatrix-style placement help a recency cache? Replays of the shared Qwen3 traces.

For each scenario (counts learned on one token stream, replayed on another) and
each cache size / partition, compare: plain LRU (``none``), LRU warm-started
with the plan (``seed``) and LRU over the slots left after pinning the plan
(``pin`` at 25%, 50% and 75% of the cache). Every replay is a cold-start
SlotTable run, token-major, the same semantics as the reference figures.

    .venv/bin/python benchmarks/imatrix_study.py [--tokens N] [--json OUT]

Scenarios: ``self`` (counts from the replayed tokens themselves: an upper
bound no real imatrix reaches), ``held-out`` (first half -> second half of the
same corpus) and ``cross`` (code -> general, general -> code).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from expertcache import SlotTable
from expertcache.imatrix import apply_imatrix, plan_coverage, table_plan, trace_counts
from expertcache.trace import load_trace

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
FRACTIONS = (0.125, 0.25)            # cache size as a share of all experts
PARTITIONS = ("global", "per-layer")
MODES = (("none", None), ("seed", None), ("pin", 0.25), ("pin", 0.5), ("pin", 0.75))


def replay(trace, slots: int, partition: str, mode: str = "none", counts=None,
           pin_share: float | None = None, policy: str = "lru") -> dict:
    """Hit rate of one cold-start replay; with a plan pinned or seeded first."""
    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    table = SlotTable(L, E, slots, eviction=policy, partition=partition, top_k=K)
    placed = []
    if mode != "none":
        placed = table_plan(counts, table, mode, _budget(table, pin_share))
        apply_imatrix(table, placed, mode)
    for token in trace.experts.transpose(1, 0, 2).tolist():  # T, L, K
        for layer, experts in enumerate(token):
            table.step(layer, experts)
    # How much of the replayed routing the plan's experts actually received.
    realised = plan_coverage(trace_counts(trace).counts, placed)["mean_share"] if placed else 0.0
    return {"hit_rate": round(table.stats().total().hit_rate, 4), "placed": len(placed),
            "plan_share_replayed": round(realised, 4)}


def _budget(table: SlotTable, share: float | None) -> int | None:
    """Slots a pin plan takes: ``share`` of each partition (None: the library default)."""
    if share is None:
        return None
    per = int(table.partition_capacity * share)
    return per * (table.num_layers if table.partition == "per-layer" else 1)


def _fits(trace, slots: int, partition: str, share: float) -> bool:
    cap = slots if partition == "global" else slots // trace.num_layers
    return cap - int(cap * share) >= trace.top_k


def scenarios(code, general) -> list[tuple[str, str, object, object]]:
    """(name, kind, counts source trace, replayed trace)."""
    half = code.num_tokens // 2
    tail = lambda t: _tokens(t, half, t.num_tokens)  # noqa: E731
    return [
        ("code->code", "self", code, code),
        ("general->general", "self", general, general),
        ("code[:h]->code[h:]", "held-out", _tokens(code, 0, half), tail(code)),
        ("general[:h]->general[h:]", "held-out", _tokens(general, 0, half), tail(general)),
        ("code->general", "cross", code, general),
        ("general->code", "cross", general, code),
    ]


def _tokens(trace, start: int, stop: int):
    from expertcache.trace import Trace

    return Trace(trace.experts[:, start:stop].copy(), dict(trace.meta))


def run_study(code, general, log=print) -> list[dict]:
    rows, baseline = [], {}
    for name, kind, source, target in scenarios(code, general):
        counts = trace_counts(source)
        for fraction in FRACTIONS:
            slots = round(fraction * target.num_layers * target.num_experts)
            for partition in PARTITIONS:
                for mode, share in MODES:
                    key = (id(target), slots, partition)
                    if mode == "none" and key in baseline:
                        result = baseline[key]
                    elif share is not None and not _fits(target, slots, partition, share):
                        continue  # pinning that much would leave fewer than top_k slots
                    else:
                        t0 = time.perf_counter()
                        result = replay(target, slots, partition, mode, counts, share)
                        result["seconds"] = round(time.perf_counter() - t0, 2)
                        if mode == "none":
                            baseline[key] = result
                    label = mode if share is None else f"pin{int(share * 100)}"
                    row = {"scenario": name, "kind": kind, "fraction": fraction, "slots": slots,
                           "partition": partition, "mode": label, **result}
                    rows.append(row)
                    log(_line(row))
    return rows


def warmup(code, general, lengths=(32, 128), fraction: float = 0.125) -> list[dict]:
    """Cold start: hit rate over only the first N replayed tokens (global pool), where a
    seed's head start is not yet diluted by thousands of steady-state tokens."""
    half = code.num_tokens // 2
    pairs = [("code[:h]->code[h:]", _tokens(code, 0, half), _tokens(code, half, code.num_tokens)),
             ("general[:h]->general[h:]", _tokens(general, 0, half),
              _tokens(general, half, general.num_tokens)),
             ("code->general", code, general)]
    rows = []
    for name, source, target in pairs:
        counts = trace_counts(source)
        slots = round(fraction * target.num_layers * target.num_experts)
        for n in lengths:
            head = target.slice_tokens(n)
            rates = {label: replay(head, slots, "global", mode, counts, share)["hit_rate"]
                     for label, mode, share in (("none", "none", None), ("seed", "seed", None),
                                                ("pin50", "pin", 0.5))}
            rows.append({"scenario": name, "tokens": n, "slots": slots, **rates})
    return rows


def _line(row: dict) -> str:
    return (f"{row['scenario']:<26} {row['fraction']:>6.3f} {row['partition']:<9} {row['mode']:<6} "
            f"hit {row['hit_rate']:.4f}  placed {row['placed']:>4}  plan share {row['plan_share_replayed']:.3f}")


def table_markdown(rows: list[dict]) -> str:
    """One line per (scenario, size, partition): hit rates side by side, best in bold."""
    labels = [m if s is None else f"pin{int(s * 100)}" for m, s in MODES]
    out = ["| scenario | cache | partition | " + " | ".join(labels) + " |",
           "|---|---|---|" + "---|" * len(labels)]
    groups: dict[tuple, dict] = {}
    for r in rows:
        groups.setdefault((r["scenario"], r["fraction"], r["partition"]), {})[r["mode"]] = r["hit_rate"]
    for (scenario, fraction, partition), rates in groups.items():
        best = max(rates.values())
        cells = [("-" if m not in rates else f"**{rates[m]:.4f}**" if rates[m] == best
                  else f"{rates[m]:.4f}") for m in labels]
        out.append(f"| {scenario} | {fraction:.1%} | {partition} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def mixtral_transfer(folder: Path, fractions=(0.125, 0.25)) -> list[dict]:
    """Static coverage only (no traces exist): a plan from one MMLU subject's popularity
    scored on another subject's counts, against the plan of that subject itself."""
    import itertools

    from expertcache.imatrix import load_counts, placement_keys

    files = sorted(folder.glob("mixtral_8x7b_original-*.json"))
    counts = {f.stem.split("original-")[1]: load_counts(f).counts for f in files}
    if len(counts) < 2:
        return []
    rows = []
    for fraction in fractions:
        n = round(fraction * next(iter(counts.values())).size)
        share = lambda a, b: plan_coverage(counts[b], placement_keys(counts[a], n))["mean_share"]  # noqa: E731
        cross = [share(a, b) for a, b in itertools.permutations(counts, 2)]
        rows.append({"fraction": fraction, "experts": n, "uniform": fraction,
                     "self": round(float(np.mean([share(b, b) for b in counts])), 4),
                     "cross_mean": round(float(np.mean(cross)), 4), "cross_min": round(min(cross), 4)})
    return rows


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}; Python {platform.python_version()}; numpy {np.__version__}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=TRACES, help="folder with the shared Qwen3 traces")
    p.add_argument("--tokens", type=int, help="replay only the first N tokens of each trace")
    p.add_argument("--json", type=Path, help="also write the rows and the machine as JSON")
    p.add_argument("--only", choices=("replays", "warmup", "mixtral"),
                   help="run one part (default: all three)")
    args = p.parse_args(argv)
    paths = [args.traces / f"qwen3-30b-a3b-{name}.npz" for name in ("code", "general")]
    missing = [str(x) for x in paths if not x.exists()]
    if missing:
        print(f"missing shared traces: {', '.join(missing)}", file=sys.stderr)
        return 2
    code, general = (load_trace(x) for x in paths)
    if args.tokens:
        code, general = code.slice_tokens(args.tokens), general.slice_tokens(args.tokens)
    t0 = time.perf_counter()
    info = {"machine": machine(), "tokens": code.num_tokens,
            "command": "python benchmarks/imatrix_study.py " + " ".join(argv or sys.argv[1:])}
    if args.only in (None, "replays"):
        info["rows"] = run_study(code, general)
        print()
        print(table_markdown(info["rows"]))
    if args.only in (None, "warmup"):
        info["warmup"] = warmup(code, general)
        for row in info["warmup"]:
            print(f"warm-up {row['scenario']:<26} first {row['tokens']:>4} tokens, {row['slots']} slots: "
                  f"none {row['none']:.4f}  seed {row['seed']:.4f}  pin50 {row['pin50']:.4f}")
    info["mixtral"] = mixtral_transfer(args.traces / "mixtral-popularity") if args.only in (None, "mixtral") else []
    info["seconds"] = round(time.perf_counter() - t0, 1)
    for row in info["mixtral"]:
        print(f"mixtral popularity, plan of {row['experts']} experts ({row['fraction']:.1%}): covers "
              f"{row['self']:.3f} of its own subject, {row['cross_mean']:.3f} of another "
              f"(min {row['cross_min']:.3f}); uniform {row['uniform']:.3f}")
    print(f"\n{info['machine']}; {info['seconds']} s")
    if args.json:
        args.json.write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
