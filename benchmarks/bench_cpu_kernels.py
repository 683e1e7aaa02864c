"""Time per expert (gate + up + down) on the CPU: ggml's kernels vs torch's ways, and ggml as
three packages build it (issue 18, docs/cpu.md "Measurements").

Sizes (``--sizes``): Qwen3-30B-A3B (H 2048, I 768) and GPT-OSS-120B (H 2880, I 2880); types
Q4_K, Q6_K, Q8_0, MXFP4; 1 and 8 tokens; one thread; median of ``--repeats``; random valid
blocks (tests/quant_fixtures.py). GPT-OSS's 2880 is not a multiple of 256, so no K-quant can
hold its rows: llama.cpp's quantizer falls back (Q4_K -> Q5_0, Q6_K -> Q8_0), and those rows
time the fallback type.

Ways (one process, interleaved call by call):
- ggml (libggml-python): ``ggml_mul_mat_id`` on the quantized bytes, gate+up in one graph
  and down in a second, as ``cpu_kernel='ggml'`` runs them (runtime/cpukernel.py);
- torch dequantize + matmul (``cpu_kernel='torch'``);
- torch float32 matmul on weights dequantized once (a 'dequantized' slot);
- torch ``_weight_int8pack_mm`` on int8 weights (per-row scales) repacked once;
- torch ``_weight_int4pack_mm_for_cpu`` on 4-bit weights (groups of ``--int4-group`` with
  scale and zero) repacked once by ``_convert_weight_to_int4pack_for_cpu``.
The int8 and int4 ways take bfloat16 activations and scales (``--packed-dtype``): that is
their fast path; with float32 ones torch runs a generic loop 4-40x slower. They requantize
the float weights and lose ggml's block scales, so each cell also records every way's error
against the float32 way.

ggml builds (``--lib NAME=FOLDER``, each in its own process through ``$EXPERTCACHE_GGML_LIB``,
alternating over ``--rounds`` as bench_ggml_libs.py does): libggml-python always, plus e.g.
ggml-python's (built at its install), llama-cpp-python's (its wheel bundles llama.cpp's ggml,
built at its install) and a native llama.cpp build. Each build's outputs are first compared
with libggml-python's; one that differs is not timed. Settings after the folder go to that build's process: llama.cpp's ggml (0.25.3) takes a
tiled K-quant kernel from 8 rows per expert on, which ``GGML_CPU_TILED_MM=0`` turns off.

Every ggml call reads another copy of the expert (64 MiB of copies in turn), so no way finds
its weights in cache; the torch ways read theirs after the others have evicted them.

    L=/work/refs/llamacpp-venv/lib/python3.11/site-packages/llama_cpp/lib
    flock /tmp/bench.lock python benchmarks/bench_cpu_kernels.py --repeats 10 --rounds 4 \\
        --lib ggml-python=/work/refs/ggmlpy-venv/lib/python3.11/site-packages/ggml/lib \\
        --lib llama-cpp-python=$L --lib "llama-cpp-python untiled=$L,GGML_CPU_TILED_MM=0" \\
        --lib llama.cpp=/work/refs/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin \\
        --json benchmarks/results/cpu_kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from quant_fixtures import random_blocks  # noqa: E402

from expertcache.quant import ggml  # noqa: E402
from expertcache.quant.dequant import dequantize  # noqa: E402
from expertcache.quant.formats import quant_format  # noqa: E402

SIZES = {"qwen3-30b-a3b": (2048, 768), "gpt-oss-120b": (2880, 2880)}  # H, I (shared/CONTEXT.md)
TYPES = ("Q4_K", "Q6_K", "Q8_0", "MXFP4")
TOKENS = (1, 8)
# llama.cpp's tensor_type_fallback (src/llama-quant.cpp) when a row is not whole blocks
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
ROTATE_BYTES = 64 << 20  # 8x this VM's L3 (lscpu: 8 MiB), 2x an EPYC CCD's 32 MiB
SAME_TOL = 1e-3  # max |a - b| / max |b| for two ggml builds to count as computing the same
GGML_WAY = "ggml (libggml-python)"


def cells(sizes: list[str], types: list[str]) -> list[dict]:
    """Every (size, type asked, type stored) to time: a type whose blocks do not divide the
    rows becomes llama.cpp's fallback, once (Q6_K's Q8_0 is the Q8_0 row when that is asked)."""
    out = []
    for size in sizes:
        H, I = SIZES[size]
        stored = []
        for name in types:
            block = quant_format(name).block_elements
            use = name if H % block == 0 and I % block == 0 else FALLBACK[name]
            if use in stored or (use != name and use in types):
                print(f"{size}: {name} falls back to {use}, timed as the {use} row", flush=True)
                continue
            stored.append(use)
            out.append({"size": size, "H": H, "I": I, "asked": name, "type": use,
                        "label": name if use == name else f"{use} (for {name})"})
    return out


def write_bytes(cell: dict, folder: Path) -> Path:
    """The expert's quantized bytes (random valid blocks), once per cell for every process."""
    path = folder / f"{cell['size']}_{cell['type']}.npz"
    if not path.exists():
        rng, H, I = np.random.default_rng(0), cell["H"], cell["I"]
        shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        np.savez(path, **{k: random_blocks(cell["type"], r, c, rng).reshape(1, -1) for k, (r, c) in shapes.items()})
    return path


