"""Where a CPU decode token's time goes, module by module (docs/cpu.md, issue 18).

Forward hooks time every child of each decoder layer (attention, its projections and
norms, the MoE block, its router and experts, the layer norms), the embedding, the final
norm and the lm_head, summed over layers and divided by the tokens; "the rest" is the
token's wall time outside them (mask, rotary tables, residual adds, module-call overhead).
The hooks' own cost (two perf_counter calls a module) is in the figures: compare rows, and
compare the wall time with bench_cpu.py's tok/s for the same settings.

    python benchmarks/profile_cpu_decode.py /work/refs/cpu-model/model-Q4_K_M.gguf \\
        --threads 2 --tokens 32 --json benchmarks/results/profile_cpu_decode.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

from bench_cpu import decode


def timed(model) -> dict[str, float]:
    """Hooks that add each module's forward seconds to the returned dict, by role."""
    seconds: dict[str, float] = defaultdict(float)
    started: dict[str, float] = {}

    def watch(module, role: str) -> None:
        module.register_forward_pre_hook(lambda *_: started.__setitem__(role, time.perf_counter()))
        module.register_forward_hook(
            lambda *_: seconds.__setitem__(role, seconds[role] + time.perf_counter() - started[role]))

    inner = model.model
    for layer in inner.layers:
        for name, child in layer.named_children():
            watch(child, name)
            for sub, grandchild in child.named_children():
                watch(grandchild, f"{name}.{sub}")
    for role in ("embed_tokens", "norm"):
        watch(getattr(inner, role), role)
    watch(model.lm_head, "lm_head")
    return seconds


def breakdown(ms: dict[str, float], token_ms: float) -> list[tuple[str, float]]:
    """Rows, slowest first: each layer child, then its own children indented and what it
    spends outside them ("its own ops"); last, the token's time outside every module."""
    rows = []
    for role in sorted((r for r in ms if "." not in r), key=lambda r: -ms[r]):
        rows.append((role, ms[role]))
        kids = sorted((r for r in ms if r.startswith(role + ".")), key=lambda r: -ms[r])
        rows += [("  " + kid, ms[kid]) for kid in kids]
        if kids:
            rows.append(("  (its own ops)", ms[role] - sum(ms[k] for k in kids)))
    return rows + [("the rest", token_ms - sum(ms[r] for r in ms if "." not in r))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a GGUF MoE file (benchmarks/make_cpu_model.py)")
    p.add_argument("--baseline", default="resident", help="offload's baseline (default resident)")
    p.add_argument("--cpu-kernel", default="auto", choices=["auto", "ggml", "torch"])
    p.add_argument("--cpu-graph", default="off", choices=["auto", "off"],
                   help="off (default): the per-layer path, whose modules the hooks time; auto: one ggml "
                        "graph a token (no module runs in decode: only the wall time means anything)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--json", help="write the table here")
    args = p.parse_args()

    import torch

    import expertcache

    torch.set_num_threads(args.threads)
    model = expertcache.offload(args.model, device="cpu", baseline=args.baseline, cpu_kernel=args.cpu_kernel,
                                cpu_graph=args.cpu_graph)
    seconds = timed(model)
    wall = decode(model, args.tokens, before=seconds.clear)
    rows = breakdown({role: s / args.tokens * 1e3 for role, s in seconds.items()}, wall / args.tokens * 1e3)
    print(f"{Path(args.model).name}, baseline {args.baseline}, cpu_kernel "
          f"{model.expertcache.cpu_kernel}, {args.threads} threads: {wall / args.tokens * 1e3:.2f} ms a token "
          f"({args.tokens / wall:.1f} tok/s)")
    print(f"{'module (summed over layers)':34} {'ms/token':>9} {'share':>6}")
    for role, ms in rows:
        print(f"{role:34} {ms:9.2f} {ms / (wall / args.tokens * 1e3):6.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": str(args.model), "baseline": args.baseline, "cpu_kernel": model.expertcache.cpu_kernel,
            "threads": args.threads, "tokens": args.tokens, "ms_per_token": wall / args.tokens * 1e3,
            "modules_ms_per_token": [[role.strip(), ms] for role, ms in rows]}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
