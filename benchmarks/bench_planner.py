"""Decode time per token, planner 'device' against 'host', side by side (CPU by default).

The model of ``bench_overhead.py`` (random Qwen3-MoE: hidden 512, 8 MoE layers, 64 experts,
top-8, expert FF 256, float32) is offloaded twice per cache size, once per planner, and
both decode greedily in alternation (B sequences at a time), so machine noise hits both
alike. Sizes: share of all 8 x 64 experts held in slots. Tokens must be equal between the
two planners (float32: exact), else the figures are void. Reported: median decode ms per
token over the repeats (the forward clock, as ``generate`` reports), decode hit rate and H2D
bytes per token from each cache's stats.

    .venv/bin/python benchmarks/bench_planner.py [--fractions 1,0.5,0.25] [--batch 1]
        [--tokens 32] [--repeats 3] [--threads 1] [--lag 1] [--staging-blocks 1] [--device cpu]

Writes benchmarks/results/bench_planner[_bB][_blocksN].json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overhead import build  # noqa: E402

from expertcache import offload  # noqa: E402
from expertcache.runtime.clock import ForwardClock  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def decode(model, ids, mask, tokens: int):
    clock = ForwardClock.of(model)
    clock.start()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    steps = [b - a for a, b in zip(clock.times[1:], clock.times[2:])]  # decode forwards only
    return statistics.median(steps), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fractions", default="1,0.5,0.25", help="shares of all experts in slots")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lag", type=int, default=1)
    ap.add_argument("--staging-blocks", type=int, default=1,
                    help="planner device: staging blocks (8 = one per MoE layer); staging = blocks x batch x top-k")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    plain = build(256, dtype=getattr(torch, args.dtype))
    L, E, K = 8, 64, 8
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 2048, (args.batch, args.prompt), generator=gen).to(args.device)
    mask = torch.ones_like(ids)
    rows = []
    for fraction in (float(f) for f in args.fractions.split(",")):
        slots = max(K, round(fraction * L * E))
        width = min(E, args.batch * K)
        models = {p: offload(copy.deepcopy(plain), slots=slots, eviction=args.policy, planner=p, lag=args.lag if p == "device" else 1,
                             staging=width * (args.staging_blocks if p == "device" else 1),
                             staging_blocks=args.staging_blocks if p == "device" else 1, device=args.device)
                  for p in ("host", "device")}
        for m in models.values():
            decode(m, ids, mask, 4)  # warm
        times = {p: [] for p in models}
        outs = {}
        for _ in range(args.repeats):
            for p, m in models.items():
                m.expertcache.reset_stats()
                t, outs[p] = decode(m, ids, mask, args.tokens)
                times[p].append(t)
        if not torch.equal(outs["host"], outs["device"]) and args.dtype == "float32":
            raise SystemExit(f"tokens differ between planners at {fraction}: figures void")
        for p, m in models.items():
            s = m.expertcache.stats()
            steps = args.tokens - 1
            rows.append({"fraction": fraction, "slots": slots, "planner": p,
                         "ms_per_token": statistics.median(times[p]) * 1e3,
                         "ms_runs": [t * 1e3 for t in times[p]],
                         "decode_hit_rate": s.total("decode").hit_rate,
                         "h2d_bytes_per_decode_token": s.h2d_bytes("decode") / steps,
                         "device_forwards": getattr(m.expertcache.planner, "device_forwards", 0)})
        h, d = rows[-2], rows[-1]
        print(f"{fraction:>5.0%} slots={slots:<4} host {h['ms_per_token']:7.2f} ms/tok (hit {h['decode_hit_rate']:.3f})"
              f"   device {d['ms_per_token']:7.2f} ms/tok (hit {d['decode_hit_rate']:.3f})"
              f"   device/host {d['ms_per_token'] / h['ms_per_token']:.3f}", flush=True)
    result = {"benchmark": "bench_planner", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                          "transformers": tf.__version__, "threads": args.threads,
                          "load_avg": os.getloadavg(), "device": args.device},
              "model": {"family": "qwen3_moe", "hidden": 512, "moe_layers": L, "experts": E, "top_k": K,
                        "expert_ff": 256, "dtype": args.dtype},
              "settings": vars(args), "rows": rows}
    name = f"bench_planner{'' if args.batch == 1 else f'_b{args.batch}'}"
    name += "" if args.staging_blocks == 1 else f"_blocks{args.staging_blocks}"
    out = Path(args.json or RESULTS / f"{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
