"""The fused MoE kernel over the slot pool (issue 31) against the old path, at Qwen3-30B-A3B's expert
shape (hidden 2048, expert FF 768, top-8), bf16 and Q4_K slots.

Rows:
- the kernel's time for the same pairs in pools of 384, 1536 and 6144 rows (one pool allocated at
  the largest size, viewed shorter): the goal is time at 6144 within 1.1x of time at 384;
- the old path beside it: bf16, the device step's grouped matmul over every pool row (in windows of
  1024); Q4_K, the used slots dequantized into a scratch, then the grouped matmul (``SlotPool.view``);
- bytes the kernel reads a token (weights of the rows used, once each) against the bound from the
  device's read bandwidth, measured here with a plain torch reduction over 2 GiB;
- bf16 against Q4_K at one memory budget: rows each holds, and the kernel's time a token.
Times: CUDA events, median of 7 batches of --iters calls; "graph": the call captured in a CUDA graph
and replayed (no launch overhead: what decode under graphs pays), "eager": launched from Python.

    PYTHONPATH=src python benchmarks/bench_fused.py [--json out.json]          # CUDA (H200: ~40 s)
    PYTHONPATH=src .venv-vllm/bin/python benchmarks/bench_fused.py --device cpu  # rehearsal, toy sizes,
        # the kernel under Triton's interpreter (set here); without Triton its rows say so and skip
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

TOY = dict(hidden=256, inter=256, top_k=2, pools=(8, 16, 32), tokens=(1,), iters=1, budget_gib=0.0004)
REAL = dict(hidden=2048, inter=768, top_k=8, pools=(384, 1536, 6144), tokens=(1, 16), iters=20, budget_gib=16)


class SiluExperts(torch.nn.Module):
    """The experts' math the kernel computes (Qwen3's): silu(gate) * up."""

    has_gate = True

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined
    from expertcache.runtime import fused

    size = REAL if device.type == "cuda" else TOY
    why = fused.triton_refusal()
    t0 = time.time()
    print(f"bench_fused on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}, hidden {size['hidden']}, FF {size['inter']}, top-{size['top_k']}"
          + (f"; {why}: the fused kernel's rows are skipped" if why else
             "; Triton's interpreter (toy sizes)" if device.type == "cpu" else ""))
    bandwidth = read_bandwidth(device)
    print(f"device read bandwidth: {bandwidth / 1e9:.0f} GB/s (a torch sum over "
          f"{'2 GiB' if device.type == 'cuda' else '64 MiB'})")
    print(f"{'fmt':>5} {'pool':>6} {'T':>4} {'used':>5} {'graph us':>9} {'eager us':>9} {'old us':>9} "
          f"{'MB/token':>9} {'bound us':>9} {'frac':>6}")
    rows = []
    for fmt in ("bf16", "Q4_K"):
        bench = Bench(fmt, size, device)
        for T in size["tokens"]:
            pairs = bench.pairs(T, size["pools"][0])
            for pool in size["pools"]:
                rows.append(bench.row(pool, pairs, bandwidth, why is None, size["iters"]))
                print_row(rows[-1])
        del bench
        if device.type == "cuda":
            torch.cuda.empty_cache()
    table(rows, size, bandwidth)
    out = {"device": str(device), "bandwidth_read": bandwidth, "rows": rows, "size": {k: v for k, v in size.items()},
           "seconds": time.time() - t0}
    print(f"done in {out['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def read_bandwidth(device: torch.device) -> float:
    """Bytes a second a reduction reads (the kernel's weights are read once each)."""
    n = (2 << 30) if device.type == "cuda" else (64 << 20)
    x = torch.ones(n // 2, dtype=torch.bfloat16, device=device)
    x.sum()
    times = [timed(lambda: x.sum(), device, 5) for _ in range(5)]
    return n / min(times)


def timed(fn, device: torch.device, iters: int) -> float:
    """Seconds a call, over ``iters`` calls (CUDA events)."""
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def median_time(fn, device, iters: int) -> float:
    fn()
    return statistics.median(timed(fn, device, iters) for _ in range(7 if device.type == "cuda" else 1))


def graphed(fn, device):
    """``fn`` captured in a CUDA graph (None if capture fails: then only eager is timed)."""
    if device.type != "cuda":
        return None
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except RuntimeError as e:
        print(f"  (graph capture failed: {str(e).splitlines()[0][:120]})")
        return None


class Bench:
    """One format's pool at the largest size; rows view a prefix of it."""

    def __init__(self, fmt: str, size: dict, device: torch.device) -> None:
        from expertcache.quant.formats import quant_format
        from expertcache.runtime.quantized import Codec, Kind, Part

        self.fmt, self.device, self.size = fmt, device, size
        H, I, S = size["hidden"], size["inter"], size["pools"][-1]
        g = torch.Generator(device=device).manual_seed(0)
        if fmt == "bf16":
            self.pool = {"gate_up_proj": torch.randn(S, 2 * I, H, device=device, dtype=torch.bfloat16, generator=g),
                         "down_proj": torch.randn(S, H, I, device=device, dtype=torch.bfloat16, generator=g)}
            self.codec = None
            self.expert_bytes = 3 * H * I * 2
        else:
            f = quant_format(fmt)
            parts = (Part("g", f, (I, H)), Part("u", f, (I, H)), Part("d", f, (H, I)))
            self.codec = Codec(parts, (Kind("gate_up_proj", "concat", ("g", "u")), Kind("down_proj", "one", ("d",))),
                               torch.bfloat16)
            self.pool = {p.name: random_q4_k(S, p.nbytes, device, g) for p in parts}
            self.expert_bytes = self.codec.expert_bytes
        self.module = SiluExperts()

    def pairs(self, T: int, within: int):
        """T tokens' top-k rows, distinct per token, all in the first ``within`` rows (the same pairs
        for every pool size); x and routing weights."""
        g = torch.Generator().manual_seed(T)
        K, H = self.size["top_k"], self.size["hidden"]
        rows = torch.stack([torch.randperm(within, generator=g)[:K] for _ in range(T)])
        return (rows.to(self.device), torch.rand(T, K, generator=g).to(self.device),
                torch.randn(T, H, generator=g).to(self.device, torch.bfloat16))

    def row(self, pool_rows: int, pairs, bandwidth: float, fused_ok: bool, iters: int) -> dict:
        from expertcache.runtime import fused

        rows, weights, x = pairs
        T, K = rows.shape
        view = {k: v[:pool_rows] for k, v in self.pool.items()}
        unique = len(set(rows.reshape(-1).tolist()))
        read = unique * self.expert_bytes                                  # weights read once each
        out = {"format": self.fmt, "pool_rows": pool_rows, "tokens": T, "pairs": T * K, "unique_rows": unique,
               "bytes_read_per_token": read / T, "bound_s": read / bandwidth}
        if fused_ok:
            layout = fused.float_layout(view, False) if self.codec is None else fused.quant_layout(view, self.codec)
            call = lambda: fused.fused_experts(x, weights, rows, layout)  # noqa: E731
            out["fused_eager_s"] = median_time(call, self.device, iters)
            replay = graphed(call, self.device)
            out["fused_graph_s"] = median_time(replay, self.device, iters) if replay else None
        out["old_s"] = median_time(self.old_path(view, pairs), self.device, iters)
        best = out.get("fused_graph_s") or out.get("fused_eager_s")
        out["fraction_of_bound"] = out["bound_s"] / best if best else None
        return out

    def old_path(self, view, pairs):
        """bf16: the device step's grouped matmul over every row (fused kernel off); Q4_K: the used
        rows dequantized into a scratch, then the grouped matmul over it (SlotPool.view's way)."""
        from expertcache.runtime import fused
        from expertcache.runtime.compute import grouped_mm_works, grouped_over_slots
        from expertcache.runtime.devicepath import slots_kernel

        rows, weights, x = pairs
        if self.codec is None:
            fused.ENABLED = False
            try:
                kernel = slots_kernel(self.module, view, False)
            finally:
                fused.ENABLED = True
            return lambda: kernel(x, weights, rows)
        used = sorted(set(rows.reshape(-1).tolist()))
        index = torch.tensor(used, device=self.device)
        local = {r: i for i, r in enumerate(used)}
        slot_idx = torch.tensor([[local[r] for r in row] for row in rows.tolist()], device=self.device)
        groups = sorted((i, rows.reshape(-1).tolist().count(r)) for r, i in local.items())
        grouped = grouped_mm_works(self.device, torch.bfloat16)
        size = self.codec.part

        def call():
            scratch = self.codec.decode({k: t.index_select(0, index)[:, :size[k].nbytes] for k, t in view.items()})
            return grouped_over_slots(self.module, x, slot_idx, weights, scratch, groups, grouped, False)
        return call


def random_q4_k(rows: int, nbytes: int, device, g) -> torch.Tensor:
    """Valid Q4_K bytes: random, with each block's fp16 d and dmin set to 1e-3 (finite weights)."""
    data = torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, device=device, generator=g)
    blocks = data.view(rows, nbytes // 144, 144)
    half = torch.tensor([1e-3], dtype=torch.float16).view(torch.uint8).to(device)
    blocks[..., 0:2] = half
    blocks[..., 2:4] = half
    return data


def us(s) -> str:
    return f"{'-':>9}" if s is None else f"{s * 1e6:9.1f}"


def print_row(r: dict) -> None:
    frac = "-" if r["fraction_of_bound"] is None else f"{r['fraction_of_bound']:.2f}"
    print(f"{r['format']:>5} {r['pool_rows']:>6} {r['tokens']:>4} {r['unique_rows']:>5} "
          f"{us(r.get('fused_graph_s'))} {us(r.get('fused_eager_s'))} {us(r['old_s'])} "
          f"{r['bytes_read_per_token'] / 1e6:9.2f} {us(r['bound_s'])} {frac:>6}", flush=True)


def table(rows: list[dict], size: dict, bandwidth: float) -> None:
    print("\ncolumns: format, pool rows, tokens, rows used, fused us (graph), fused us (eager), old path us, "
          "MB read a token, bound us (bytes / read bandwidth), fraction of the bound (bound / fused)")
    pools = size["pools"]
    for fmt in ("bf16", "Q4_K"):
        for T in size["tokens"]:
            mine = {r["pool_rows"]: r for r in rows if r["format"] == fmt and r["tokens"] == T}
            key = "fused_graph_s" if mine[pools[0]].get("fused_graph_s") else "fused_eager_s"
            if mine[pools[0]].get(key):
                print(f"{fmt} T={T}: fused at {pools[-1]} rows / at {pools[0]} rows = "
                      f"{mine[pools[-1]][key] / mine[pools[0]][key]:.2f}x (goal <= 1.1x); old path: "
                      f"{mine[pools[-1]]['old_s'] / mine[pools[0]]['old_s']:.2f}x; "
                      f"old / fused at {pools[-1]} rows: {mine[pools[-1]]['old_s'] / mine[pools[-1]][key]:.1f}x")
    budget = size["budget_gib"] * 2 ** 30
    held = {}
    for fmt in ("bf16", "Q4_K"):
        r = next(r for r in rows if r["format"] == fmt and r["tokens"] == 1 and r["pool_rows"] == pools[0])
        per_row = r["bytes_read_per_token"] / r["unique_rows"]
        t = r.get("fused_graph_s") or r.get("fused_eager_s")
        held[fmt] = (int(budget // per_row), t)
    print(f"at one budget of {budget / 2 ** 30:g} GiB: bf16 holds {held['bf16'][0]} experts, Q4_K {held['Q4_K'][0]} "
          f"({held['Q4_K'][0] / max(held['bf16'][0], 1):.1f}x); fused kernel a decode token: bf16 {us(held['bf16'][1])} us, "
          f"Q4_K {us(held['Q4_K'][1])} us")


if __name__ == "__main__":
    sys.exit(main())
