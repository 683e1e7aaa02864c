"""The GPU check's steps; ``benchmarks/gpu_check.sh`` runs each under its own timeout.

    python3 benchmarks/gpu_check.py real    --work W [--rehearse]   # exactness + decode, real expert size
    python3 benchmarks/gpu_check.py dequant --work W [--rehearse]   # Q4_K slots: dequantize-per-use cost
    python3 benchmarks/gpu_check.py summary --work W --out R        # one table, one JSON, one PNG

``real`` builds a Qwen3-30B-A3B-shaped model on the device (bf16; hidden 2048, expert FF 768,
128 experts, top-8, 12 layers; ``--rehearse``: the same code at toy sizes on the CPU) whose
routers follow a real routing trace, and runs the same greedy decode for plain transformers
(everything on the device) and for each expertcache configuration, in one process, one row
after another, most valuable first. Per row: logits against plain transformers, greedy
tokens equal, steady decode tok/s, hit rate, H2D bytes per token, the runtime's own
device-to-host syncs per token (and, on CUDA, every sync per token by torch's sync debug
mode), and the host's time per MoE step. A row is printed and ``W/real.json`` rewritten as
soon as it is measured, so a step cut by its timeout keeps what it had.

The routing: the trace in ``.gpu-trace/`` (carried to the GPU machine, ``make gpu-trace``),
else ``../shared/traces/``, else synthetic (said in the output). A forward hook on each
router replaces its top-k ids with the trace's for those token positions and its weights
with the softmax of its own logits at those ids, so every model routes identically.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
# transformers 5.2x renames past_key_values; the loop below uses the name every 5.x takes
warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
TRACE_NAME = "qwen3-30b-a3b-code.npz"
REAL = dict(layers=12, hidden=2048, ff=768, heads=32, kv=4, head_dim=128, vocab=4096,
            prompt=32, warm=8, timed=32, counted=4, dtype="bfloat16", device="cuda")
TOY = dict(layers=2, hidden=64, ff=32, heads=4, kv=2, head_dim=16, vocab=256,
           prompt=8, warm=2, timed=6, counted=2, dtype="float32", device="cpu")
ROWS = [  # most valuable first: the step's timeout may cut the tail
    ("resident", dict(baseline="resident")),
    ("25% fetch", dict(fraction=0.25, miss="fetch")),
    ("50% fetch", dict(fraction=0.5, miss="fetch")),
    ("cpu (--cpu-moe)", dict(baseline="cpu")),
    ("25% cpu", dict(fraction=0.25, miss="cpu")),
    ("25% auto", dict(fraction=0.25, miss="auto")),
    ("copy-every-pass", dict(baseline="copy-every-pass")),
    ("50% cpu", dict(fraction=0.5, miss="cpu")),
    ("50% auto", dict(fraction=0.5, miss="auto")),
]
DEVICE_ROWS = [  # planner='device' against the host-planned rows above (issue 26), when it exists
    ("resident, device planner", dict(baseline="resident", planner="device")),
    ("25% fetch, device planner", dict(fraction=0.25, miss="fetch", planner="device")),
    ("50% fetch, device planner", dict(fraction=0.5, miss="fetch", planner="device")),
]


def say(*parts) -> None:
    print(*parts, flush=True)


# -- routing -----------------------------------------------------------------------------
def routing(layers: int, tokens: int, experts: int, k: int) -> tuple[np.ndarray, str]:
    """Expert ids [layers, tokens, k] from a real trace when one is here, else synthetic."""
    for path in (ROOT / ".gpu-trace" / TRACE_NAME, ROOT.parent / "shared" / "traces" / TRACE_NAME):
        if path.exists():
            ids = np.load(path)["experts"]
            if ids.shape[0] >= layers and ids.shape[1] >= tokens and ids.shape[2] >= k and ids.max() < experts:
                return ids[:layers, :tokens, :k].astype(np.int64), f"real trace {path.name} ({path.parent})"
    rng = np.random.default_rng(0)
    ids = np.stack([[rng.choice(experts, k, replace=False) for _ in range(tokens)] for _ in range(layers)])
    return ids, "synthetic (no trace carried: make gpu-trace)"


class ForcedRouting:
    """Forward hooks that make each router pick the trace's experts at each token position."""

    def __init__(self, ids: np.ndarray, device) -> None:
        self.ids = torch.as_tensor(ids, device=device)     # [L, T, K]
        self.pos = [0] * ids.shape[0]

    def reset(self) -> None:
        self.pos = [0] * len(self.pos)

    def attach(self, model) -> list:
        from expertcache.integrations.record import _router_of
        from expertcache.loaders.common import find_experts

        routers = [_router_of(model, name) for name, _ in find_experts(model)]
        return [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, layer: int):
        def hook(module, args, output):
            logits, scores, _ = output                      # [T, E], [T, K], [T, K]
            T, p = logits.shape[0], self.pos[layer]
            self.pos[layer] += T
            ids = self.ids[layer, p:p + T]                  # [T, K]
            weights = torch.softmax(logits.float().gather(1, ids), dim=-1).to(scores.dtype)
            return logits, weights, ids
        return hook


