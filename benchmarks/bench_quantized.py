"""Decode at real Qwen3-30B-A3B expert sizes: bf16 experts vs Q4_K experts, one pool budget.

Issue 11's benchmark. Qwen3-30B-A3B's expert shape (hidden 2048, expert FF 768, 128 experts,
top-8), the first ``--layers`` MoE layers of a real routing trace, in two precisions on the
same trace slice and the same byte budget for the pool:

* **bf16**: the existing bench path (``bench.model.host_experts``: random bf16 experts,
  9 MiB each);
* **Q4_K** (Q4_K_M-like): gate and up in Q4_K, down in Q6_K, 2.92 MiB per expert, held as
  the runtime's ``QuantExperts`` with the ``Codec`` the GGUF loader builds for Qwen3
  (gate rows then up rows). The bytes are valid random blocks from ``random_blocks`` in
  ``tests/quant_fixtures.py`` (imported from there, not copied: K-quant blocks are random
  bytes with their fp16 scales set to small finite values, so every bit pattern the
  dequantizer reads is a legal file). A real Qwen3-30B-A3B Q4_K_M file averages 2.72 MiB
  per expert because llama.cpp's Q4_K_M keeps ``ffn_down_exps`` in Q6_K in only half the
  layers (``use_more_bits``) and in Q4_K (2.53 MiB experts) in the rest; the runtime needs
  one expert layout for all layers, so the bench takes the larger one throughout.

Budget: what the bf16 cache with ``--fraction`` of all L x 128 experts takes, its top-k
staging slots included (25%: 32 x L bf16 slots + 8). Every cache gets it as
``gpu_memory``, so the runtime's own sizing decides the slots: Q4_K ``quantized`` slots
hold the stored bytes (about 3x more slots: 3.1x, less the per-step dequantization scratch),
``dequantized`` slots hold bf16 weights (as many as bf16, less one landing buffer).
Compute dtype is bf16 in both arms (the GGUF loader's default on CUDA; on the CPU it
defaults to fp32, which would halve the dequantized slots).

Strategies, per precision, each on a fresh runtime ``ExpertCache`` through the bench's
runner (``bench.live.run_strategy``: ``run_step`` per layer per token, residual + RMS norm
between layers): ``copy-every-pass`` and ``cpu`` baselines, and the cache (``--policy``,
default ``default``) with bf16 slots, Q4_K ``quantized`` slots and Q4_K ``dequantized``
slots. The Q4_K copy-every-pass uses the runtime's ``auto`` slot format (dequantized on
the CPU, quantized on CUDA: the same dequantization work per expert either way).
``--repeats`` runs of every strategy, interleaved (the order rotates each repeat), so
load from other processes spreads over all of them; the table gives the median steady
ms/token and the min-max over repeats. Steady = decode tokens N/4 to N-1 (decode_phases).

Checks (the run exits 1 if one fails): H2D bytes = misses x stored expert bytes per cache
(L x k x stored bytes per token for copy-every-pass, 0 for cpu; bench.checks, with the Q4_K stored
bytes); each cache's hits and misses equal ``expertcache sim``'s replay; every repeat of a
strategy gives the same outputs and counts; within each precision every strategy's final
hidden vectors equal copy-every-pass's: the pool strategies bit for bit (same bf16
weights, the same looped matmul in the same rank order), ``cpu`` within float tolerance
(it sums experts in another order; 5% of the largest output, bench.checks' bf16 tolerance);
on CUDA bit equality is recorded and the tolerance decides (the grouped matmul runs over
pools of different sizes there); and the Q4_K host tier dequantizes exactly as
``gguf.quants.dequantize`` for one expert. The cost model (calibrated on this device with
the bench's own code, plus the measured host dequantization rate) predicts every row.

What the CPU figures mean, and what they cannot show. On a CPU the "device" is host
memory: a slot load is a memcpy, a hit is a bf16 matrix-vector product from a second
host buffer, and torch dequantizes K-quant blocks at ~0.4-0.6 G weights/s on one thread,
about 8-10 ms per 4.7 M-weight expert against ~1 ms for its bf16 math (docs/quantized.md,
CONTEXT.md). So per-use dequantization (``quantized`` slots, the ``cpu`` path, Q4_K
copy-every-pass) costs far more than everything else, ``dequantized`` slots should win
among the Q4_K rows (they dequantize once per miss), and bf16 beats Q4_K throughout: the
3.1x smaller copies save less than the dequantization costs. The hit rates and H2D bytes
are device-independent and say what the GPU will see (more slots per byte -> more hits;
3.1x fewer bytes per miss); the times cannot say whether Q4_K wins on a GPU, where a
copy crosses PCIe at ~25-50 GB/s and dequantization runs at device memory bandwidth
(microseconds per expert). ``cpu`` rows here are not llama.cpp's ``--cpu-moe``, which
computes on packed blocks without dequantizing. ``benchmarks/gpu_check.sh`` runs this
script on CUDA at full size for the real answer.

Measured here (benchmarks/results/bench_quantized_cpu.json, 2-core EPYC, 4 layers, 64 tokens):
``dequantized`` slots 144.7 ms/token, Q4_K cpu 322, copy-every-pass 356, ``quantized`` slots
1262 against bf16 31-47. ``quantized`` slots are 3.5x worse than copy-every-pass, which
dequantizes as many experts per token: ``SlotPool.view`` decodes a step's 8 experts in one
batch, and on this CPU one 8-expert decode takes ~300 ms against ~75 ms for 8 one-expert
decodes (fp32 temporaries of 50-100 MB per kind, far beyond the 32 MiB L3). On a GPU the batch
is the right call (fewer launches); on the CPU the view should decode per expert.

    PYTHONPATH=src python benchmarks/bench_quantized.py --layers 4 --tokens 64 --repeats 3 \\
        --json benchmarks/results/bench_quantized_cpu.json --plot benchmarks/results/bench_quantized_cpu.png
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # random_blocks: valid random GGUF blocks of any type
from quant_fixtures import random_blocks  # noqa: E402

from expertcache.bench.checks import run_checks  # noqa: E402
from expertcache.bench.live import Inputs, pick_clock, run_strategy  # noqa: E402
from expertcache.bench.model import BenchShape, experts_module, host_experts  # noqa: E402
from expertcache.bench.report import machine, predicted_ms  # noqa: E402
from expertcache.bench.run import resolve_device  # noqa: E402
from expertcache.bench.strategies import Strategy, default_policy  # noqa: E402
from expertcache.bench.workload import load_workload  # noqa: E402
from expertcache.config import CacheConfig  # noqa: E402
from expertcache.decode_phases import ms_per_token, steady_start  # noqa: E402
from expertcache.quant.formats import quant_format  # noqa: E402
from expertcache.runtime import experts as experts_mod  # noqa: E402
from expertcache.runtime.engine import ExpertCache  # noqa: E402
from expertcache.runtime.host import resident  # noqa: E402
from expertcache.runtime.quantized import Codec, Kind, Part, QuantExperts  # noqa: E402
from expertcache.costmodel import ExpertCost, token_time  # noqa: E402
from expertcache.sim.replay import Prepared, replay, resolve_policy  # noqa: E402
from expertcache.stats import DECODE  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "qwen3-30b-a3b-code.npz"
RESULTS = ROOT / "benchmarks" / "results"
MiB = 2 ** 20


# -- the Q4_K host tier ---------------------------------------------------------------------
def q4k_codec(hidden: int, ff: int, down: str = "Q6_K") -> Codec:
    """Qwen3 experts as the GGUF loader decodes them: gate/up Q4_K [I, H], down ``down`` [H, I]."""
    q4k = quant_format("Q4_K")
    parts = (Part("down.weight", quant_format(down), (hidden, ff)),
             Part("gate.weight", q4k, (ff, hidden)), Part("up.weight", q4k, (ff, hidden)))
    kinds = (Kind("gate_up_proj", "concat", ("gate.weight", "up.weight")),
             Kind("down_proj", "one", ("down.weight",)))
    return Codec(parts, kinds, torch.bfloat16)


def q4k_hosts(codec: Codec, layers: int, experts: int, seed: int, pin: bool) -> list[QuantExperts]:
    """One QuantExperts per layer: each part ``[E, bytes per expert]`` uint8 of valid random blocks."""
    rng = np.random.default_rng(seed)
    hosts = []
    for _ in range(layers):
        tensors = {}
        for p in codec.parts:
            rows, cols = p.shape
            blocks = random_blocks(p.fmt, experts * rows, cols, rng)  # [E*rows, row_bytes]
            t = torch.from_numpy(blocks.reshape(experts, p.nbytes))
            tensors[p.name] = resident(t, "pinned" if pin else "copy")
        hosts.append(QuantExperts(tensors, codec, "pinned" if pin else "copy",
                                  "bench: random Q4_K/Q6_K blocks built in RAM"))
    return hosts


def check_dequant(host: QuantExperts) -> bool:
    """Expert 0 of ``host`` decodes exactly as gguf-py's numpy reference (cast to the compute dtype)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as ref_dequantize

    codec = host.codec
    ours = {k: v.float() for k, v in host.expert(0).items()}
    ref = {p.name: torch.from_numpy(ref_dequantize(host.tensors[p.name][0].cpu().numpy().reshape(
        p.shape[0], -1), GGMLQuantizationType(p.fmt.ggml_type))).to(codec.dtype).float() for p in codec.parts}
    want = {"gate_up_proj": torch.cat([ref["gate.weight"], ref["up.weight"]]), "down_proj": ref["down.weight"]}
    return all(torch.equal(ours[k], want[k]) for k in want)


