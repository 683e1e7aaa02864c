"""Dequantization speed per GGUF type: expertcache's torch code vs gguf-py's numpy reference.

One Qwen3-30B-A3B expert matrix per shape ([768, 2048] gate/up and [2048, 768] down), valid
random blocks (tests/quant_fixtures.py), best of --repeat runs by this process's CPU time (fair
on a shared machine), in M elements/s. torch runs with --threads intra-op threads; numpy is
single-threaded here.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_dequant.py [--threads 1] [--repeat 5]
        [--types Q4_K,MXFP4] [--json benchmarks/results/dequant_cpu.json]

Recorded run (benchmarks/results/dequant_cpu.json): `--threads 1`, AMD EPYC, 2 cores shared with
other jobs (load 2.4-2.7), torch 2.13.0+cpu, numpy 2.4.6. Consecutive runs on that machine differ
by up to 2x for a row, so read magnitudes, not digits. "view": the output is the input bytes
reinterpreted, nothing is computed. This code is meant for the GPU; on one CPU thread it is
1.5-4x numpy for the legacy, K, IQ4, IQ1 and MXFP4 types, and no faster than numpy for the grid
types IQ2_* and IQ3_* (transformers' code: a gather of 8-value grid rows plus sign tables).
One Qwen3-30B-A3B Q4_K expert (three such matrices) takes ~9 ms here on one thread.

    M elements/s (best of 5, CPU time); KiB = quantized bytes of the matrix
    type          shape    KiB  torch f32 torch bf16   gguf-py f32/gguf
    -------------------------------------------------------------------
    F32        768x2048   6144       view       3141   1075830        -
    F32        2048x768   6144       view       7403   1097602        -
    F16        768x2048   3072      11603       1396       515    22.5x
    F16        2048x768   3072      10807       1185       644    16.8x
    BF16       768x2048   3072      13513       view      1457     9.3x
    BF16       2048x768   3072      14226       view      1562     9.1x
    Q4_0       768x2048    864        749        594       462     1.6x
    Q4_0       2048x768    864       1290       1183       297     4.3x
    Q4_1       768x2048    960        781        852       310     2.5x
    Q4_1       2048x768    960        668        960       217     3.1x
    Q5_0       768x2048   1056        393        294       356     1.1x
    Q5_0       2048x768   1056        520        358       217     2.4x
    Q5_1       768x2048   1152        442        297       289     1.5x
    Q5_1       2048x768   1152        289        271       158     1.8x
    Q8_0       768x2048   1632       2414       2021       769     3.1x
    Q8_0       2048x768   1632       3924       2089       678     5.8x
    Q2_K       768x2048    504        834        758       450     1.9x
    Q2_K       2048x768    504        542        714       197     2.7x
    Q3_K       768x2048    660        484        452       303     1.6x
    Q3_K       2048x768    660        332        324       123     2.7x
    Q4_K       768x2048    864        517        462       261     2.0x
    Q4_K       2048x768    864        522        422       134     3.9x
    Q5_K       768x2048   1056        353        335       191     1.8x
    Q5_K       2048x768   1056        313        296       109     2.9x
    Q6_K       768x2048   1260        435        638       257     1.7x
    Q6_K       2048x768   1260        643        666       252     2.5x
    IQ1_S      768x2048    300        348        376       131     2.7x
    IQ1_S      2048x768    300        415        442        89     4.7x
    IQ1_M      768x2048    336        327        279       112     2.9x
    IQ1_M      2048x768    336        258        310       103     2.5x
    IQ2_XXS    768x2048    396         69         67        58     1.2x
    IQ2_XXS    2048x768    396         53         56        60     0.9x
    IQ2_XS     768x2048    444         62         64        77     0.8x
    IQ2_XS     2048x768    444         63         54        67     0.9x
    IQ2_S      768x2048    492         57         51        75     0.8x
    IQ2_S      2048x768    492         44         48        64     0.7x
    IQ3_XXS    768x2048    588         46         57        53     0.9x
    IQ3_XXS    2048x768    588         47         51        57     0.8x
    IQ3_S      768x2048    660         47         45        58     0.8x
    IQ3_S      2048x768    660         51         48        60     0.8x
    IQ4_NL     768x2048    864        396        338       163     2.4x
    IQ4_NL     2048x768    864        377        299       167     2.3x
    IQ4_XS     768x2048    816        299        192       121     2.5x
    IQ4_XS     2048x768    816        286        288        81     3.6x
    MXFP4      768x2048    816        325        369       135     2.4x
    MXFP4      2048x768    816        388        219       149     2.6x
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
    bf16 = torch.bfloat16
    seconds = {
        "torch_f32": best_cpu_seconds(lambda: dequantize(data, fmt, shape), repeat),
        "torch_bf16": best_cpu_seconds(lambda: dequantize(data, fmt, shape, bf16), repeat),
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
