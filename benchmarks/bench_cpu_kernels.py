"""Time per expert (gate + up + down) on the CPU: ggml's kernels vs torch's ways (docs/cpu.md).

Qwen3-30B-A3B sizes (H 2048, I 768), 1 and 8 tokens, one thread, interleaved, median of
``--repeats``: libggml-python's ``ggml_mul_mat_id`` on the quantized bytes (what
``cpu_kernel='ggml'`` runs), torch dequantize-then-matmul (``cpu_kernel='torch'``), torch
float32 matmul on weights dequantized once (a 'dequantized' slot), and torch's
``_weight_int8pack_mm`` on int8 weights repacked once.

    python benchmarks/bench_cpu_kernels.py --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from quant_fixtures import random_blocks  # noqa: E402

from expertcache.quant import ggml  # noqa: E402
from expertcache.quant.dequant import dequantize  # noqa: E402
from expertcache.quant.formats import quant_format  # noqa: E402

H, I = 2048, 768


def ways(name: str, tokens: int):
    fmt, rng = quant_format(name), np.random.default_rng(0)
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    q = {k: torch.from_numpy(random_blocks(name, r, c, rng).reshape(1, -1).copy()) for k, (r, c) in shapes.items()}
    f = {k: dequantize(q[k], fmt, (1, *shapes[k]), torch.float32)[0] for k in shapes}
    x = torch.randn(tokens, H)
    ids = torch.zeros(tokens, dtype=torch.int32)
    graphs = {k: ggml.MatmulId([ggml.Weight(fmt.ggml_type, *shapes[k], 1, q[k].shape[1])], tokens, 1)
              for k in shapes}
    outs = {k: torch.empty(tokens, shapes[k][0]) for k in shapes}
    int8 = {k: (w / (w.abs().amax(1, keepdim=True) / 127)).round().to(torch.int8) for k, w in f.items()}
    scale = {k: w.abs().amax(1) / 127 for k, w in f.items()}

    def mlp(lin):
        g, u = lin("gate", x), lin("up", x)
        return lin("down", (torch.nn.functional.silu(g) * u).contiguous())

    def g_lin(k, a):
        graphs[k]([q[k].data_ptr()], a.data_ptr(), ids.data_ptr(), [outs[k].data_ptr()])
        return outs[k]

    return {
        "ggml (libggml-python)": lambda: mlp(g_lin),
        "torch dequantize + matmul": lambda: mlp(lambda k, a: a @ dequantize(q[k], fmt, (1, *shapes[k]),
                                                                               torch.float32)[0].T),
        "torch float32 (dequantized once)": lambda: mlp(lambda k, a: a @ f[k].T),
        "torch _weight_int8pack_mm": lambda: mlp(lambda k, a: torch._weight_int8pack_mm(a, int8[k], scale[k])),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--types", default="Q4_K,Q6_K,Q8_0,MXFP4")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"ms per expert (gate+up+down, H {H}, I {I}), one thread, median of {args.repeats}")
    for name in args.types.split(","):
        for tokens in (1, 8):
            fns = ways(name, tokens)
            times = {k: [] for k in fns}
            for _ in range(args.repeats):
                for k, fn in fns.items():  # interleaved
                    start = time.perf_counter()
                    fn()
                    times[k].append(time.perf_counter() - start)
            cells = "  ".join(f"{k}: {statistics.median(v) * 1e3:.3f}" for k, v in times.items())
            print(f"{name:6} {tokens} tok  {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
