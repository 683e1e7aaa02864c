"""vLLM's CPU build with and without the expertcache plug-in, and expertcache's own runtime.

The model is bench_serve's small random Qwen3-MoE (hidden 256, 4 MoE layers, 32 experts,
top-4, float32) with a word-level tokenizer, saved to a temporary folder. Rows:

* ``vllm``: vLLM's CPU build, no plug-in;
* ``vllm+expertcache N%``: the plug-in with N% of all L x E experts in slots (100%: all
  resident, the plug-in's overhead alone), default policy, host planner (each layer step
  planned on the host); ``... device``: the same with ``planner: device`` (the layer step
  on the device, the policy one engine step behind), side by side;
* ``expertcache generate`` / ``expertcache serve``: the transformers runtime at 50% slots.

vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, eager: compiling each
configuration costs a minute or more on a loaded 2-core machine) with 1 and 4 concurrent
requests (one ``generate`` call with 1 or 4 prompts, 16 prompt tokens, ``--tokens`` new
tokens each, end token ignored); tok/s = generated tokens / wall time. The machine is shared
and its load swings tok/s several-fold within minutes, so plain vLLM stays alive in the same
process and each plug-in engine runs beside it round by round (order alternating): the ratio
to vLLM is the median of the per-round ratios. Hit rates are the plug-in's counters over the
timed runs.

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--tokens 64] [--repeats 6] [--planners host,device]
        [--skip-runtime] [--compiled]

Writes benchmarks/results/vllm_cpu.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))

RESULTS = Path(__file__).resolve().parent / "results" / "vllm_cpu.json"
LAYERS, EXPERTS = 4, 32
FRACTIONS = (1.0, 0.5, 0.25)
LEVELS = (1, 4)


def prompts(n: int) -> list[list[int]]:
    return [[(c * 31 + j * 7) % 500 + 3 for j in range(16)] for c in range(n)]


PIECEWISE = {"cudagraph_mode": "PIECEWISE",  # CUDA graphs with the MoE op outside them (docs/vllm.md)
             "splitting_ops": ["vllm::unified_attention", "vllm::unified_attention_with_output",
                               "vllm::moe_forward", "vllm::moe_forward_shared"]}


def engine(path: str, fraction: float | None, device: str, piecewise: bool = False,
           policy: str | None = None, planner: str = "host", compiled: bool = False):
    """One in-process vLLM engine; ``fraction`` of the experts in slots, None: no plug-in;
    ``policy`` the plug-in's eviction policy (its default when None), ``planner`` host or device."""
    from vllm import LLM

    extra = {} if fraction is None else {"expertcache": {"slots": round(fraction * LAYERS * EXPERTS),
                                                         "planner": planner}}
    if policy is not None and fraction is not None:
        extra["expertcache"]["eviction"] = policy
    kwargs = dict(gpu_memory_utilization=0.3) if device == "cuda" else \
        dict(gpu_memory_utilization=0.2, kv_cache_memory_bytes=1 << 28, distributed_executor_backend="uni")
    if piecewise:
        kwargs["compilation_config"] = PIECEWISE
    return LLM(model=path, dtype="float32", enforce_eager=not (piecewise or compiled), max_model_len=512, max_num_seqs=4,
               seed=0, additional_config=extra, **kwargs)


def timed(llm, batch: list, params) -> tuple[float, list]:
    """Generated tokens per second of one ``generate`` call, and the tokens."""
    t = time.perf_counter()
    res = llm.generate(batch, params, use_tqdm=False)
    rate = sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - t)
    return rate, [list(r.outputs[0].token_ids) for r in res]