# -- what runs ------------------------------------------------------------------------------
@dataclass
class Case:
    """One row of the table: a strategy in one precision and slot format."""

    precision: str                 # "bf16" | "Q4_K"
    strategy: Strategy
    config: CacheConfig
    runs: list = field(default_factory=list)      # bench.live.Run per repeat
    dequant: list = field(default_factory=list)   # steady dequantization s/token per repeat (CPU)
    slot_format: str = ""
    slots: int = 0
    staging: int = 0

    @property
    def title(self) -> str:
        return self.strategy.title if self.strategy.kind != "cache" else f"cache {self.strategy.label}"


def cases(policies: list[str], budget: int, partition: str) -> list[Case]:
    out = []
    for precision, formats in (("bf16", ("auto",)), ("Q4_K", ("quantized", "dequantized"))):
        for base in ("copy-every-pass", "cpu"):
            out.append(Case(precision, Strategy(base), CacheConfig(baseline=base, partition=partition)))
        for spec in policies:
            p = resolve_policy(spec)
            for fmt in formats:
                cfg = CacheConfig(gpu_memory=budget, eviction=p.spec.eviction, admission=p.spec.admission,
                                  partition=partition, slot_format=fmt)
                out.append(Case(precision, Strategy("cache", None, p), cfg))
    return out


