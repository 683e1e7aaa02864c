"""Hardware profiles for the cost model: presets, JSON files, and a probe of this machine.

Preset figures are spec-sheet or published numbers, not measurements here; the
sources are in docs/cost-model.md. ``probe()`` measures what it can (numpy on
the CPU; torch, imported only inside it, for pinned H2D copies when CUDA is
present) and takes the rest from a base preset, listing which fields it measured.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import numpy as np

from .model import Hardware

PRESETS: dict[str, Hardware] = {h.name: h for h in (
    # RTX 3090-class: PCIe 4.0 x16 pinned ~25 GB/s (CONTEXT.md 2), 936 GB/s GDDR6X;
    # desktop dual-channel DDR4-3200 (51 GB/s peak), 8-core AVX2 CPU.
    Hardware("pcie4-consumer", h2d_gbps=25, gpu_mem_gbps=936, cpu_mem_gbps=45,
             cpu_gflops=800, source="PCIe 4.0 x16 pinned (CONTEXT.md 2); RTX 3090 spec; DDR4-3200 x2"),
    # RTX 5090-class: PCIe 5.0 x16 pinned ~50 GB/s (CONTEXT.md 2), 1792 GB/s GDDR7;
    # desktop dual-channel DDR5-5600 (90 GB/s peak), 16-core AVX-512 CPU.
    Hardware("pcie5-consumer", h2d_gbps=50, gpu_mem_gbps=1792, cpu_mem_gbps=80,
             cpu_gflops=1500, source="PCIe 5.0 x16 pinned (CONTEXT.md 2); RTX 5090 spec; DDR5-5600 x2"),
    # H200 (NVL, PCIe 5.0 x16 host link ~50 GB/s), 4.8 TB/s HBM3e; server with
    # 12-channel DDR5-4800 (460 GB/s peak, ~300 sustained), 64+ cores.
    Hardware("h200", h2d_gbps=50, gpu_mem_gbps=4800, cpu_mem_gbps=300, cpu_gflops=5000,
             source="PCIe 5.0 x16 pinned (CONTEXT.md 2); NVIDIA H200 spec 4.8 TB/s; 12ch DDR5-4800"),
)}
DEFAULT = "pcie4-consumer"


def load_hardware(name_or_path: str | Path) -> Hardware:
    """A preset by name, or a profile JSON written by ``expertcache probe``."""
    key = str(name_or_path)
    if key in PRESETS:
        return PRESETS[key]
    path = Path(key)
    if not path.suffix and not path.exists():
        raise ValueError(f"unknown hardware {key!r}; use a preset ({', '.join(PRESETS)}) "
                         "or a profile JSON from 'expertcache probe -o FILE'")
    if not path.exists():
        raise FileNotFoundError(f"hardware profile not found: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not a JSON hardware profile: {err}") from None
    known = {f.name for f in fields(Hardware)}
    if not isinstance(data, dict) or not {"h2d_gbps", "gpu_mem_gbps"} <= set(data):
        raise ValueError(f"{path}: a hardware profile needs at least h2d_gbps, gpu_mem_gbps, "
                         f"cpu_mem_gbps, cpu_gflops (write one with 'expertcache probe -o FILE')")
    args = {k: v for k, v in data.items() if k in known}
    args.setdefault("name", path.stem)
    try:
        return Hardware(**args)
    except TypeError as err:
        raise ValueError(f"{path}: incomplete hardware profile ({err})") from None


def save_profile(hw: Hardware, path: str | Path, extra: dict | None = None) -> Path:
    path = Path(path)
    path.write_text(json.dumps({**asdict(hw), **(extra or {})}, indent=2) + "\n")
    return path


# -- probe ------------------------------------------------------------------------
def probe(base: str = DEFAULT, seconds: float = 0.5) -> tuple[Hardware, dict]:
    """Measure this machine; returns the profile and a report of what was measured.

    CPU figures come from numpy; GPU figures (pinned H2D, device memory) only
    when torch sees CUDA, else they stay at the ``base`` preset's values.
    """
    ref = load_hardware(base)
    measured = {"cpu_gflops": cpu_gflops(seconds), "cpu_mem_gbps": cpu_mem_gbps(seconds)}
    measured.update(ggml_rate(seconds))
    measured.update(gpu_rates(seconds))
    values = {**asdict(ref), **measured, "name": "probed",
              "source": f"expertcache probe; unmeasured fields from preset {ref.name}"}
    return Hardware(**values), {"measured": sorted(measured), "base": ref.name}


@functools.lru_cache(maxsize=1)
def measured_here(seconds: float = 0.05) -> Hardware:
    """This machine's rates from a short probe (about half a second), once per process: what
    ``miss='auto'`` weighs fetching against CPU compute with when no profile is given."""
    hw, report = probe(seconds=seconds)
    return replace(hw, name="measured at load",
                   source=f"expertcache probe at load ({seconds} s a rate; measured {', '.join(report['measured'])})")


def cpu_gflops(seconds: float = 0.5, n: int = 1024) -> float:
    """float32 matmul rate of numpy's BLAS (2 n^3 FLOPs per product)."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    return 2 * n ** 3 / _best_time(lambda: a @ a, seconds) / 1e9


