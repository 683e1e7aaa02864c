"""``run_strategies``: every strategy on one workload, on one device, plus the cost model's view.

The host experts are built once and shared; each strategy gets its own runtime cache
(slot pool), runs every token of the trace and is freed before the next, so peak
memory is the host experts plus the largest pool. ``resident`` needs a pool of every
expert: where the device cannot hold it, it is skipped with the reason.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..presets import ModelShape
from ..costmodel import Hardware
from ..sim.replay import Prepared
from ..trace.format import Trace
from .live import Inputs, Run, build_cache, pick_clock, run_strategy
from .model import BenchShape, experts_module, host_experts
from .strategies import Strategy


@dataclass
class BenchResult:
    shape: BenchShape
    trace: Trace
    device: torch.device
    runs: list[Run]
    hardware: Hardware | None
    partition: str
    notes: list[str] = field(default_factory=list)
    clock: str = "wall"
    staging: Hardware | None = None   # copy-every-pass's profile (copies into hot staging slots)
    threads: int | None = None        # torch CPU threads the run used


def resolve_device(name: str = "auto") -> torch.device:
    """``--device``: auto (CUDA when torch sees it), cpu, cuda or cuda:N, as ``offload()`` resolves it."""
    from ..runtime.device import resolve_device as offload_device

    try:
        return offload_device(None if name == "auto" else name)
    except ValueError as err:
        raise ValueError(f"--device: {err} (or auto)") from None


def run_strategies(trace: Trace, model: ModelShape, strategies: list[Strategy], *, scale: float = 1.0,
                   dtype: str = "bf16", device: str = "auto", partition: str = "global",
                   hardware: Hardware | str | None = "calibrate", seed: int = 0,
                   threads: int | None = None, clock: str = "auto",
                   progress: Callable[[str], None] = lambda _msg: None) -> BenchResult:
    """Run ``strategies`` on ``trace`` with ``model``'s expert dims times ``scale``.

    ``threads`` sets torch's CPU threads for the run only (restored afterwards)."""
    dev = resolve_device(device)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"--threads must be a whole number >= 1, got {threads!r}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        result = _run(trace, model, strategies, scale, dtype, dev, partition, hardware, seed, clock,
                      progress)
    finally:
        torch.set_num_threads(before)
    return result


def _run(trace, model, strategies, scale, dtype, dev, partition, hardware, seed, clock,
         progress) -> BenchResult:
    threads = torch.get_num_threads()
    shape = BenchShape.from_preset(model, trace.num_layers, scale, dtype)
    clock_name, clock_fn = pick_clock(clock, dev)
    _check_host_memory(shape)
    progress(f"building {shape.layers} x {shape.experts} experts of {shape.expert_bytes / 2**20:.2f} MiB "
             f"({shape.host_bytes / 2**30:.2f} GiB host) ...")
    module = experts_module(shape).to(dev)
    hosts = host_experts(shape, seed=seed, pin=dev.type == "cuda")
    inputs = Inputs(trace, shape.hidden, shape.torch_dtype, dev, seed)
    # belady's future, in the order the bench steps (one token at a time, recorded traces too);
    # a fresh Future per run (it is consumed as it replays)
    prepared = Prepared(trace, "token")
    hw, staging = _hardware(hardware, module, hosts, dev, trace.top_k, progress, clock_fn)
    runs, notes = [], []
    for strategy in strategies:
        progress(f"running {strategy.title} ...")
        try:
            cache = build_cache(strategy, hosts, trace.top_k, dev, partition,
                                prepared.future() if strategy.kind == "belady" else None)
        except ValueError as err:  # e.g. resident needs more memory than the device has
            runs.append(Run(strategy, [], *_empty(), torch.empty(0), skipped=str(err)))
            notes.append(f"{strategy.title} skipped: {err}")
            continue
        runs.append(run_strategy(cache, strategy, module, inputs, clock_fn))
        del cache
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return BenchResult(shape, trace, dev, runs, hw, partition, notes, clock_name, staging, threads)


def _hardware(hardware, module, hosts, dev, top_k, progress, clock):
    """(profile, copy-every-pass profile): calibrated here, or one given profile for both."""
    if hardware is None or isinstance(hardware, Hardware):
        return hardware, hardware
    if hardware == "calibrate":
        from .calibrate import calibrate
        progress("calibrating the cost model on this device ...")
        return calibrate(module, hosts, dev, top_k, clock=clock)
    from ..costmodel.hardware import load_hardware
    hw = load_hardware(hardware)
    return hw, hw


def _empty():
    from ..stats import Counts
    return Counts(), Counts(), 0, 0


def _check_host_memory(shape: BenchShape) -> None:
    from ..runtime.device import free_memory
    free = free_memory(torch.device("cpu"))
    if free is not None and shape.host_bytes > 0.9 * free:
        raise ValueError(f"{shape.layers} layers of experts need {shape.host_bytes / 2**30:.1f} GiB of "
                         f"host memory but {free / 2**30:.1f} GiB are free; give fewer --layers or a "
                         f"smaller --scale")
