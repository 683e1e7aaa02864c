"""Experts on the CPU next to llama.cpp: decode tok/s and peak RSS, one table (issue 18).

Every configuration runs in its own process (its peak RSS is the child's ``ru_maxrss``),
and the configurations are interleaved over ``--repeats`` rounds, so that load from other
processes hits all of them alike; the table shows the best round of each (llama-bench's
threads spin-wait and suffer most from a busy machine) and each round's ratio to llama.cpp in
that round, the JSON every round.

    python benchmarks/bench_cpu.py /work/refs/cpu-model/model-Q4_K_M.gguf \\
        --llama-bench /work/refs/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench \\
        --threads 2 --tokens 32 --repeats 2 --json benchmarks/results/bench_cpu.json

The model: ``benchmarks/make_cpu_model.py``. expertcache decodes greedily after an
8-token prompt and 4 warm-up tokens, timing ``--tokens`` single-token forwards.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (label, offload settings); 'slots' as a share of all experts is filled in per model
CONFIGS = [
    ("resident, ggml graph", dict(baseline="resident", cpu_kernel="ggml")),
    ("resident, ggml graph, in place", dict(baseline="resident", cpu_kernel="ggml", cpu_repack="off")),
    ("resident, ggml per layer", dict(baseline="resident", cpu_kernel="ggml", cpu_graph="off")),
    ("resident, torch", dict(baseline="resident", cpu_kernel="torch")),
    ("baseline cpu (ggml)", dict(baseline="cpu")),
    ("25% quantized slots, fetch", dict(share=0.25, slot_format="quantized", miss="fetch")),
    ("25% quantized slots, cpu", dict(share=0.25, slot_format="quantized", miss="cpu")),
    ("25% quantized slots, auto", dict(share=0.25, slot_format="quantized", miss="auto")),
    ("25% dequantized slots, fetch", dict(share=0.25, slot_format="dequantized", miss="fetch")),
    ("25% dequantized slots, cpu", dict(share=0.25, slot_format="dequantized", miss="cpu")),
    ("25% dequantized slots, auto", dict(share=0.25, slot_format="dequantized", miss="auto")),
]
LLAMA = "llama.cpp (llama-bench)"
# llama.cpp's default repacks Q4_0 / Q4_K / IQ4_NL weights into interleaved blocks for its AVX2
# kernels: a second, rearranged copy of those weights in RAM. Without it llama.cpp computes on
# the mapped file as expertcache does: the like-for-like row.
LLAMA_NOREPACK = "llama.cpp, --repack 0"
# The interpreter's own memory, which no layout of the weights can reduce: a child that imports
# what a run imports (torch, transformers with the family's modeling code, expertcache) and loads
# nothing. ``over_floor_vs_file`` is (peak RSS - this) / file: what the weights, KV cache and
# compute buffers take.
FLOOR = "interpreter floor (no model)"


def child(model: str, settings: dict, threads: int, tokens: int) -> dict:
    """In the child process: load, decode, print one JSON line."""
    import torch

    import expertcache

    torch.set_num_threads(threads)
    settings = dict(settings)
    if settings.pop("floor", False):
        return {"memory_at_end": floor_imports(model)}
    share = settings.pop("share", None)
    if share is not None:
        from expertcache.ggufmodel.header import read_header

        header = read_header(model)
        settings["slots"] = max(1, round(share * len(header.moe_blocks) * header.num_experts))
    start = time.perf_counter()
    m = expertcache.offload(model, device="cpu", **settings)
    load_s = time.perf_counter() - start
    loaded = memory()
    decode_s = decode(m, tokens)
    pool = m.expertcache.stats().pool
    graph = getattr(m, "_expertcache_graph", None)
    return {"tok_s": tokens / decode_s, "load_s": load_s, "cpu_kernel": pool["cpu_kernel"],
            "cpu_graph": pool["cpu_graph"], "graph_steps": graph.steps if graph else 0,
            "repacked_bytes": graph.repacked.bytes if graph and graph.repacked else 0,
            "kv_bytes": graph.kv_bytes() if graph else None,
            "memory_after_load": loaded, "memory_at_end": memory(),
            "dense_kernel": pool["dense_kernel"],
            "slot_format": pool["slot_format"], "slots": m.expertcache.pool.slots,
            "host_resident": pool["host_resident"]}


def floor_imports(model: str) -> dict:
    """Import what loading ``model`` imports, load nothing; this process's memory then."""
    import importlib

    from expertcache.ggufmodel.header import read_header

    import expertcache  # noqa: F401

    family = read_header(model).model_type
    importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return memory()