def inputs(H: int, tokens: int) -> torch.Tensor:
    """The same activations in every process."""
    return torch.from_numpy(np.random.default_rng(1).standard_normal((tokens, H), dtype=np.float32))


class Expert:
    """One expert's weights in every form a way needs, each made once (not timed)."""

    def __init__(self, cell: dict, path: Path, torch_ways: bool, int4_group: int,
                 packed_dtype: torch.dtype = torch.bfloat16) -> None:
        H, I = cell["H"], cell["I"]
        self.fmt, self.H = quant_format(cell["type"]), H
        self.shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        with np.load(path) as z:
            self.q = {k: torch.from_numpy(z[k].copy()) for k in self.shapes}                  # [1, bytes]
        # ggml reads copies in turn, as many as fill ROTATE_BYTES: else a process timing only
        # ggml finds a small expert (2.6 MB of Q4_K) still in cache from the last call, while
        # the interleaved ways of table 1 read theirs from memory
        self.copies = max(2, -(-ROTATE_BYTES // sum(q.numel() for q in self.q.values())))
        self.qn = {k: q.expand(self.copies, -1).contiguous() for k, q in self.q.items()}     # [copies, bytes]
        self.spec = {k: ggml.Weight(self.fmt.ggml_type, *self.shapes[k], self.copies, self.q[k].shape[1])
                     for k in self.shapes}
        if not torch_ways:
            return
        self.f = {k: self.dequant(k) for k in self.shapes}                                     # [rows, cols]
        # the packed kernels' fast paths want bfloat16 activations and scales: with float32
        # (or float16) both fall to a generic loop, 4-40x slower on this CPU (--packed-dtype,
        # results/cpu_kernels_packed_float32.json)
        self.packed_dtype = packed_dtype
        scale = {k: w.abs().amax(1) / 127 for k, w in self.f.items()}
        self.int8 = {k: (w / scale[k][:, None]).round().to(torch.int8) for k, w in self.f.items()}
        self.int8_scale = {k: s.to(packed_dtype) for k, s in scale.items()}
        self.int4, self.int4_sz = {}, {}
        for k, w in self.f.items():
            packed, sz = int4_pack(w, int4_group)
            self.int4[k], self.int4_sz[k] = packed, sz.to(packed_dtype)

    def dequant(self, k: str) -> torch.Tensor:
        return dequantize(self.q[k], self.fmt, (1, *self.shapes[k]), torch.float32)[0]


def int4_pack(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scales and zeros [cols/group, rows, 2]) for ``_weight_int4pack_mm_for_cpu``:
    asymmetric 4-bit per group along the input, as torch's own tests quantize (test_linalg.py,
    _group_quantize_tensor): w ~ (q - 8) * scale + zero with q in 0..15."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    lo, hi = g.amin(2, keepdim=True), g.amax(2, keepdim=True)
    scale = (hi - lo).clamp(min=1e-6) / 15
    q = ((g - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(rows, cols)
    zero = lo + scale * 8
    sz = torch.stack([scale[..., 0], zero[..., 0]], 2).transpose(0, 1).contiguous()          # [cols/group, rows, 2]
    # inner_k_tiles is a CUDA layout knob; the CPU packing ignores it
    return torch._convert_weight_to_int4pack_for_cpu(q, 1), sz


def ggml_way(e: Expert, tokens: int):
    """The expert through ggml: [gate, up] sharing x in one graph, down in a second."""
    first = ggml.MatmulId([e.spec["gate"], e.spec["up"]], tokens, 1)
    down = ggml.MatmulId([e.spec["down"]], tokens, 1, 1, True)
    # every token to one copy (the expert), the next call to the next copy
    ids = [torch.full((tokens, 1), j, dtype=torch.int32) for j in range(e.copies)]            # [T, 1] each
    turn = iter(range(1 << 62))
    I = e.shapes["gate"][0]
    gate, up, out = torch.empty(tokens, I), torch.empty(tokens, I), torch.empty(tokens, e.H)

    def run(x: torch.Tensor) -> torch.Tensor:
        j = ids[next(turn) % e.copies].data_ptr()
        first([e.qn["gate"].data_ptr(), e.qn["up"].data_ptr()], x.data_ptr(), j, [gate.data_ptr(), up.data_ptr()])
        act = (torch.nn.functional.silu(gate) * up).contiguous()                               # [T, I]
        down([e.qn["down"].data_ptr()], act.data_ptr(), j, [out.data_ptr()])
        return out
    return run


def mlp(lin, x: torch.Tensor) -> torch.Tensor:
    g, u = lin("gate", x), lin("up", x)
    return lin("down", (torch.nn.functional.silu(g) * u).contiguous())


def ways(e: Expert, tokens: int, int4_group: int) -> dict:
    """name -> fn(x) -> [T, H]: every way of computing the expert, weights prepared once. The
    packed ways take activations (and scales) in ``e.packed_dtype``, float32 out."""
    dt = e.packed_dtype
    return {
        GGML_WAY: ggml_way(e, tokens),
        "torch dequantize + matmul": lambda x: mlp(lambda k, a: a @ e.dequant(k).T, x),
        "torch float32, dequantized once": lambda x: mlp(lambda k, a: a @ e.f[k].T, x),
        "torch _weight_int8pack_mm, repacked once": lambda x: mlp(
            lambda k, a: torch._weight_int8pack_mm(a.to(dt), e.int8[k], e.int8_scale[k]).float(), x),
        "torch _weight_int4pack_mm_for_cpu, repacked once": lambda x: mlp(
            lambda k, a: torch._weight_int4pack_mm_for_cpu(a.to(dt), e.int4[k], int4_group, e.int4_sz[k]).float(), x),
    }


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).abs().max() / ref.abs().max())


def time_interleaved(fns: dict, x: torch.Tensor, repeats: int) -> dict:
    """name -> median seconds, the ways taking turns call by call (drift hits each alike)."""
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn(x)
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def torch_table(todo: list[dict], folder: Path, repeats: int, int4_group: int,
                packed_dtype: torch.dtype) -> list[dict]:
    """Table 1: every way in this process (libggml-python's ggml)."""
    rows = []
    for cell in todo:
        e = Expert(cell, write_bytes(cell, folder), True, int4_group, packed_dtype)
        for tokens in TOKENS:
            fns, x = ways(e, tokens, int4_group), inputs(cell["H"], tokens)
            ref = fns["torch float32, dequantized once"](x).clone()
            err = {}
            for k, fn in fns.items():
                try:
                    err[k] = rel_err(fn(x), ref)
                except RuntimeError as exc:  # a torch op this CPU build lacks: say so, time the rest
                    err[k] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            ok = {k: fn for k, fn in fns.items() if not isinstance(err[k], str)}
            ms = {k: s * 1e3 for k, s in time_interleaved(ok, x, repeats).items()}
            rows.append({**cell, "tokens": tokens, "ggml_copies": e.copies, "ms": ms, "rel_err_vs_float32": err,
                         "load_1min": os.getloadavg()[0]})
            print(f"{cell['size']:14} {cell['label']:16} {tokens} tok  "
                  + "  ".join(f"{k}: {v:.3f}" for k, v in ms.items()), flush=True)
    return rows


def child(todo: list[dict], folder: Path, repeats: int, verify: str | None) -> dict:
    """In a process whose ``$EXPERTCACHE_GGML_LIB`` picks the build: the ggml way per cell and
    token count (outputs saved to ``verify`` instead, when given)."""
    ok, lib = ggml.available()
    if not ok:
        raise SystemExit(f"ggml unavailable: {lib}")
    ms, outs = {}, {}
    for cell in todo:
        e = Expert(cell, folder / f"{cell['size']}_{cell['type']}.npz", False, 0)
        for tokens in TOKENS:
            key = f"{cell['size']}/{cell['type']}/{tokens}"
            run, x = ggml_way(e, tokens), inputs(cell["H"], tokens)
            if verify:
                outs[key] = run(x).numpy().copy()
            else:
                ms[key] = time_interleaved({"ggml": run}, x, repeats)["ggml"] * 1e3
    if verify:
        np.savez(verify, **{k.replace("/", "__"): v for k, v in outs.items()})
    return {"lib": lib, "ms": ms}


def spawn(where: str | None, args: list[str]) -> dict:
    """Run this script's child with ``$EXPERTCACHE_GGML_LIB`` = where (None: libggml-python);
    ``where`` may go on with ``,VAR=VALUE`` settings for that process (a ggml switch)."""
    env = {k: v for k, v in os.environ.items() if k != ggml.LIB_ENV}
    if where:
        folder, *settings = where.split(",")
        env[ggml.LIB_ENV] = folder
        env.update(s.split("=", 1) for s in settings)
    proc = subprocess.run([sys.executable, __file__, "--child", *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit status {proc.returncode}: {' | '.join(tail)}"}
    return json.loads(proc.stdout.splitlines()[-1])


def lib_table(todo: list[dict], folder: Path, libs: dict, repeats: int, rounds: int, base: list[str]) -> dict:
    """Table 2: the ggml way per build, each in its own process; checked against
    libggml-python's outputs, then timed in alternating rounds."""
    result = {name: {"folder": where, "rounds": []} for name, where in libs.items()}
    ref = None
    for name, where in libs.items():  # libggml-python first: the reference
        path = folder / f"verify_{name}.npz"
        got = spawn(where, [*base, "--verify", str(path)])
        if "error" in got:
            result[name]["skipped"] = f"did not run: {got['error']}"
            continue
        result[name]["lib"] = got["lib"]
        with np.load(path) as z:
            outs = {k: z[k] for k in z.files}
        if ref is None:
            ref = outs
            continue
        diff = max(float(np.abs(outs[k] - ref[k]).max() / np.abs(ref[k]).max()) for k in ref)
        result[name]["max_rel_diff_vs_libggml_python"] = diff
        if diff > SAME_TOL:
            result[name]["skipped"] = f"outputs differ from libggml-python's by {diff:.3g} (> {SAME_TOL})"
    timed = [n for n in libs if "skipped" not in result[n]]
    for r in range(rounds):
        for name in timed:
            got = spawn(libs[name], [*base, "--repeats", str(repeats)])
            result[name]["rounds"].append({**got, "load_1min": os.getloadavg()[0]})
            print(f"round {r + 1} {name}: {got.get('error') or 'done'}", flush=True)
    for name in timed:
        ok = [r["ms"] for r in result[name]["rounds"] if "ms" in r]
        result[name]["ms"] = {k: statistics.median(r[k] for r in ok) for k in ok[0]} if ok else {}
    return result


def markdown(rows: list[dict], libs: dict | None, labels: dict) -> str:
    """The tables as docs/cpu.md shows them (ms per expert)."""
    names = list(rows[0]["ms"]) if rows else []
    lines = ["| size | type | tokens | " + " | ".join(names) + " |", "|---" * (3 + len(names)) + "|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['label']} | {r['tokens']} | "
                     + " | ".join(f"{r['ms'][n]:.2f}" if n in r["ms"] else "failed" for n in names) + " |")
    if libs:
        timed = [n for n in libs if libs[n].get("ms")]
        lines += ["", "| size | type | tokens | " + " | ".join(timed) + " |", "|---" * (3 + len(timed)) + "|"]
        base = timed[0]
        for key in libs[base]["ms"]:
            size, typ, tokens = key.split("/")
            ref = libs[base]["ms"][key]
            cells_ = [f"{libs[n]['ms'][key]:.2f}" + ("" if n == base else f" ({libs[n]['ms'][key] / ref:.2f}x)")
                      for n in timed]
            lines.append(f"| {size} | {labels[size, typ]} | {tokens} | " + " | ".join(cells_) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the ggml builds")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"any of {', '.join(SIZES)}")
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--int4-group", type=int, default=32, help="32 (ggml's block), 64, 128 or 256")
    p.add_argument("--packed-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="activations and scales of the int8/int4 packed ways")
    p.add_argument("--lib", action="append", default=[], metavar="NAME=FOLDER[,VAR=VALUE...]",
                   help="another ggml build (libggml-base.so, libggml-cpu.so) to time, with settings "
                        "for its process if any; repeatable")
    p.add_argument("--no-torch", action="store_true", help="only the ggml builds")
    p.add_argument("--json", help="write every figure here (e.g. benchmarks/results/cpu_kernels.json)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--verify", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    todo = cells(args.sizes.split(","), args.types.split(","))
    if args.child:
        print(json.dumps(child(todo, Path(args.data), args.repeats, args.verify)))
        return 0
    load = [os.getloadavg()]
    ok, lib = ggml.available()
    print(f"ms per expert (gate+up+down), one thread, median of {args.repeats}; ggml: {lib}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for cell in todo:  # bytes once, read by every process
            write_bytes(cell, folder)
        rows = [] if args.no_torch else torch_table(todo, folder, args.repeats, args.int4_group,
                                                        getattr(torch, args.packed_dtype))
        libs = None
        if args.lib:
            extra = dict(s.split("=", 1) for s in args.lib)
            base = ["--data", tmp, "--sizes", args.sizes, "--types", args.types]
            libs = lib_table(todo, folder, {"libggml-python": None, **extra}, args.repeats, args.rounds, base)
    load.append(os.getloadavg())
    table = markdown(rows, libs, {(c["size"], c["type"]): c["label"] for c in todo})
    print(table)
    if args.json:
        out = {"sizes": {s: SIZES[s] for s in args.sizes.split(",")}, "threads": 1, "repeats": args.repeats,
               "rounds": args.rounds, "int4_group": args.int4_group,
               "packed_dtype": args.packed_dtype, "torch": torch.__version__,
               "cpu": platform.processor() or platform.machine(), "loadavg_before_after": load,
               "ways": rows, "libs": libs, "markdown": table}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