class DequantClock:
    """Seconds per decode token spent in ``Codec.decode`` (CPU only: CUDA kernels are async).

    Wraps ``Codec.decode`` and, to find token boundaries, ``runtime.experts.run_step``
    (layer 0 starts a token), both restored afterwards. On the CPU the dequantization sits
    inside a part of the bench's breakdown: the copy (dequantized slots), the compute
    (the cpu path) or neither (quantized slots' ``view``); the table moves it out.
    """

    def __init__(self, clock) -> None:
        self.clock, self.tokens, self.on = clock, [], False

    @contextmanager
    def attach(self):
        decode, step = Codec.decode, experts_mod.run_step

        def timed_decode(codec, data):
            start = self.clock()
            try:
                return decode(codec, data)
            finally:
                if self.on:
                    self.tokens[-1] += self.clock() - start

        def marked_step(cache, layer, *args):
            if layer == 0:
                self.on = cache.phase == DECODE
                if self.on:
                    self.tokens.append(0.0)
            return step(cache, layer, *args)

        Codec.decode, experts_mod.run_step = timed_decode, marked_step
        try:
            yield self
        finally:
            Codec.decode, experts_mod.run_step = decode, step


def run_case(case: Case, hosts, module, inputs, top_k, device, clock) -> None:
    cache = ExpertCache(case.config, hosts, top_k, device)
    case.slot_format, case.slots, case.staging = cache.slot_format, cache.pool.slots, cache.pool.staging
    strategy = case.strategy
    if strategy.kind == "cache":  # the table's size, for the sim check and the row
        strategy = case.strategy = replace(strategy, slots=cache.table.slots)
    dq = DequantClock(clock)
    with dq.attach():
        run = run_strategy(cache, strategy, module, inputs, clock)
    n = len(dq.tokens[steady_start(len(dq.tokens)):])
    case.dequant.append(sum(dq.tokens[steady_start(len(dq.tokens)):]) / n if n else 0.0)
    case.runs.append(run)
    del cache
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- figures --------------------------------------------------------------------------------
def predict(case: Case, run, codec: Codec, shape_q, shape_b, hw, staging, hw_q) -> float | None:
    """The cost model's steady ms/token; Q4_K rows with the slot format and dequantization terms."""
    if hw is None:
        return None
    if case.precision == "bf16":
        return predicted_ms(run, shape_b, hw, staging)
    cost = ExpertCost(codec.expert_bytes, 2.0 * codec.params, compute_bytes=codec.compute_bytes)
    L, k = shape_q.layers, shape_q.top_k
    fmt = case.slot_format if case.slot_format != "plain" else "dequantized"
    kind = case.strategy.kind
    if kind == "copy-every-pass":
        t = token_time(0, L * k, cost, replace(staging, cpu_dequant_gelems=hw_q.cpu_dequant_gelems,
                                                device_dequant_gelems=hw_q.device_dequant_gelems),
                       layers=L, miss_path="fetch", slot_format=fmt)
    elif kind == "cpu":
        t = token_time(0, L * k, cost, hw_q, layers=L, miss_path="cpu", slot_format=fmt)
    else:
        tokens = run.steady.accesses / (L * k)
        if not tokens:
            return None
        t = token_time(run.steady.hits / tokens, run.steady.misses / tokens, cost, hw_q, layers=L,
                       miss_path="fetch", slot_format=fmt)
    return 1e3 * t