# -- the model and one decode run ------------------------------------------------------------
def build(size: dict):
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(hidden_size=size["hidden"], num_hidden_layers=size["layers"],
                            num_attention_heads=size["heads"], num_key_value_heads=size["kv"],
                            head_dim=size["head_dim"], num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=size["ff"], intermediate_size=3 * size["hidden"],
                            decoder_sparse_step=1, vocab_size=size["vocab"], max_position_embeddings=4096,
                            eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(size["device"]):  # built on the device: no 15 GB pass through host RAM
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, size["dtype"]))
    return model.eval()


@dataclasses.dataclass
class Run:
    logits: torch.Tensor       # [steps, V] float32 on the host: the prompt's last, then each decode step
    tokens: list[int]
    tok_s: float
    syncs_all: float | None    # every sync per token (CUDA sync debug mode), None on the CPU


def decode(model, force: ForcedRouting, prompt: torch.Tensor, size: dict, clock=None) -> Run:
    """Greedy decode in a plain loop (no generate(): its own syncs would blur the count).
    ``clock`` (a StepClock) counts only the timed tokens."""
    cuda = prompt.device.type == "cuda"
    force.reset()
    logits, tokens = [], []
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        past, last = out.past_key_values, out.logits[:, -1]
        logits.append(last)

        def step():
            nonlocal past, last
            tok = last.argmax(-1, keepdim=True)               # [1, 1], stays on the device
            tokens.append(tok)
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past, last = out.past_key_values, out.logits[:, -1]
            logits.append(last)

        for _ in range(size["warm"]):
            step()
        sync(cuda)
        t = time.perf_counter()
        if clock is not None:
            clock.active = True
        for _ in range(size["timed"]):
            step()
        sync(cuda)
        tok_s = size["timed"] / (time.perf_counter() - t)
        if clock is not None:
            clock.active = False
        syncs_all = None
        if cuda:  # a few more tokens with every sync reported (the timed window ran without)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(size["counted"]):
                        step()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            syncs_all = sum("synchroniz" in str(w.message) for w in seen) / size["counted"]
        else:
            for _ in range(size["counted"]):
                step()
    return Run(torch.cat(logits).float().cpu(), torch.cat(tokens).flatten().tolist(), tok_s, syncs_all)


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


class StepClock:
    """Host time inside the runtime's MoE step, the waits of its deliberate syncs apart, and
    the count of those syncs (the ids every step; the activations for steps computed on the
    host), while ``active`` (the timed tokens)."""

    def __init__(self) -> None:
        from expertcache.runtime import experts as mod

        self.mod, self.real = mod, (mod.run_step, mod._ids_to_host, mod._acts_to_host)
        self.steps = self.syncs = 0
        self.step_s = self.sync_s = 0.0
        self.active = False

    def __enter__(self):
        run_step, ids_to_host, acts_to_host = self.real

        def timed_step(*args):
            t = time.perf_counter()
            try:
                return run_step(*args)
            finally:
                if self.active:
                    self.steps += 1
                    self.step_s += time.perf_counter() - t

        def timed_sync(real):
            def call(*args):
                t = time.perf_counter()
                try:
                    return real(*args)
                finally:
                    if self.active:
                        self.syncs += 1
                        self.sync_s += time.perf_counter() - t
            return call

        self.mod.run_step = timed_step
        self.mod._ids_to_host, self.mod._acts_to_host = timed_sync(ids_to_host), timed_sync(acts_to_host)
        return self

    def __exit__(self, *exc) -> None:
        self.mod.run_step, self.mod._ids_to_host, self.mod._acts_to_host = self.real