def memory() -> dict:
    """This process's memory (kB, /proc/self/status): the peak, and the resident set split into
    anonymous memory and pages mapped from files (the model's bytes, read through the page
    cache: counted while mapped, and dropped by the kernel when it reclaims clean file pages)."""
    out = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def decode(m, tokens: int, before=None) -> float:
    """Seconds for ``tokens`` greedy single-token forwards after an 8-token prompt and 4
    warm-up tokens; ``before()`` is called right before the timed ones."""
    import torch

    ids = torch.arange(100, 108).unsqueeze(0)                     # [1, 8] prompt
    with torch.no_grad():
        out = m(ids, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)

        def step():
            nonlocal past, tok
            out = m(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)

        for _ in range(4):
            step()
        if before is not None:
            before()
        start = time.perf_counter()
        for _ in range(tokens):
            step()
        return time.perf_counter() - start


def _run(cmd: list[str], out_path: Path) -> tuple[int, int]:
    """(exit status, peak RSS bytes) of ``cmd``, its stdout into ``out_path``."""
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss * 1024


def run_llama(llama_bench: str, model: str, threads: int, tokens: int, tmp: Path, repack: bool = True) -> dict:
    out = tmp / "llama.json"
    code, rss = _run([llama_bench, "-m", model, "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "1",
                      "--repack", "1" if repack else "0", "-o", "json"], out)
    if code:
        return {"error": f"llama-bench exited {code}"}
    return {"tok_s": json.loads(out.read_text())[0]["avg_ts"], "peak_rss": rss}


def run_config(model: str, settings: dict, threads: int, tokens: int, tmp: Path) -> dict:
    out = tmp / "child.json"
    code, rss = _run([sys.executable, __file__, "--child", json.dumps(settings), model,
                      "--threads", str(threads), "--tokens", str(tokens)], out)
    if code:
        return {"error": f"child exited {code}"}
    return {**json.loads(out.read_text().strip().splitlines()[-1]), "peak_rss": rss}


def table(rows: dict[str, list[dict]], file_bytes: int) -> list[dict]:
    """Best round per configuration; ratios to llama.cpp's tok/s and to the file's size."""
    best = {}
    for label, runs in rows.items():
        ok = [r for r in runs if "tok_s" in r]
        best[label] = max(ok, key=lambda r: r["tok_s"]) if ok else runs[-1]
    ref = best.get(LLAMA, {}).get("tok_s")
    ref_norepack = best.get(LLAMA_NOREPACK, {}).get("tok_s")
    floor = min((r["peak_rss"] for r in rows.get(FLOOR, []) if "peak_rss" in r), default=None)
    out = []
    for label, r in best.items():
        out.append({"config": label, **r, "vs_llama": r["tok_s"] / ref if ref and "tok_s" in r else None,
                    "vs_llama_rounds": _round_ratios(rows[label], rows.get(LLAMA, [])),
                    "vs_llama_norepack": r["tok_s"] / ref_norepack if ref_norepack and "tok_s" in r else None,
                    "vs_llama_norepack_rounds": _round_ratios(rows[label], rows.get(LLAMA_NOREPACK, [])),
                    "rss_vs_file": r["peak_rss"] / file_bytes if "peak_rss" in r else None,
                    "over_floor_vs_file": (r["peak_rss"] - floor) / file_bytes
                    if floor and "peak_rss" in r and "tok_s" in r else None})
    return out


