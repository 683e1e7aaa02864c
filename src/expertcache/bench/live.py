"""Run one strategy for real: the runtime's ExpertCache executing a replayed trace.

Per token, one hidden vector goes through every MoE layer: ``run_step`` (the same
function the transformers integration calls) plans the step with the SlotTable,
copies loads into the slot pool and computes the routed experts; a residual add and
an RMS norm carry the output to the next layer so the layers depend on each other
as in a model. Timed per token (device synchronised), with a breakdown of planning,
copies and expert compute taken by thin timing wrappers (CPU only: on CUDA the
kernels are asynchronous and host timers would measure launches).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..cache import SlotTable
from ..decode_phases import steady_start
from ..runtime import experts as experts_mod
from ..runtime.engine import ExpertCache
from ..stats import DECODE, Counts
from ..trace.format import Trace
from .strategies import OPTIMUM, Strategy

PARTS = ("plan", "copy", "compute")
CLOCKS = ("auto", "wall", "cpu")


def pick_clock(name: str, device: torch.device):
    """The timer: wall time, or this thread's CPU time.

    On a shared CPU other processes steal the core mid-token and wall time then
    counts their work; with one torch thread every expert matmul and copy runs on the
    calling thread, so its CPU time is the work this strategy did. ``auto`` takes CPU
    time exactly then (CPU device, one thread) and wall time otherwise (CUDA kernels
    run off the host thread, several threads run in parallel).
    """
    if name not in CLOCKS:
        raise ValueError(f"unknown --clock {name!r}; use one of {', '.join(CLOCKS)}")
    if name == "cpu" and (device.type != "cpu" or torch.get_num_threads() != 1):
        raise ValueError("--clock cpu measures the calling thread only: use it with --device cpu "
                         "and --threads 1, or use --clock wall")
    if name == "cpu" or (name == "auto" and device.type == "cpu" and torch.get_num_threads() == 1):
        return "cpu", time.thread_time
    return "wall", time.perf_counter


@dataclass
class Run:
    """What one strategy did: per-decode-token seconds, counts, bytes, outputs."""

    strategy: Strategy
    seconds: list[float]                 # per decode token, in order (the run's clock)
    decode: Counts                       # whole run, decode tokens
    steady: Counts                       # steady-phase decode tokens only
    h2d_decode: int                      # bytes copied into slots during decode tokens
    slot_bytes: int
    outputs: torch.Tensor                # [T_decode, H] float32: the last layer's output per token
    parts: dict[str, float] = field(default_factory=dict)  # steady seconds per token, CPU only
    skipped: str | None = None           # why it did not run (e.g. memory)
    wall: list[float] = field(default_factory=list)  # per decode token, wall clock


class Inputs:
    """The trace as device tensors, built once and shared by every strategy."""

    def __init__(self, trace: Trace, hidden: int, dtype: torch.dtype, device: torch.device,
                 seed: int = 0) -> None:
        # L layers, T tokens, K top-k, H hidden
        L, T, K = trace.experts.shape
        self.trace, self.device, self.dtype = trace, device, dtype
        self.index = torch.from_numpy(trace.experts.astype("int64")).to(device)   # [L, T, K]
        if trace.weights is not None:
            w = torch.from_numpy(trace.weights.astype("float32"))
        else:  # traces without router weights: equal shares, as a renormalised top-k of ties
            w = torch.full((L, T, K), 1.0 / K)
        self.weights = w.to(device=device, dtype=dtype)                           # [L, T, K]
        gen = torch.Generator().manual_seed(seed)
        self.hidden = torch.randn((T, hidden), generator=gen).to(device)          # [T, H] fp32
        self.phases = trace.phases.tolist()
        self.decode_tokens = sum(1 for p in self.phases if p == DECODE)


def build_cache(strategy: Strategy, hosts, top_k: int, device: torch.device, partition: str,
                future=None) -> ExpertCache:
    """The runtime cache for a strategy; belady gets the oracle table bound to ``future``."""
    cache = ExpertCache(strategy.config(partition), hosts, top_k, device)
    if strategy.kind == OPTIMUM:
        # CacheConfig refuses oracles (a live model cannot know the future); a replayed trace
        # can, so the bench builds the pool as for lru and swaps in a belady table of equal size
        table = cache.table
        cache.table = SlotTable(table.num_layers, table.num_experts, table.slots, eviction=OPTIMUM,
                                partition=partition, top_k=top_k)
        cache.table.bind_future(future)
    return cache


def run_strategy(cache: ExpertCache, strategy: Strategy, module: torch.nn.Module,
                 inputs: Inputs, clock=time.perf_counter) -> Run:
    """Replay every token of ``inputs`` through ``cache``; time the decode tokens with ``clock``."""
    timer = _Timer(inputs.device, clock)
    seconds, wall, outputs = [], [], []
    steady_at = steady_start(inputs.decode_tokens)
    steady_before = None
    with torch.no_grad(), timer.attach(cache):
        for t, phase in enumerate(inputs.phases):
            if phase == DECODE and len(seconds) == steady_at:
                steady_before = cache.table.stats().total(DECODE)
                timer.reset()
            cache.phase = phase
            start, start_wall = clock(), time.perf_counter()
            x = _token(cache, module, inputs, t)
            if inputs.device.type == "cuda":
                torch.cuda.synchronize(inputs.device)
            elapsed, elapsed_wall = clock() - start, time.perf_counter() - start_wall
            if phase == DECODE:
                seconds.append(elapsed)
                wall.append(elapsed_wall)
                outputs.append(x.float().cpu())
            else:
                timer.reset()
    stats = cache.stats()
    decode = stats.total(DECODE)
    steady = _minus(decode, steady_before or Counts())
    n_steady = len(seconds) - steady_at
    parts = ({k: v / n_steady for k, v in timer.totals.items()}
             if n_steady and inputs.device.type == "cpu" else {})
    # prefill traffic (stats.h2d_bytes(0)) is not part of the per-decode-token figures
    return Run(strategy, seconds, decode, steady, stats.h2d_bytes(DECODE), cache.slot_bytes,
               torch.cat(outputs) if outputs else torch.empty(0), parts, wall=wall)


def _token(cache: ExpertCache, module, inputs: Inputs, t: int) -> torch.Tensor:
    """One token through all MoE layers: hidden [1, H] in, the last layer's output [1, H] out."""
    x = inputs.hidden[t:t + 1]                                    # [1, H] fp32 residual stream
    for layer in range(cache.num_layers):
        y = experts_mod.run_step(cache, layer, module, x.to(inputs.dtype),
                                 inputs.index[layer, t:t + 1], inputs.weights[layer, t:t + 1])
        x = x + y.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # RMS norm: stable scale
    return x