# -- the step -------------------------------------------------------------------------------
def real(args) -> int:
    from expertcache import offload
    from expertcache.config import CacheConfig
    from expertcache.loaders.common import find_experts
    from expertcache.runtime.host import HostExperts

    size = TOY if args.rehearse else REAL
    if size["device"] == "cuda" and not torch.cuda.is_available():
        say("real: no CUDA device visible to torch; use --rehearse on a CPU")
        return 2
    dev = torch.device(size["device"])
    positions = size["prompt"] + size["warm"] + size["timed"] + size["counted"] + 1
    ids, source = routing(size["layers"], positions, 128, 8)
    say(f"real: {size['layers']} layers, hidden {size['hidden']}, expert FF {size['ff']}, 128 experts, top-8, "
        f"{size['dtype']} on {dev}; routing: {source}")
    t = time.perf_counter()
    base = build(size)
    force = ForcedRouting(ids, dev)
    prompt = torch.randint(1, size["vocab"], (1, size["prompt"]), generator=torch.Generator().manual_seed(1)).to(dev)
    result = {"size": size, "routing": source, "device": device_name(dev), "rows": []}
    path = Path(args.work) / "real.json"
    handles = force.attach(base)
    decode(base, force, prompt[:, :4], dict(size, warm=1, timed=1, counted=0))  # kernels, allocator
    ref = decode(base, force, prompt, size)
    for h in handles:
        h.remove()
    say(f"built and ran plain transformers in {time.perf_counter() - t:.1f} s")
    row(result, "plain transformers (all on the device)", ref, ref, None, None, size)
    save(path, result)
    # the experts go to (pinned) host memory once; every configuration takes those same tensors
    t = time.perf_counter()
    names = [name for name, _ in find_experts(base)]
    mode = "pinned" if dev.type == "cuda" else "copy"
    hosts = [HostExperts.take(base.get_submodule(name), mode) for name in names]
    say(f"experts to host memory ({mode}) in {time.perf_counter() - t:.1f} s")
    total = size["layers"] * 128
    compile_policies()
    has_planner = "planner" in {f.name for f in dataclasses.fields(CacheConfig)}
    for label, settings in ROWS + (DEVICE_ROWS if has_planner else []):
        settings = dict(settings)
        if "fraction" in settings:
            settings["slots"] = int(settings.pop("fraction") * total)
        model = copy.deepcopy(base)  # no expert weights: cheap
        for host, name in zip(hosts, names):
            host.restore(model.get_submodule(name))  # parameters over the same host tensors: no copy
        try:
            model = offload(model, device=str(dev), **settings)
        except ValueError as e:
            say(f"  {label}: refused: {e}")
            continue
        handles = force.attach(model)
        with StepClock() as clock:
            run = decode(model, force, prompt, size, clock)
        cache = model.expertcache
        row(result, label, run, ref, cache, clock, size, settings)
        save(path, result)
        for h in handles:
            h.remove()
        del model, cache
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if not has_planner:
        say("  (no planner setting in this checkout: the device-planner rows wait for issue 26)")
    return 0


def compile_policies() -> None:
    """Numba compiles the built-in policies on first use: once here, not inside a measured row."""
    from expertcache.cache import SlotTable

    t = time.perf_counter()
    table = SlotTable(1, 16, 8)
    for e in range(16):
        table.step(0, [e])
    say(f"policy kernels ready in {time.perf_counter() - t:.1f} s (NUMBA_CACHE_DIR: {os.environ.get('NUMBA_CACHE_DIR')})")


def row(result: dict, label: str, run: Run, ref: Run, cache, clock, size: dict, settings=None) -> None:
    tokens = size["warm"] + size["timed"] + size["counted"]
    diff = (run.logits - ref.logits).abs().max().item()
    out = {"name": label, "settings": settings, "tok_s": run.tok_s, "tokens_equal": run.tokens == ref.tokens,
           "max_logit_diff": diff, "syncs_all_per_token": run.syncs_all}
    if cache is not None:
        stats = cache.stats()
        decode_steps = tokens * size["layers"]
        out.update(hit_rate=stats.total("decode").hit_rate, h2d_mb_per_token=stats.h2d_bytes("decode") / tokens / 1e6,
                   pool_mb=cache.slot_bytes / 1e6, slots=cache.pool.slots, staging=cache.pool.staging,
                   runtime_syncs_per_token=clock.syncs / size["timed"],
                   host_us_per_step=1e6 * (clock.step_s - clock.sync_s) / clock.steps,
                   sync_wait_us_per_step=1e6 * clock.sync_s / clock.steps, decode_steps=decode_steps,
                   hardware=cache.hardware.name)
    result["rows"].append(out)
    say(format_row(out))


def format_row(r: dict) -> str:
    def f(key, fmt, width):
        v = r.get(key)
        return f"{'-':>{width}}" if v is None else f"{v:{width}{fmt}}"
    return (f"  {r['name'][:40]:40} {r['tok_s']:8.1f} tok/s  equal {str(r['tokens_equal']):5} "
            f"diff {r['max_logit_diff']:.1e}  hit {f('hit_rate', '.3f', 5)}  H2D {f('h2d_mb_per_token', '.1f', 7)} MB/tok"
            f"  syncs {f('runtime_syncs_per_token', '.0f', 3)}/{f('syncs_all_per_token', '.0f', 3)} per tok"
            f"  host {f('host_us_per_step', '.0f', 5)} us/step")