def _round_ratios(runs: list[dict], llama: list[dict]) -> list[float | None]:
    """tok/s over llama.cpp's in the same round: load from other processes hits a round's
    runs alike, so these swing less than the ratio of the best rounds."""
    return [r["tok_s"] / ref["tok_s"] if "tok_s" in r and "tok_s" in ref else None for r, ref in zip(runs, llama)]


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def plot(result: list[dict], path: Path, title: str, file_bytes: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result if "tok_s" in r]
    floor = next((r["peak_rss"] for r in result if r["config"] == FLOOR and "peak_rss" in r), None)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.5), sharey=True)
    names = [r["config"] for r in rows]
    a.barh(names, [r["tok_s"] for r in rows], color="tab:blue")
    a.set_xlabel("decode tok/s")
    b.barh(names, [r["peak_rss"] / 2 ** 30 for r in rows], color="tab:orange")
    b.set_xlabel("peak RSS (GiB)")
    b.axvline(file_bytes / 2 ** 30, color="k", lw=1, label="the file")
    if floor:
        b.axvline((file_bytes + floor) / 2 ** 30, color="k", ls="--", lw=1, label="file + interpreter floor")
    b.legend(loc="lower right")
    a.invert_yaxis()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a GGUF MoE file (benchmarks/make_cpu_model.py)")
    p.add_argument("--llama-bench", help="path to llama.cpp's llama-bench (skipped, with a note, when absent)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32, help="decode tokens timed per run")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds; the best is shown")
    p.add_argument("--only", help="comma-separated labels (substrings) of the configurations to run")
    p.add_argument("--json", help="write every round and the table here")
    p.add_argument("--plot", help="PNG of the table (default: next to --json)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.model, json.loads(args.child), args.threads, args.tokens)))
        return 0
    configs = [(label, s) for label, s in CONFIGS
               if not args.only or any(k.strip() in label for k in args.only.split(","))]
    llama = args.llama_bench if args.llama_bench and Path(args.llama_bench).exists() else None
    if llama is None:
        print(f"note: llama.cpp skipped ({'--llama-bench not given' if not args.llama_bench else args.llama_bench + ' not found'})")
    rows: dict[str, list[dict]] = ({LLAMA: [], LLAMA_NOREPACK: []} if llama else {}) | \
        {label: [] for label, _ in configs} | {FLOOR: []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.repeats):
            if llama:
                rows[LLAMA].append(run_llama(llama, args.model, args.threads, args.tokens, Path(tmp)))
                rows[LLAMA][-1]["load_1min"] = os.getloadavg()[0]  # the shared VM's load, with each figure
                rows[LLAMA_NOREPACK].append(run_llama(llama, args.model, args.threads, args.tokens, Path(tmp),
                                                      repack=False))
                rows[LLAMA_NOREPACK][-1]["load_1min"] = os.getloadavg()[0]
            for label, settings in configs:
                rows[label].append(run_config(args.model, settings, args.threads, args.tokens, Path(tmp)))
                rows[label][-1]["load_1min"] = os.getloadavg()[0]
                print(f"round {round_ + 1} {label}: {rows[label][-1]}", flush=True)
            rows[FLOOR].append(run_config(args.model, {"floor": True}, args.threads, args.tokens, Path(tmp)))
    file_bytes = Path(args.model).stat().st_size
    result = table(rows, file_bytes)
    print(f"\n{Path(args.model).name} ({file_bytes / 2 ** 20:.0f} MiB), {args.threads} threads, "
          f"{args.tokens} decode tokens, best of {args.repeats} interleaved rounds")
    print(f"{'configuration':34} {'tok/s':>8} {'x llama':>8} {'per round':>16} {'x no-repack':>12} "
          f"{'per round':>16} {'peak RSS':>10} {'x file':>7} {'-floor':>7} {'load':>5}")
    for r in result:
        if r["config"] == FLOOR and "peak_rss" in r:
            print(f"{FLOOR:34} {'':>61} {r['peak_rss'] / 2 ** 30:9.2f}G {r['rss_vs_file']:7.2f}")
            continue
        if "tok_s" not in r:
            print(f"{r['config']:34} {r.get('error')}")
            continue
        vs = f"{r['vs_llama']:.3f}" if r["vs_llama"] is not None else "-"
        per = "/".join(f"{x:.2f}" for x in r["vs_llama_rounds"] if x is not None) or "-"
        vs_nr = f"{r['vs_llama_norepack']:.3f}" if r["vs_llama_norepack"] is not None else "-"
        per_nr = "/".join(f"{x:.2f}" for x in r["vs_llama_norepack_rounds"] if x is not None) or "-"
        print(f"{r['config']:34} {r['tok_s']:8.1f} {vs:>8} {per:>16} {vs_nr:>12} {per_nr:>16} "
              f"{r['peak_rss'] / 2 ** 30:9.2f}G {r['rss_vs_file']:7.2f} {_ratio(r['over_floor_vs_file']):>7} "
              f"{r.get('load_1min', 0):5.1f}")
    if args.json:
        doc = {"model": str(args.model), "file_bytes": file_bytes, "threads": args.threads, "tokens": args.tokens,
               "repeats": args.repeats, "table": result, "rounds": rows}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        png = Path(args.plot or Path(args.json).with_suffix(".png"))
        plot(result, png, f"{Path(args.model).name}: CPU decode, {args.threads} threads", file_bytes)
        print(f"wrote {args.json} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
