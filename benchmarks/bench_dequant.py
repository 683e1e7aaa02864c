"""Dequantization speed per GGUF type: expertcache's torch code vs gguf-py's numpy reference.

One Qwen3-30B-A3B expert matrix per shape ([768, 2048] gate/up and [2048, 768] down), valid
random blocks (tests/quant_fixtures.py), best of --repeat runs by this process's CPU time (fair
on a shared machine), in M elements/s. torch runs with --threads intra-op threads; numpy is
single-threaded here.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_dequant.py [--threads 1] [--repeat 5]
        [--types Q4_K,MXFP4] [--json benchmarks/results/dequant_cpu.json]

Recorded run (benchmarks/results/dequant_cpu.json): `--threads 1`, AMD EPYC, 2 cores shared with
other jobs (load ~3), torch 2.13.0+cpu, numpy 2.4.6. Consecutive runs on that machine differ by up
to 2x for a row, so read the table as ratios of magnitude, not to a digit. "view": the output is
the input bytes reinterpreted, nothing is computed. The GPU is where this code is meant to run;
on one CPU thread it is 1.5-3.5x numpy for the legacy and K types and about numpy's speed for the
grid IQ types (IQ2_*, IQ3_*: a gather per 8 values).

    M elements/s (best of 5, CPU time); KiB = quantized bytes of the matrix
    type          shape    KiB  torch f32 torch bf16   gguf-py f32/gguf
    -------------------------------------------------------------------
    F32        768x2048   6144       view       4398   1217387        -
    F32        2048x768   6144       view       7123   1180829        -
    F16        768x2048   3072      13663       1368       735    18.6x
    F16        2048x768   3072      10674        840       484    22.1x
    BF16       768x2048   3072       6810       view      1160     5.9x
    BF16       2048x768   3072       6964       view       735     9.5x
    Q4_0       768x2048    864        496        434       340     1.5x
    Q4_0       2048x768    864        471        449       256     1.8x
    Q4_1       768x2048    960        516        460       307     1.7x
    Q4_1       2048x768    960        496        480       258     1.9x
    Q5_0       768x2048   1056        362        278       258     1.4x
    Q5_0       2048x768   1056        313        286       152     2.1x
    Q5_1       768x2048   1152        263        263       184     1.4x
    Q5_1       2048x768   1152        277        264       154     1.8x
    Q8_0       768x2048   1632       2440       1822       755     3.2x
    Q8_0       2048x768   1632       2328       1703       726     3.2x
    Q2_K       768x2048    504        528        474       289     1.8x
    Q2_K       2048x768    504        553        490       283     2.0x
    Q3_K       768x2048    660        340        342       193     1.8x
    Q3_K       2048x768    660        358        337       127     2.8x
    Q4_K       768x2048    864        545        493       230     2.4x
    Q4_K       2048x768    864        458        392       130     3.5x
    Q5_K       768x2048   1056        318        319       172     1.8x
    Q5_K       2048x768   1056        305        306        99     3.1x
    Q6_K       768x2048   1260        466        420       243     1.9x
    Q6_K       2048x768   1260        500        423       171     2.9x
    IQ1_S      768x2048    300        300        289        99     3.0x
    IQ1_S      2048x768    300        302        289        78     3.9x
    IQ1_M      768x2048    336        232        226        75     3.1x
    IQ1_M      2048x768    336        301        307        86     3.5x
    IQ2_XXS    768x2048    396         48         54        86     0.6x
    IQ2_XXS    2048x768    396         64         68        74     0.9x
    IQ2_XS     768x2048    444         64         65        84     0.8x
    IQ2_XS     2048x768    444         47         51        59     0.8x
    IQ2_S      768x2048    492         65         66        86     0.8x
    IQ2_S      2048x768    492         59         66        71     0.8x
    IQ3_XXS    768x2048    588         59         63        79     0.7x
    IQ3_XXS    2048x768    588         64         62        66     1.0x
    IQ3_S      768x2048    660         60         63        79     0.8x
    IQ3_S      2048x768    660         49         62        71     0.7x
    IQ4_NL     768x2048    864        331        320       178     1.9x
    IQ4_NL     2048x768    864        327        322       164     2.0x
    IQ4_XS     768x2048    816        287        276       159     1.8x
    IQ4_XS     2048x768    816        282        286       124     2.3x
    MXFP4      768x2048    816        395        371       179     2.2x
    MXFP4      2048x768    816        391        377       155     2.5x
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from quant_fixtures import random_blocks  # noqa: E402

from expertcache.quant.dequant import dequantize  # noqa: E402
from expertcache.quant.formats import SUPPORTED, quant_format  # noqa: E402

SHAPES = ((768, 2048), (2048, 768))  # Qwen3-30B-A3B: [I, H] gate/up, [H, I] down


def best_cpu_seconds(fn, repeat: int) -> float:
    """Fastest of `repeat` calls, in CPU seconds of this process (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return max(best, 1e-9)


def measure(name: str, shape: tuple[int, int], repeat: int, rng: np.random.Generator) -> dict:
    """M elements/s for one type and matrix shape, each way."""
    fmt = quant_format(name)
    blocks = random_blocks(fmt, *shape, rng, quantize_floats=False)
    data = torch.from_numpy(blocks)
    qtype = GGMLQuantizationType(fmt.ggml_type)
    elements = shape[0] * shape[1]
    seconds = {
        "torch_f32": best_cpu_seconds(lambda: dequantize(data, fmt, shape), repeat),
        "torch_bf16": best_cpu_seconds(lambda: dequantize(data, fmt, shape, torch.bfloat16), repeat),
        "gguf_numpy": best_cpu_seconds(lambda: gguf_dequantize(blocks, qtype), repeat),
    }
    row = {"type": name, "shape": list(shape), "bytes": fmt.nbytes(shape),
           # F32 -> f32 and BF16 -> bf16 return a view of the bytes: no work to time
           "torch_f32_view": _is_view(data, dequantize(data, fmt, shape)),
           "torch_bf16_view": _is_view(data, dequantize(data, fmt, shape, torch.bfloat16))}
    row.update({f"{k}_melem_s": elements / s / 1e6 for k, s in seconds.items()})
    return row


def _is_view(data: torch.Tensor, out: torch.Tensor) -> bool:
    return out.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()


def _cell(row: dict, way: str) -> str:
    return "view" if row.get(f"{way}_view") else f"{row[f'{way}_melem_s']:.0f}"


def table(rows: list[dict]) -> str:
    head = f"{'type':<8} {'shape':>10} {'KiB':>6} {'torch f32':>10} {'torch bf16':>10} " \
           f"{'gguf-py':>9} {'f32/gguf':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = r["torch_f32_melem_s"] / r["gguf_numpy_melem_s"]
        ratio_cell = "-" if r["torch_f32_view"] or r["type"] == "F32" else f"{ratio:.1f}x"
        lines.append(f"{r['type']:<8} {'x'.join(map(str, r['shape'])):>10} {r['bytes'] // 1024:>6} "
                     f"{_cell(r, 'torch_f32'):>10} {_cell(r, 'torch_bf16'):>10} "
                     f"{r['gguf_numpy_melem_s']:>9.0f} {ratio_cell:>8}")
    return "\n".join(lines)


def _cpu_model() -> str:
    """The CPU's model name on Linux (platform.processor() is often empty there)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.machine())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per case (best kept)")
    parser.add_argument("--types", default=",".join(SUPPORTED), help="comma-separated ggml types")
    parser.add_argument("--json", type=Path, help="save results and the machine here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    names = [quant_format(t).name for t in args.types.split(",") if t]
    rows = [measure(name, shape, args.repeat, rng) for name in names for shape in SHAPES]
    print("M elements/s (best of %d, CPU time); KiB = quantized bytes of the matrix" % args.repeat)
    print(table(rows))
    if args.json:
        machine = {"processor": platform.processor() or platform.machine(), "cpu": _cpu_model(),
                   "cores": os.cpu_count(),
                   "platform": platform.platform(), "torch": torch.__version__,
                   "numpy": np.__version__, "threads": args.threads}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine, "repeat": args.repeat,
                                         "results": rows}, indent=1) + "\n")
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()