def summarise(case: Case, stored_bytes: int, cpu: bool, pred: float | None) -> dict:
    runs = case.runs
    steady = [ms_per_token(r.seconds)["steady"] for r in runs]
    med = statistics.median(steady)
    ref = runs[0]
    n = len(ref.seconds)
    d, s = ref.decode, ref.steady
    row = {"precision": case.precision, "strategy": case.strategy.kind, "policy": case.strategy.policy,
           "slot_format": case.slot_format if case.strategy.kind != "cpu" else "host",
           "slots": case.slots, "staging": case.staging, "slot_bytes": ref.slot_bytes,
           "expert_bytes": stored_bytes, "accesses": d.accesses, "hits": d.hits, "misses": d.misses,
           "hit_rate": d.hit_rate if d.accesses else None,
           "steady_hit_rate": s.hit_rate if s.accesses else None,
           "h2d_bytes_per_token": ref.h2d_decode / n if n else None,
           "ms_per_token": {ph: statistics.median(ms_per_token(r.seconds)[ph] or 0.0 for r in runs)
                            for ph in ("cold", "warm", "steady")},
           "steady_ms_repeats": steady, "steady_ms_min": min(steady), "steady_ms_max": max(steady),
           "tok_s": 1e3 / med if med else None,
           "wall_steady_ms_repeats": [ms_per_token(r.wall)["steady"] for r in runs],
           "predicted_ms_per_token": pred, "predicted_ratio": pred / med if pred and med else None}
    if cpu and all(r.parts for r in runs):
        parts = {k: statistics.median(1e3 * r.parts[k] for r in runs) for k in ("plan", "copy", "compute")}
        dq = statistics.median(1e3 * x for x in case.dequant)
        copy, math = parts["copy"], parts["compute"]
        if case.slot_format == "dequantized" and case.strategy.kind != "cpu":
            copy -= dq                    # dequantized slots: decoded inside pool.load
        elif case.strategy.kind == "cpu":
            math -= dq                    # cpu path: decoded inside cpu_experts
        other = med - parts["copy"] - parts["compute"] - (dq if case.slot_format == "quantized"
                                                            and case.strategy.kind != "cpu" else 0.0)
        row["steady_breakdown_ms"] = {"plan": parts["plan"], "copy": copy, "dequant": dq, "math": math,
                                      "other": other}
    return row