def _minus(a: Counts, b: Counts) -> Counts:
    return Counts(*(getattr(a, f) - getattr(b, f) for f in
                    ("accesses", "hits", "misses", "loads", "evictions", "bypasses")))


class _Timer:
    """Seconds spent planning (table.step), copying (pool.load) and computing experts."""

    def __init__(self, device: torch.device, clock=time.perf_counter) -> None:
        self.enabled, self.clock = device.type == "cpu", clock
        self.totals = dict.fromkeys(PARTS, 0.0)

    def reset(self) -> None:
        self.totals = dict.fromkeys(PARTS, 0.0)

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[part] += self.clock() - start
        return timed

    @contextmanager
    def attach(self, cache: ExpertCache):
        """Wrap the table's step, the pool's load and the runtime's two compute functions.

        Instance attributes shadow the methods for this cache only; the module-level
        compute functions are swapped for the duration of the run and always restored.
        """
        if not self.enabled:
            yield
            return
        saved = {n: getattr(experts_mod, n) for n in ("grouped_over_slots", "cpu_experts")}
        cache.table.step = self.wrap("plan", cache.table.step)
        cache.pool.load = self.wrap("copy", cache.pool.load)
        for name, fn in saved.items():
            setattr(experts_mod, name, self.wrap("compute", fn))
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(experts_mod, name, fn)
            del cache.table.step, cache.pool.load
