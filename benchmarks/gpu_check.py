"""The GPU check's steps; ``benchmarks/gpu_check.sh`` runs each under its own timeout.

    python3 benchmarks/gpu_check.py bandwidth --work W [--rehearse]  # device read and pinned H2D GB/s
    python3 benchmarks/gpu_check.py real      --work W [--rehearse]  # 12 layers: exactness, decode, bounds
    python3 benchmarks/gpu_check.py full      --work W [--rehearse]  # 48 layers: Qwen3-30B-A3B's real size
    python3 benchmarks/gpu_check.py dequant   --work W [--rehearse]  # Q4_K slots: dequantize-per-use cost
    python3 benchmarks/gpu_check.py diag      --work W [--rehearse]  # GPT-OSS MXFP4: CUDA vs CPU logits
    python3 benchmarks/gpu_check.py summary   --work W --out R       # one table, one JSON, one PNG

``real`` and ``full`` build a Qwen3-30B-A3B-shaped model on the device (bf16; hidden 2048, expert
FF 768, 128 experts, top-8; 12 or 48 layers; ``--rehearse``: the same code at toy sizes on the
CPU) whose routers follow a real routing trace (``benchmarks/gpu_decode.py``), and run plain
transformers (all on the device) and each expertcache configuration, in one process, one row
after another, most valuable first. Every row carries its bound: the tok/s that the bandwidths
measured by ``bandwidth`` allow for the bytes the row moves a token. A row is printed and
``W/<step>.json`` rewritten as soon as it is measured, so a step cut by its timeout keeps what
it had; a row that fails is recorded with its error and the next one runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_decode import (EXPERTS, Bench, ForcedRouting, build, compile_policies, dense_bytes,  # noqa: E402
                        format_row, measure, peer, reference, routing, say)

REAL = dict(layers=12, hidden=2048, ff=768, heads=32, kv=4, head_dim=128, vocab=4096,
            prompt=32, warm=8, timed=32, counted=4, dtype="bfloat16", device="cuda")
FULL = dict(REAL, layers=48, prompt=16, warm=3, timed=8, counted=2)
TOY = dict(layers=2, hidden=64, ff=32, heads=4, kv=2, head_dim=16, vocab=256,
           prompt=6, warm=2, timed=4, counted=1, dtype="float32", device="cpu")
TOY_FULL = dict(TOY, layers=3)
# (label, settings): most valuable first, the step's timeout may cut the tail; "batch": sequences
REAL_ROWS = [
    ("resident", dict(baseline="resident")),
    ("25% fetch", dict(fraction=0.25, miss="fetch")),
    ("25% fetch, device planner", dict(fraction=0.25, miss="fetch", planner="device")),
    ("50% fetch", dict(fraction=0.5, miss="fetch")),
    ("50% fetch, device planner", dict(fraction=0.5, miss="fetch", planner="device")),
    ("copy-every-pass", dict(baseline="copy-every-pass")),
    ("100% fetch, device planner", dict(fraction=1.0, miss="fetch", planner="device")),
    ("resident, B=16", dict(baseline="resident", batch=16)),
    ("25% fetch, B=16", dict(fraction=0.25, miss="fetch", batch=16)),
    ("25% fetch, device planner, B=16", dict(fraction=0.25, miss="fetch", planner="device", batch=16)),
    ("cpu (--cpu-moe)", dict(baseline="cpu")),
]
FULL_ROWS = [
    ("resident", dict(baseline="resident")),
    ("50% fetch", dict(fraction=0.5, miss="fetch")),
    ("50% fetch, device planner", dict(fraction=0.5, miss="fetch", planner="device")),
    ("copy-every-pass", dict(baseline="copy-every-pass")),
]


# -- bandwidth ------------------------------------------------------------------------------
def bandwidth(args) -> int:
    """Device memory bandwidth (a device-to-device copy: bytes read + written over time, as
    vendors quote it; a decode step's weight reads run at about this rate) and pinned
    host-to-device bandwidth, each the best of a few plain torch copies."""
    out = measure_bandwidth(torch.device("cpu" if args.rehearse else "cuda"))
    say(f"bandwidth on {out['device']}: device copy {out['device_gbs']:.0f} GB/s (read + write), "
        f"pinned H2D {out['h2d_gbs']:.1f} GB/s")
    save(Path(args.work) / "bandwidth.json", out)
    return 0


def measure_bandwidth(dev: torch.device) -> dict:
    """{"device", "device_gbs", "h2d_gbs"}: plain torch copies, small ones on the CPU."""
    n_dev, n_h2d = (4 << 30, 1 << 30) if dev.type == "cuda" else (64 << 20, 32 << 20)
    src = torch.empty(n_dev, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    host = torch.empty(n_h2d, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    landing = torch.empty(n_h2d, dtype=torch.uint8, device=dev)
    return {"device": str(dev), "device_gbs": 2 * n_dev / best(lambda: dst.copy_(src), dev) / 1e9,
            "h2d_gbs": n_h2d / best(lambda: landing.copy_(host, non_blocking=True), dev) / 1e9}


def best(fn, dev: torch.device, repeats: int = 5) -> float:
    """Best wall time of ``fn`` over ``repeats`` runs (synchronized on CUDA), after one warm-up."""
    cuda = dev.type == "cuda"
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return min(times)


# -- decode steps ---------------------------------------------------------------------------
def prepare(args, size: dict, batches: tuple[int, ...]) -> Bench | None:
    """The model on the device, its plain-transformers references for ``batches``, then its
    experts moved to (pinned) host memory once: every configuration takes those same tensors."""
    from expertcache.loaders.common import find_experts
    from expertcache.runtime.host import HostExperts

    if size["device"] == "cuda" and not torch.cuda.is_available():
        say("no CUDA device visible to torch; use --rehearse on a CPU")
        return None
    dev = torch.device(size["device"])
    stride = size["prompt"] + size["warm"] + size["timed"] + size["counted"] + 1
    ids, source = routing(size["layers"], stride * max(batches))
    say(f"{size['layers']} layers, hidden {size['hidden']}, expert FF {size['ff']}, {EXPERTS} experts, top-8, "
        f"{size['dtype']} on {dev}; routing: {source}")
    t = time.perf_counter()
    base = build(size)
    names = [name for name, _ in find_experts(base)]
    mode = "pinned" if dev.type == "cuda" else "copy"
    hosts = [HostExperts.take(base.get_submodule(name), mode) for name in names]
    expert_bytes = sum(t[0].numel() * t.element_size() for t in hosts[0].tensors.values())
    say(f"built, experts to host memory ({mode}, {len(hosts) * EXPERTS * expert_bytes / 1e9:.1f} GB) "
        f"in {time.perf_counter() - t:.1f} s")
    bw = read(Path(args.work) / "bandwidth.json") or {}
    bench = Bench(base, hosts, names, ForcedRouting(ids, dev, stride), size, bw, expert_bytes, dense_bytes(base))
    return bench


def decode_step(args, name: str, size: dict, rows_spec: list, batches: tuple[int, ...], with_peer: bool) -> int:
    compile_policies()
    bench = prepare(args, size, batches)
    if bench is None:
        return 2
    path = Path(args.work) / f"{name}.json"
    result = {"size": size, "routing": "", "device": device_name(torch.device(size["device"])),
              "bandwidth": bench.bandwidth, "expert_bytes": bench.expert_bytes, "dense_bytes": bench.dense,
              "rows": []}
    rows = result["rows"]
    reference(bench, 1, rows)
    save(path, result)
    for label, settings in rows_spec:
        batch = settings.get("batch", 1)
        if batch not in bench.refs:
            reference(bench, batch, rows)
        measure(bench, label, settings, rows)
        save(path, result)
        if with_peer and label == "25% fetch":   # the peer at the GPU memory of the 25% row
            budget = next((r["pool_mb"] * 1e6 for r in rows if r["name"] == label and "pool_mb" in r), None)
            if budget:
                peer(bench, int(budget + bench.dense), rows)
                save(path, result)
    return 0


def real(args) -> int:
    return decode_step(args, "real", TOY if args.rehearse else REAL, REAL_ROWS, (1, 16), True)


def full(args) -> int:
    return decode_step(args, "full", TOY_FULL if args.rehearse else FULL, FULL_ROWS, (1,), False)


# -- dequant --------------------------------------------------------------------------------
def dequant(args) -> int:
    """Quantized (Q4_K/Q6_K) slots dequantize the experts a step reads, on every use. How long
    that takes next to the step's own matmuls, at Qwen3-30B-A3B's expert shape."""
    sys.path.insert(0, str(ROOT / "tests"))
    from bench_quantized import q4k_codec, q4k_hosts

    from expertcache.runtime.compute import grouped_over_slots
    from tiny_moe import tiny_model

    dev = torch.device("cpu" if args.rehearse else "cuda")
    hidden, ff, n = (256, 256, 8) if args.rehearse else (2048, 768, 8)
    dtype = torch.float32 if args.rehearse else torch.bfloat16
    codec = dataclasses.replace(q4k_codec(hidden, ff), dtype=dtype)
    host = q4k_hosts(codec, 1, n, seed=0, pin=False)[0]
    stored = {k: t[:n].to(dev) for k, t in host.tensors.items()}               # [n, bytes] per part
    module = tiny_model("qwen3_moe").model.layers[0].mlp.experts
    dq_s = best(lambda: host.codec.decode(stored), dev, 10)
    weights = {k: v.to(dev) for k, v in host.codec.decode(stored).items()}     # [n, ...] compute dtype
    x = torch.randn(1, hidden, device=dev, dtype=weights["down_proj"].dtype)
    slot_idx = torch.arange(8, device=dev).view(1, 8) % n
    w = torch.full((1, 8), 1 / 8, device=dev)
    mm_s = best(lambda: grouped_over_slots(module, x, slot_idx, w, weights, [(s, 1) for s in range(n)],
                                           False, False), dev, 10)
    out = {"experts": n, "hidden": hidden, "ff": ff, "device": device_name(dev),
           "dequant_ms": 1e3 * dq_s, "matmul_ms_one_token": 1e3 * mm_s, "dequant_over_matmul": dq_s / mm_s,
           "stored_mb": sum(t.numel() for t in stored.values()) / 1e6,
           "compute_mb": sum(t.numel() * t.element_size() for t in weights.values()) / 1e6}
    say(f"dequant: {n} Q4_K experts ({out['stored_mb']:.1f} MB stored -> {out['compute_mb']:.1f} MB) in "
        f"{out['dequant_ms']:.3f} ms; one token's matmuls over them {out['matmul_ms_one_token']:.3f} ms "
        f"({out['dequant_over_matmul']:.1f}x)")
    save(Path(args.work) / "dequant.json", out)
    return 0


# -- diag ---------------------------------------------------------------------------------------
def diag(args) -> int:
    """Where GPT-OSS MXFP4 logits on CUDA part from the CPU reference (the first lease saw more
    than 1e-3 in both slot formats): transformers' own dequantized model on the CPU and on the
    device, and ours on the device in both slot formats, all float32; max |diff| of every pair
    and max |logit|. If the reference on the device differs from the one on the CPU as much as
    ours does, the CPU reference is what is off; if ours differs from the device reference, ours is."""
    import copy
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    import expertcache
    from test_hf_quant import PROMPT, transformers_reference, write_gpt_oss_mxfp4

    dev = "cpu" if args.rehearse else "cuda"
    tf32 = {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}
    with tempfile.TemporaryDirectory() as d:
        path = write_gpt_oss_mxfp4(Path(d))
        ref = transformers_reference(path)
        logits, parts = {}, {}
        with torch.no_grad():
            logits["reference on cpu"] = ref(PROMPT).logits
            ref_dev = copy.deepcopy(ref).to(dev)
            with Outputs(ref_dev) as seen:
                logits[f"reference on {dev}"] = ref_dev(PROMPT.to(dev)).logits.cpu()
            parts["reference"] = seen.outputs
            for fmt in ("quantized", "dequantized"):
                model = expertcache.offload(path, slots=6, device=dev, dtype="float32", slot_format=fmt,
                                            cpu_kernel="torch")
                with Outputs(model) as seen:
                    logits[f"ours on {dev}, {fmt}"] = model(PROMPT.to(dev)).logits.cpu()
                parts[fmt] = seen.outputs
                parts[fmt + " attention"] = model.config._attn_implementation
        parts["reference attention"] = ref_dev.config._attn_implementation
    names = list(logits)
    out = {"max_abs_logit": logits[names[0]].abs().max().item(), "tf32": tf32,
           "diffs": {f"{a} vs {b}": (logits[a] - logits[b]).abs().max().item()
                     for i, a in enumerate(names) for b in names[i + 1:]},
           "attention": {k: v for k, v in parts.items() if k.endswith("attention")},
           # where ours on the device first parts from the reference on the device: each module's output
           "modules": {name: (parts["quantized"][name] - ref_out).abs().max().item()
                       for name, ref_out in parts["reference"].items() if name in parts["quantized"]}}
    say(f"diag: GPT-OSS MXFP4, float32, max |logit| {out['max_abs_logit']:.3f}, tf32 {tf32}, "
        f"attention {out['attention']}")
    for pair, d in out["diffs"].items():
        say(f"  {pair:58} {d:.2e}")
    for name, d in out["modules"].items():
        say(f"  ours ({dev}, quantized) vs reference ({dev}): {name:40} {d:.2e}")
    save(Path(args.work) / "diag.json", out)
    return 0


class Outputs:
    """Forward hooks recording each decoder layer's attention, router and MLP output (on the host)."""

    def __init__(self, model) -> None:
        self.model, self.outputs, self.handles = model, {}, []

    def __enter__(self):
        for i, layer in enumerate(self.model.model.layers):
            for part in ("self_attn", "mlp", "mlp.router"):
                module = layer.get_submodule(part)
                self.handles.append(module.register_forward_hook(self._record(f"layer {i} {part}")))
        return self

    def _record(self, name: str):
        def hook(module, args, output):
            first = output[0] if isinstance(output, tuple) else output
            self.outputs[name] = first.detach().float().cpu()
        return hook

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (rehearsal)"


def save(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2))