def check_outputs(group: list[Case], strict: bool = True) -> dict:
    """Within one precision: repeats identical; pool strategies bit-equal to copy-every-pass, cpu close.

    ``strict`` (the CPU): bit equality is required of the repeats and the pool strategies.
    On CUDA it is recorded, and a relative difference within the tolerance passes: the
    device's grouped matmul runs over pools of different sizes (the whole pool, or a
    quantized step's scratch) and this check has not yet been seen on a GPU."""
    from expertcache.quant import ggml

    ref = group[0].runs[0].outputs
    scale = float(ref.abs().max()) or 1.0
    # on a CPU with ggml, quantized slots compute with ggml's kernels (8-bit activations) and
    # dequantized slots with torch: bit equality holds only between strategies of one format
    ggml_cpu = strict and ggml.available()[0]
    out = {"reference": group[0].title, "repeats_identical": True, "strategies": {}}
    for case in group:
        first = case.runs[0]
        for r in case.runs[1:]:
            if not torch.equal(r.outputs, first.outputs) or (r.decode.hits, r.decode.misses) != (
                    first.decode.hits, first.decode.misses):
                out["repeats_identical"] = False
                out["repeats_max_abs_diff"] = max(out.get("repeats_max_abs_diff", 0.0),
                                                  float((r.outputs - first.outputs).abs().max()))
        diff = float((first.outputs - ref).abs().max())
        pool = case.strategy.kind != "cpu" and not (ggml_cpu and case.slot_format != group[0].slot_format)
        fmt = "host" if case.strategy.kind == "cpu" else case.slot_format
        out["strategies"][f"{case.title} [{fmt}]"] = {
            "bit_equal": bool(torch.equal(first.outputs, ref)), "max_abs_diff": diff,
            "relative": diff / scale, "must_be_bit_equal": pool and strict}
    # cpu sums experts per token in expert order, the pool in rank order: bf16 rounding only;
    # the tolerance is bench.checks' for bf16 (5% of the largest output)
    repeats_ok = out["repeats_identical"] or (not strict and out["repeats_max_abs_diff"] <= 5e-2 * scale)
    out["ok"] = repeats_ok and all(
        v["bit_equal"] if v["must_be_bit_equal"] else v["relative"] <= 5e-2 for v in out["strategies"].values())
    return out