def ggml_rate(seconds: float = 0.5, rows: int = 2048, cols: int = 2048, tokens: int = 8) -> dict[str, float]:
    """``{"cpu_quant_gflops": ...}``: ggml's Q8_0 matmul on ``tokens`` rows (what a CPU miss of
    several tokens runs with ``cpu_kernel='ggml'``), on every core as the numpy figures;
    {} without ggml (``pip install 'expertcache[ggml]'``)."""
    import os

    from ..quant import ggml
    from ..quant.formats import quant_format

    if not ggml.available()[0]:
        return {}
    # Q8_0 blocks of 32 weights: a float16 scale, then 32 int8 (34 bytes); any values will do
    rng = np.random.default_rng(0)
    blocks = np.empty((rows * cols // 32, 34), dtype=np.uint8)
    blocks[:, :2] = np.full(len(blocks), 0.01, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = rng.integers(-127, 128, (len(blocks), 32), dtype=np.int8).view(np.uint8)
    x = rng.standard_normal((tokens, cols), dtype=np.float32)
    out = np.empty((tokens, rows), dtype=np.float32)
    weight = ggml.Weight(quant_format("Q8_0").ggml_type, rows, cols, 1, blocks.nbytes)
    graph = ggml.Matmul(weight, tokens, os.cpu_count() or 1)
    seconds_per = _best_time(lambda: graph(blocks.ctypes.data, x.ctypes.data, out.ctypes.data), seconds)
    return {"cpu_quant_gflops": 2 * rows * cols * tokens / seconds_per / 1e9}


def cpu_mem_gbps(seconds: float = 0.5, mib: int = 256) -> float:
    """Host memory bandwidth from a large copy (bytes read + bytes written)."""
    src = np.ones(mib * 2 ** 20 // 8)
    dst = np.empty_like(src)
    return 2 * src.nbytes / _best_time(lambda: np.copyto(dst, src), seconds) / 1e9


def gpu_rates(seconds: float = 0.5, mib: int = 256) -> dict[str, float]:
    """Pinned H2D and device-to-device GB/s via torch; {} without torch or CUDA."""
    if not _gpu_driver_present():  # skip a multi-second torch import on CPU-only machines
        return {}
    try:
        import torch  # lazily: sim/ never imports torch at module level
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    n = mib * 2 ** 20
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)

    def timed(fn):
        def run():
            fn()
            torch.cuda.synchronize()
        return _best_time(run, seconds)
    h2d = n / timed(lambda: dev.copy_(host, non_blocking=True)) / 1e9
    d2d = 2 * n / timed(lambda: dev2.copy_(dev)) / 1e9
    return {"h2d_gbps": h2d, "gpu_mem_gbps": d2d}


def local_device() -> str:
    """'cuda' or 'cpu': where a run on this machine goes by default (``offload`` takes CUDA when
    torch sees it), judged without importing torch: a GPU driver on Linux."""
    return "cuda" if sys.platform.startswith("linux") and _gpu_driver_present() else "cpu"


def _gpu_driver_present() -> bool:
    """On Linux a CUDA (or ROCm) device needs its kernel driver; elsewhere ask torch."""
    if not sys.platform.startswith("linux"):
        return True
    return Path("/proc/driver/nvidia/version").exists() or Path("/dev/kfd").exists()


def _best_time(fn, seconds: float) -> float:
    """Fastest of repeated runs within about ``seconds`` (after one warm-up)."""
    fn()
    best, end = float("inf"), time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() > end:
            return best