def dequant(args) -> int:
    """Quantized (Q4_K/Q6_K) slots dequantize the experts a step reads, on every use. How long
    that takes next to the step's own matmuls, at Qwen3-30B-A3B's expert shape (review 7)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
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
    timer = Timer(dev)
    dq_s, peak = timer.best(lambda: host.codec.decode(stored))
    weights = {k: v.to(dev) for k, v in host.codec.decode(stored).items()}     # [n, ...] compute dtype
    x = torch.randn(1, hidden, device=dev, dtype=weights["down_proj"].dtype)
    slot_idx = torch.arange(8, device=dev).view(1, 8) % n
    w = torch.full((1, 8), 1 / 8, device=dev)
    mm_s, _ = timer.best(lambda: grouped_over_slots(module, x, slot_idx, w, weights, [(s, 1) for s in range(n)],
                                                    False, False))
    out = {"experts": n, "hidden": hidden, "ff": ff, "device": device_name(dev),
           "dequant_ms": 1e3 * dq_s, "matmul_ms_one_token": 1e3 * mm_s, "dequant_over_matmul": dq_s / mm_s,
           "stored_mb": sum(t.numel() for t in stored.values()) / 1e6,
           "compute_mb": sum(t.numel() * t.element_size() for t in weights.values()) / 1e6,
           "peak_scratch_mb": None if peak is None else peak / 1e6}
    say(f"dequant: {n} Q4_K experts ({out['stored_mb']:.1f} MB stored -> {out['compute_mb']:.1f} MB) in "
        f"{out['dequant_ms']:.3f} ms; one token's matmuls over them {out['matmul_ms_one_token']:.3f} ms "
        f"({out['dequant_over_matmul']:.1f}x); peak scratch "
        f"{'-' if peak is None else f'{peak / 1e6:.0f} MB'}")
    save(Path(args.work) / "dequant.json", out)
    return 0


class Timer:
    """Best of a few runs: CUDA events on a GPU, wall time on the CPU; peak memory on CUDA."""

    def __init__(self, dev: torch.device) -> None:
        self.cuda = dev.type == "cuda"

    def best(self, fn, repeats: int = 10) -> tuple[float, int | None]:
        fn()
        times, peak = [], None
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        for _ in range(repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        if self.cuda:
            peak = torch.cuda.max_memory_allocated() - base
        return min(times), peak


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (rehearsal)"


def save(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2))


# -- the summary ------------------------------------------------------------------------------
def summary(args) -> int:
    work, out = Path(args.work), Path(args.out)
    doc = {"steps": read_steps(work / "steps.txt"), "environment": read(work / "env.json")}
    for name in ("real", "dequant", "bench_quantized"):
        doc[name] = read(work / f"{name}.json")
    say("")
    say("== gpu_check summary " + "=" * 60)
    for s in doc["steps"]:
        say(f"  step {s['name']:16} rc {s['rc']:3}  {s['seconds']:4} s  (limit {s['limit']} s)")
    tests = (work / "tests.txt").read_text().strip().splitlines() if (work / "tests.txt").exists() else []
    say(f"  CUDA tests: {tests[-1] if tests else 'no output'}")
    real_doc = doc["real"]
    if real_doc:
        say(f"  decode, {real_doc['size']['layers']} layers at real expert size on {real_doc['device']}; "
            f"routing: {real_doc['routing']}")
        for r in real_doc["rows"]:
            say(format_row(r))
    if doc["dequant"]:
        d = doc["dequant"]
        say(f"  Q4_K dequantize per use: {d['dequant_ms']:.3f} ms for {d['experts']} experts, "
            f"{d['dequant_over_matmul']:.1f}x one token's matmuls")
    if doc["bench_quantized"]:
        for r in doc["bench_quantized"].get("results", [])[:12]:
            say(f"  Q4_K vs bf16: {r.get('precision')} {r.get('strategy')} {r.get('slot_format')}: "
                f"{r.get('tok_s') or 0:.1f} tok/s, hit {r.get('hit_rate') or 0:.3f}")
    save(out / "gpu_check.json", doc)
    if real_doc and real_doc["rows"]:
        plot(real_doc, out / "gpu_check.png")
    say(f"results: {out}")
    return 0


def plot(doc: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("(no matplotlib: no plot)")
        return
    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.2))
    ax.barh([r["name"] for r in rows][::-1], [r["tok_s"] for r in rows][::-1], color="tab:blue")
    ax.set_xlabel("steady decode tok/s")
    ax.set_title(f"{doc['size']['layers']} MoE layers at Qwen3-30B-A3B expert size, {doc['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def read(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def read_steps(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return [{"name": n, "rc": int(rc), "seconds": int(s), "limit": int(lim)} for n, rc, s, lim in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=("real", "dequant", "summary"))
    ap.add_argument("--work", required=True, help="folder for the steps' JSON (outside the files that come back)")
    ap.add_argument("--out", help="results folder (summary)")
    ap.add_argument("--rehearse", action="store_true", help="toy sizes on the CPU")
    args = ap.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    return {"real": real, "dequant": dequant, "summary": summary}[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