def print_table(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    head = (f"{'prec':5} {'strategy':26} {'format':11} {'slots':>5} {'pool MiB':>8} {'hit':>5} "
            f"{'H2D MiB/tok':>11} {'steady ms/tok [min-max]':>24} {'tok/s':>6} {'pred':>6} {'p/m':>5} "
            f"{'copy/deq/math/other ms':>24} {'sim hit':>7} {'sim MiB/t':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        name = r["strategy"] if r["strategy"] != "cache" else f"cache {r['policy']}"
        ms = r["ms_per_token"]["steady"]
        bd = r.get("steady_breakdown_ms")
        parts = "/".join(f"{bd[k]:.1f}" for k in ("copy", "dequant", "math", "other")) if bd else "-"
        hit = "-" if r["steady_hit_rate"] is None else f"{r['steady_hit_rate']:.3f}"
        pred = "-" if r["predicted_ms_per_token"] is None else f"{r['predicted_ms_per_token']:.1f}"
        ratio = "-" if r["predicted_ratio"] is None else f"{r['predicted_ratio']:.2f}"
        spread = f"{ms:.1f} [{r['steady_ms_min']:.1f}-{r['steady_ms_max']:.1f}]"
        print(f"{r['precision']:5} {name:26} {r['slot_format']:11} {r['slots']:5d} "
              f"{r['slot_bytes'] / MiB:8.0f} {hit:>5} {r['h2d_bytes_per_token'] / MiB:11.1f} "
              f"{spread:>24} {r['tok_s']:6.1f} {pred:>6} {ratio:>5} {parts:>24} "
              f"{r['sim_long']['hit_rate']:7.3f} {r['sim_long']['h2d_bytes_per_token'] / MiB:9.1f}")


def plot(rows: list[dict], path: Path, title: str, quant: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [("cache " + r["policy"] if r["strategy"] == "cache" else r["strategy"])
              + ("" if r["strategy"] != "cache" or r["precision"] == "bf16" else f"\n{r['slot_format']}")
              for r in rows]
    colors = ["tab:blue" if r["precision"] == "bf16" else "tab:orange" for r in rows]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), dpi=110)
    ms = [r["ms_per_token"]["steady"] for r in rows]
    err = [[m - r["steady_ms_min"] for m, r in zip(ms, rows)], [r["steady_ms_max"] - m for m, r in zip(ms, rows)]]
    panels = ((axes[0], ms, "steady ms/token (MoE part), median, min-max bars", err),
              (axes[1], [r["steady_hit_rate"] or 0.0 for r in rows], "steady hit rate", None),
              (axes[2], [r["h2d_bytes_per_token"] / MiB for r in rows], "H2D MiB per decode token", None))
    for ax, ys, label, yerr in panels:
        ax.bar(x, ys, color=colors, yerr=yerr, capsize=3)
        for xi, y in zip(x, ys):
            ax.annotate(f"{y:.3g}", (xi, y), ha="center", va="bottom", fontsize=7,
                        xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(label, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    for r_i, r in enumerate(rows):  # slot counts under the hit-rate bars
        if r["slots"]:
            axes[1].annotate(f"{r['slots']} slots", (r_i, 0.02), ha="center", fontsize=6, rotation=90,
                             color="white")
    from matplotlib.patches import Patch
    size = {r["precision"]: r["expert_bytes"] / MiB for r in rows}
    axes[0].legend(handles=[Patch(color="tab:blue", label=f"bf16 ({size['bf16']:.2f} MiB/expert)"),
                            Patch(color="tab:orange", label=f"{quant} ({size['Q4_K']:.2f} MiB/expert)")],
                   fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE) if TRACE.exists() else None,
                    help="routing trace .npz (default: ../shared/traces/qwen3-30b-a3b-code.npz; "
                         "synthetic Qwen3 routing when absent)")
    ap.add_argument("--layers", type=int, default=4, help="first N MoE layers (default 4)")
    ap.add_argument("--tokens", type=int, default=64, help="first N tokens of the trace (default 64)")
    ap.add_argument("--fraction", type=float, default=0.25,
                    help="pool budget: this share of all bf16 experts, plus top-k staging (default 0.25)")
    ap.add_argument("--policy", default=None, help="cache policies, comma separated (default: default)")
    ap.add_argument("--partition", default="global", choices=("global", "per-layer"))
    ap.add_argument("--repeats", type=int, default=3, help="runs per strategy, interleaved (default 3)")
    ap.add_argument("--sim-tokens", type=int, default=4000,
                    help="also replay the caches' exact configuration in the simulator over this many "
                         "tokens of the trace (hit rate and H2D bytes in the long run; default 4000)")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size (multiple of 256; default 2048)")
    ap.add_argument("--expert-ff", type=int, default=768, help="expert FF size (multiple of 256; default 768)")
    ap.add_argument("--down", default="Q6_K", help="down_proj type (Q6_K as Q4_K_M; Q4_K: 2.53 MiB experts)")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: 1 on the CPU device, for the CPU-time clock; "
                         "torch's default on CUDA, where the cpu baselines should use every core)")
    ap.add_argument("--hardware", default="calibrate", choices=("calibrate", "none"),
                    help="cost-model predictions from rates measured here, or none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON")
    ap.add_argument("--plot", metavar="OUT.png", help="draw the table")
    args = ap.parse_args(argv)

    dev = resolve_device(args.device)
    if args.threads or dev.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    clock_name, clock = pick_clock("auto", dev)
    policies = [p.strip() for p in (args.policy or default_policy()).split(",") if p.strip()]
    trace, preset = load_workload(args.trace, "qwen3-30b-a3b", args.tokens, args.layers, seed=args.seed)
    L, E, k = trace.num_layers, trace.num_experts, trace.top_k
    shape_b = BenchShape(preset.name, L, E, k, args.hidden, args.expert_ff, "bf16")
    codec = q4k_codec(args.hidden, args.expert_ff, args.down)
    budget = (round(args.fraction * L * E) + k) * shape_b.expert_bytes
    say = lambda msg: print(msg, flush=True)  # noqa: E731
    started = time.time()
    say(f"{L} layers x {E} experts, top-{k}, hidden {args.hidden}, FF {args.expert_ff}; bf16 "
        f"{shape_b.expert_bytes / MiB:.2f} MiB, Q4_K/{args.down} {codec.expert_bytes / MiB:.3f} MiB per expert; "
        f"pool budget {budget / MiB:.0f} MiB; {dev}, {torch.get_num_threads()} thread(s), {clock_name} clock")
    pin = dev.type == "cuda"
    module = experts_module(shape_b).to(dev)
    hosts_b = host_experts(shape_b, seed=args.seed, pin=pin)
    hosts_q = q4k_hosts(codec, L, E, args.seed, pin)
    say(f"built host experts in {time.time() - started:.0f} s")
    dequant_ok = check_dequant(hosts_q[0])
    inputs = Inputs(trace, args.hidden, torch.bfloat16, dev, args.seed)

    hw = staging = hw_q = None
    if args.hardware == "calibrate":
        from expertcache.bench.calibrate import calibrate
        hw, staging = calibrate(module, hosts_b, dev, k, clock=clock)
        n = 16  # host dequantization rate: the cpu miss path's decode of one expert
        host = hosts_q[0]
        host.expert(0)
        t0 = clock()
        for e in range(n):
            host.expert(e % E)
        rate = n * codec.params / (clock() - t0) / 1e9
        # on a CPU "device" the slot pool dequantizes with the same code and core as the host
        hw_q = replace(hw, cpu_dequant_gelems=rate, device_dequant_gelems=rate if dev.type == "cpu" else None)

    todo = cases(policies, budget, args.partition)
    hosts = {"bf16": hosts_b, "Q4_K": hosts_q}
    for rep in range(args.repeats):
        shift = rep % len(todo)
        for case in todo[shift:] + todo[:shift]:
            run_case(case, hosts[case.precision], module, inputs, k, dev, clock)
            say(f"repeat {rep + 1}/{args.repeats}: {case.precision} {case.title} [{case.slot_format}] "
                f"steady {ms_per_token(case.runs[-1].seconds)['steady']:.1f} ms/token "
                f"({time.time() - started:.0f} s)")

    # the long run: the same layers, policy, slots and partition in the simulator (counts only)
    long, _ = load_workload(args.trace, "qwen3-30b-a3b", args.sim_tokens, L, seed=args.seed)
    long_prep = Prepared(long, "token")
    long_decode = int(sum(1 for p in long.phases if p == DECODE))
    sim_long = {}
    for case in todo:
        if case.strategy.kind == "cache":
            c = replay(long_prep, case.strategy.sim_policy, case.strategy.slots, args.partition).stats.total(DECODE)
            sim_long[id(case)] = (c.hit_rate, c.misses / long_decode)

    shape_q = SimpleNamespace(layers=L, top_k=k, expert_bytes=codec.expert_bytes, dtype="bf16")
    rows, checks = [], {"dequant_equals_gguf_py": dequant_ok}
    for precision, shape, stored in (("bf16", shape_b, shape_b.expert_bytes),
                                     ("Q4_K", shape_q, codec.expert_bytes)):
        group = [c for c in todo if c.precision == precision]
        for case in group:
            pred = predict(case, case.runs[0], codec, shape_q, shape_b, hw, staging, hw_q)
            row = summarise(case, stored, dev.type == "cpu", pred)
            hit, misses = sim_long.get(id(case), (0.0, float(L * k if case.strategy.kind == "copy-every-pass" else 0)))
            row["sim_long"] = {"tokens": long_decode, "hit_rate": hit, "h2d_bytes_per_token": misses * stored}
            rows.append(row)
        result = SimpleNamespace(shape=shape, trace=trace, partition=args.partition,
                                 runs=[c.runs[0] for c in group])
        bench_checks = run_checks(result)  # bytes + sim; its outputs check is the looser one
        checks[precision] = {"bytes": bench_checks["bytes"], "sim": bench_checks["sim"],
                             "outputs": check_outputs(group, strict=dev.type == "cpu")}
    ok = dequant_ok and all(not checks[p]["bytes"] and not checks[p]["sim"] and checks[p]["outputs"]["ok"]
                            for p in ("bf16", "Q4_K"))
    checks["ok"] = ok

    title = (f"Qwen3-30B-A3B experts ({args.hidden}/{args.expert_ff}), {L} layers x {E}, top-{k}, "
             f"{inputs.decode_tokens} decode tokens, budget {budget / MiB:.0f} MiB "
             f"({args.fraction:.0%} of bf16 experts + {k} staging), {dev}, {clock_name} clock, "
             f"median of {args.repeats}")
    print_table(rows, title)
    for p in ("bf16", "Q4_K"):
        o = checks[p]["outputs"]
        eq = ", ".join(f"{t}: " + ("bit-equal" if v["bit_equal"] else f"rel diff {v['relative']:.1e}")
                       for t, v in o["strategies"].items())
        print(f"checks {p}: H2D bytes {'ok' if not checks[p]['bytes'] else checks[p]['bytes']}; sim "
              f"{'ok' if not checks[p]['sim'] else checks[p]['sim']}; repeats identical "
              f"{o['repeats_identical']}; vs {o['reference']}: {eq}")
    print(f"checks: Q4_K/{args.down} host tier dequantizes as gguf-py: {dequant_ok}; "
          f"{'ALL OK' if ok else 'CHECKS FAILED'}")

    doc = {"benchmark": "bench_quantized", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "model": preset.name, "layers": L, "num_experts": E, "top_k": k, "hidden": args.hidden,
           "expert_ff": args.expert_ff, "decode_tokens": inputs.decode_tokens,
           "trace": args.trace, "partition": args.partition, "policies": policies,
           "quant": {"gate": "Q4_K", "up": "Q4_K", "down": args.down, "expert_bytes": codec.expert_bytes,
                     "compute_dtype": "bfloat16", "host_blocks": "tests/quant_fixtures.py random_blocks"},
           "bf16_expert_bytes": shape_b.expert_bytes, "budget_bytes": budget, "fraction": args.fraction,
           "device": str(dev), "clock": clock_name, "repeats": args.repeats,
           "machine": {**machine(dev), "torch_threads": torch.get_num_threads(),
                       "load_avg": os.getloadavg()},
           "cost_model": None if hw is None else {
               "h2d_gbps": hw.h2d_gbps, "staging_h2d_gbps": staging.h2d_gbps, "gpu_mem_gbps": hw.gpu_mem_gbps,
               "cpu_mem_gbps": hw.cpu_mem_gbps, "layer_overhead_s": hw.layer_overhead_s,
               "cpu_dequant_gelems": hw_q.cpu_dequant_gelems,
               "device_dequant_gelems": hw_q.device_dequant_gelems},
           "phases": "steady: decode tokens N/4 to N-1", "results": rows, "checks": checks,
           "seconds": time.time() - started, "cpu_seconds": time.process_time()}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str))
        say(f"wrote {args.json}")
    if args.plot:
        plot(rows, Path(args.plot), title, f"Q4_K + {args.down} down")
        say(f"wrote {args.plot}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