def paired(ref, llm, tokens: int, repeats: int) -> dict:
    """``llm`` (the plug-in's engine) against ``ref`` (plain vLLM, alive in the same process):
    per level, ``repeats`` rounds of one call each, the order alternating; ``over_vllm`` is the
    median of the per-round ratios, so load that drifts between rounds cancels."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from expertcache.vllm import session as sessions

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, detokenize=False)
    out = {}
    for n in LEVELS:
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(n)]
        _, want = timed(ref, batch, params)  # warm-up, and vLLM's own tokens
        equal = timed(llm, batch, params)[1] == want
        session = sessions._current
        before, host0, steps0 = session.stats(), session.host_s, session.steps
        ours, theirs = [], []
        for i in range(repeats):
            for which in ((llm, ref) if i % 2 else (ref, llm)):
                rate, seqs = timed(which, batch, params)
                (ours if which is llm else theirs).append(rate)
                equal &= seqs == want
        st = session.stats().since(before)
        out[n] = {"tok_s_median": statistics.median(ours), "tok_s_runs": ours, "vllm_tok_s_runs": theirs,
                  "over_vllm": statistics.median(a / b for a, b in zip(ours, theirs)),
                  "tokens_equal_vllm": equal,
                  "hit_rate": st.total().hit_rate, "hit_rate_decode": st.total("decode").hit_rate,
                  "h2d_bytes": st.h2d_bytes(), "slots": session.pool.slots,
                  "host_us_per_layer_step": 1e6 * (session.host_s - host0)
                  / max((session.steps - steps0) * LAYERS, 1)}
    return out


def run_generate(path: str, tokens: int, out_dir: str) -> dict:
    """``expertcache generate`` at 50% slots (the transformers runtime), its own JSON summary."""
    out = Path(out_dir) / "generate.json"
    prompt = " ".join(f"w{(j * 7) % 500 + 3}" for j in range(16))
    done = subprocess.run([sys.executable, "-c", "import sys; from expertcache.cli import main; sys.exit(main())",
                           "generate", path, "--prompt", prompt, "--max-new-tokens", str(tokens),
                           "--slots", str(LAYERS * EXPERTS // 2), "--device", "cpu", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(out.read_text())


def run_serve(path: str, tokens: int) -> dict:
    """``expertcache serve``'s server at 50% slots, 1 and 4 concurrent streamed clients."""
    from bench_serve import OurServer, level

    server = OurServer(Path(path), cached=True)
    url = server.start()
    try:
        return {n: level(url, Path(path).name, n, 2, tokens, 16, True) for n in LEVELS}
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=6, help="rounds per configuration and level")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: the vLLM rows only, on a CUDA build of vLLM (benchmarks/gpu_check.sh)")
    ap.add_argument("--planners", default="host,device", help="comma-separated: host, device")
    ap.add_argument("--compiled", action="store_true",
                    help="every vLLM engine compiled (vLLM's default; slower to start) instead of eager")
    ap.add_argument("--json", default=str(RESULTS))
    ap.add_argument("--fractions", nargs="+", type=float, default=list(FRACTIONS),
                    help="shares of the experts in slots, one plug-in row each")
    ap.add_argument("--policies", nargs="+", default=["default"],
                    help="eviction policies, side by side at every fraction (e.g. default next-use: "
                         "the batch-aware default against the old one)")
    ap.add_argument("--skip-runtime", action="store_true",
                    help="only the vLLM rows (no expertcache generate / serve)")
    args = ap.parse_args()
    import torch
    from bench_serve import save_model

    torch.set_num_threads(os.cpu_count() or 1)
    from vllm.distributed import cleanup_dist_env_and_memory

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny-qwen3-moe"
        save_model(path)
        # plain vLLM stays alive; each plug-in configuration runs beside it, round by round
        # (one plug-in session per process at a time, so configurations follow each other)
        ref = engine(str(path), None, args.device, compiled=args.compiled)
        rows = {}
        planners = args.planners.split(",")
        named = len(args.policies) > 1 or args.policies != ["default"]
        configs = [(f"vllm+expertcache {f:.0%}" + (f" {p}" if named else "") + ("" if pl == "host" else f" {pl}"),
                    f, False, p, pl)
                   for f in args.fractions for p in args.policies for pl in planners]
        if args.device == "cuda" and "host" in planners:  # the graph mode that keeps the plan per step
            configs.append(("vllm+expertcache 50% piecewise", 0.5, True, "default", "host"))
        for name, fraction, piecewise, policy, planner in configs:
            llm = engine(str(path), fraction, args.device, piecewise, policy, planner, args.compiled)
            rows[name] = {"levels": paired(ref, llm, args.tokens, args.repeats)}
            del llm
            gc.collect()
            print(name, {n: f"{r['over_vllm']:.2f}x" for n, r in rows[name]["levels"].items()}, flush=True)
        rows = {"vllm": {"levels": {n: vllm_row(rows, n) for n in LEVELS}}, **rows}
        del ref
        gc.collect()
        cleanup_dist_env_and_memory()
        if args.device == "cpu" and not args.skip_runtime:
            rows["expertcache generate 50%"] = run_generate(str(path), args.tokens, tmp)
            rows["expertcache serve 50%"] = run_serve(str(path), args.tokens)
    doc = {"machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                       "note": "shared 2-core VM, loaded by other agents' jobs at times: each ratio "
                               "to vLLM is paired round by round, the tok/s medians are not"},
           "command": "benchmarks/bench_vllm.py " + " ".join(sys.argv[1:]),
           "settings": {"tokens": args.tokens, "repeats": args.repeats, "prompt_tokens": 16, "levels": LEVELS,
                        "model": "Qwen3-MoE hidden 256, 4 MoE layers, 32 experts, top-4, float32 (random)",
                        "planners": args.planners,
                        "vllm_mode": f"in-process engines, {'compiled' if args.compiled else 'eager'}; each plug-in "
                                     "engine paired round by round with one plain engine"},
           "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1))
    print_table(rows)


def vllm_row(rows: dict, n: int) -> dict:
    """Plain vLLM's runs at level ``n``, pooled over all pairings."""
    runs = [r for row in rows.values() for r in row["levels"][n]["vllm_tok_s_runs"]]
    return {"tok_s_median": statistics.median(runs), "tok_s_runs": runs, "over_vllm": 1.0}


def print_table(rows: dict) -> None:
    print(f"{'row':34} {'tok/s @1':>9} {'@4':>9} {'x vllm @1':>10} {'@4':>6} {'hit rate @1':>12} {'@4':>6}")
    for name, row in rows.items():
        if "levels" in row:
            lv = row["levels"]
            hit = [lv[n].get("hit_rate") for n in LEVELS]
            print(f"{name:34} {lv[1]['tok_s_median']:9.1f} {lv[4]['tok_s_median']:9.1f} "
                  f"{lv[1]['over_vllm']:10.2f} {lv[4]['over_vllm']:6.2f} "
                  + " ".join("" if h is None else f"{h:.3f}".rjust(w) for h, w in zip(hit, (12, 6))))
        elif name.startswith("expertcache serve"):
            print(f"{name:34} {row[1]['tokens_per_s']:9.1f} {row[4]['tokens_per_s']:9.1f}")
        else:
            print(f"{name:34} {json.dumps(row)[:90]}")


if __name__ == "__main__":
    main()