def read(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


# -- the summary ----------------------------------------------------------------------------
DECODE_STEPS = ("real", "full")


def summary(args) -> int:
    work, out = Path(args.work), Path(args.out)
    doc = {"steps": read_steps(work / "steps.txt"), "environment": read(work / "env.json"),
           "bandwidth": read(work / "bandwidth.json"), "tests": read_tests(work)}
    for name in DECODE_STEPS + ("dequant", "diag", "bench_quantized"):
        doc[name] = read(work / f"{name}.json")
    for name in sorted(p.stem for p in work.glob("extra_*.json")):   # steps added by other benchmarks
        doc[name] = read(work / f"{name}.json")
    say("")
    say("== gpu_check summary " + "=" * 60)
    for s in doc["steps"]:
        say(f"  step {s['name']:16} rc {s['rc']:3}  {s['seconds']:4} s  (limit {s['limit']} s)")
    for name, line in doc["tests"].items():
        say(f"  tests {name}: {line}")
    if doc["bandwidth"]:
        b = doc["bandwidth"]
        say(f"  bandwidth: device {b['device_gbs']:.0f} GB/s, pinned H2D {b['h2d_gbs']:.1f} GB/s")
    for name in DECODE_STEPS:
        if doc[name]:
            say(f"  decode, {doc[name]['size']['layers']} layers at real expert size on {doc[name]['device']}")
            for r in doc[name]["rows"]:
                say(format_row(r))
    if doc["dequant"]:
        d = doc["dequant"]
        say(f"  Q4_K dequantize per use: {d['dequant_ms']:.3f} ms for {d['experts']} experts, "
            f"{d['dequant_over_matmul']:.1f}x one token's matmuls")
    if doc["diag"]:
        say(f"  GPT-OSS MXFP4 logits, float32 (max |logit| {doc['diag']['max_abs_logit']:.3f}):")
        for pair, d in doc["diag"]["diffs"].items():
            say(f"    {pair:58} {d:.2e}")
    if doc["bench_quantized"]:
        for r in doc["bench_quantized"].get("results", [])[:12]:
            say(f"  Q4_K vs bf16: {r.get('precision')} {r.get('strategy')} {r.get('slot_format')}: "
                f"{r.get('tok_s') or 0:.1f} tok/s, hit {r.get('hit_rate') or 0:.3f}")
    save(out / "gpu_check.json", doc)
    for name in DECODE_STEPS:
        if doc[name] and doc[name]["rows"]:
            plot(doc[name], out / f"gpu_check_{name}.png")
    say(f"results: {out}")
    return 0


def read_tests(work: Path) -> dict:
    """The last line pytest printed for each tests step (its pass / fail / skip counts)."""
    out = {}
    for path in sorted(work.glob("tests*.txt")):
        lines = [l for l in path.read_text().splitlines() if l.strip()]
        out[path.stem] = lines[-1] if lines else "no output"
    return out


def plot(doc: dict, path: Path) -> None:
    """Measured tok/s against each row's bound (log scale: they differ by orders of magnitude)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("(no matplotlib: no plot)")
        return
    rows = [r for r in doc["rows"] if "tok_s" in r][::-1]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.4))
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [r.get("bound_tok_s") or 0 for r in rows], height=0.4, color="tab:gray",
            label="bound (measured bandwidths)")
    ax.barh([i - 0.2 for i in y], [r["tok_s"] for r in rows], height=0.4, color="tab:blue", label="measured")
    ax.set_yticks(list(y), [r["name"] for r in rows], fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("decode tok/s (all sequences)")
    ax.legend(fontsize=7)
    ax.set_title(f"{doc['size']['layers']} MoE layers at Qwen3-30B-A3B expert size, {doc['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def read_steps(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return [{"name": n, "rc": int(rc), "seconds": int(s), "limit": int(lim)} for n, rc, s, lim in rows]


def main(argv=None) -> int:
    steps = {"bandwidth": bandwidth, "real": real, "full": full, "dequant": dequant, "diag": diag,
             "summary": summary}
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=tuple(steps))
    ap.add_argument("--work", required=True, help="folder for the steps' JSON (outside the files that come back)")
    ap.add_argument("--out", help="results folder (summary)")
    ap.add_argument("--rehearse", action="store_true", help="toy sizes on the CPU")
    args = ap.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    return steps[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
