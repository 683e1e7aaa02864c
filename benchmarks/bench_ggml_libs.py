"""One routed expert step through two ggml builds: libggml-python's and a native one (issue 18).

The step the resident path runs per MoE layer and decode token: Q4_K experts at
Qwen3-30B-A3B sizes (H 2048, I 768), top-8, 1 token: gate+up in one ``ggml_mul_mat_id``
graph over ids [1, 8], SiLU-gate in torch, down in a second graph. Each library runs in
its own process (``$EXPERTCACHE_GGML_LIB`` picks it; one process cannot load both), the
two alternate over ``--rounds``, and each round's figure is the median of ``--steps``
steps on one thread; successive steps read other experts, so each reads from memory.

    python benchmarks/bench_ggml_libs.py \\
        --native /work/refs/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

H, I, K, E = 2048, 768, 8, 64   # E experts stored: 8 disjoint top-8 sets, read in turn


def child(steps: int) -> dict:
    import numpy as np
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from quant_fixtures import random_blocks

    from expertcache.quant import ggml
    from expertcache.quant.formats import quant_format

    torch.set_num_threads(1)
    fmt, rng = quant_format("Q4_K"), np.random.default_rng(0)
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    q = {k: torch.from_numpy(random_blocks("Q4_K", E * r, c, rng).reshape(E, -1).copy())   # [E, bytes]
         for k, (r, c) in shapes.items()}
    spec = {k: ggml.Weight(fmt.ggml_type, *shapes[k], E, q[k].shape[1]) for k in shapes}
    first = ggml.MatmulId([spec["gate"], spec["up"]], 1, 1, K)                            # x [1, H]
    down = ggml.MatmulId([spec["down"]], 1, 1, K, True)                                    # x [1, K, I]
    x = torch.randn(1, H)
    gate, up, out = torch.empty(K, I), torch.empty(K, I), torch.empty(K, H)
    sets = [torch.arange(s * K, (s + 1) * K, dtype=torch.int32).view(1, K) for s in range(E // K)]  # [1, K]
    times = []
    for step in range(steps):
        ids = sets[step % len(sets)]
        start = time.perf_counter()
        first([q["gate"].data_ptr(), q["up"].data_ptr()], x.data_ptr(), ids.data_ptr(),
              [gate.data_ptr(), up.data_ptr()])
        act = (torch.nn.functional.silu(gate) * up).contiguous()                          # [K, I]
        down([q["down"].data_ptr()], act.data_ptr(), ids.data_ptr(), [out.data_ptr()])
        times.append(time.perf_counter() - start)
    return {"lib": ggml.available()[1], "ms_step": statistics.median(times) * 1e3,
            "ms_expert": statistics.median(times) * 1e3 / K}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--native", help="folder with a native libggml-base.so and libggml-cpu.so")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--json", help="write every round here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.steps)))
        return 0
    libs = {"libggml-python": None, "native": args.native}
    rounds = {k: [] for k in libs}
    for _ in range(args.rounds):
        for label, where in libs.items():
            env = {k: v for k, v in os.environ.items() if k != "EXPERTCACHE_GGML_LIB"}
            if where:
                env["EXPERTCACHE_GGML_LIB"] = where
            out = subprocess.run([sys.executable, __file__, "--child", "--steps", str(args.steps)], env=env,
                                 capture_output=True, text=True, check=True).stdout
            rounds[label].append({**json.loads(out.splitlines()[-1]), "load_1min": os.getloadavg()[0]})
            print(label, rounds[label][-1], flush=True)
    ratios = [a["ms_step"] / b["ms_step"] for a, b in zip(rounds["libggml-python"], rounds["native"])]
    print(f"libggml-python / native per round: {', '.join(f'{r:.2f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"H": H, "I": I, "K": K, "rounds": rounds, "ratios": ratios},
                                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
