"""Measure this device's rates for the cost model, with the runtime's own code.

``costmodel`` predicts a token from per-expert times: a hit (expert math from
the slot pool), a fetch (copy into a slot, then the math) and a CPU miss (math on
host weights), plus a fixed cost per MoE layer. Spec-sheet rates do not describe
a batch-1 expert on a 2-core VM, so the bench measures each rate at the bench's
own expert shape, cycling over distinct experts so caches do not flatter them:

* ``h2d_gbps``      one expert copied host -> slot by ``SlotPool.load`` (into slots spread
  over the pool, as cache loads; and into top-k reused staging slots, as copy-every-pass);
* ``gpu_mem_gbps``  the runtime's grouped matmul over top-k pool slots for one token,
  per expert;
* ``cpu_mem_gbps``  the same on host weights (the ``cpu`` miss path);
* ``layer_overhead_s``  one ``run_step`` of a tiny model (8 x 8 experts): planning,
  index remapping and dispatch with negligible math.

The result is a ``Hardware`` profile (``expert_flops`` is left out so the measured
per-expert time, whatever bounds it, is the CPU miss time).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from ..runtime.compute import grouped_over_slots, one_expert
from ..runtime.slots import SlotPool
from ..costmodel import Hardware

_POOL_BYTES = 256 * 2 ** 20  # distinct experts cycled through: beyond L2, like a real run


def calibrate(module: torch.nn.Module, hosts, device: torch.device, top_k: int,
              seconds: float = 0.3, clock=time.perf_counter) -> tuple[Hardware, Hardware]:
    """Profiles measured on ``device`` for experts shaped like ``hosts``, timed with
    ``clock`` (the bench's: wall, or thread CPU time on a shared CPU).

    Returns (cache profile, staging profile): the second differs only in ``h2d_gbps``,
    measured into ``top_k`` staging slots reused every step, as copy-every-pass does.
    On a CPU such a destination stays in cache while a cache's loads land in victim
    slots spread over the pool; at 2 MiB experts that is 1.4x faster per copy. Over
    PCIe both are the same link.
    """
    host = hosts[0]
    n = max(2, min(host.num_experts * len(hosts), _POOL_BYTES // host.expert_bytes))
    experts = [(i % len(hosts), (i // len(hosts)) % host.num_experts) for i in range(n)]
    pool = SlotPool(host.layout(), n, 0, device)
    copy_s = _per_item(lambda i: pool.load(i, hosts[experts[i][0]], experts[i][1]), n, device, seconds,
                       clock)
    k = min(top_k, n)
    staging_s = _per_item(lambda i: pool.load(i % k, hosts[experts[i][0]], experts[i][1]), n, device,
                          seconds, clock)
    pool.ready()
    dtype = next(iter(host.tensors.values())).dtype
    x = torch.randn(1, host.tensors["down_proj"].shape[1], dtype=dtype)          # [1, H]
    groups = n // k
    # the runtime's grouped matmul over k distinct pool slots per call: [1, K] slot ids
    slot_idx = torch.arange(groups * k, device=device).view(groups, 1, k)
    w = torch.full((1, k), 1.0 / k, dtype=dtype, device=device)
    x_dev = x.to(device)
    step_s = _per_item(lambda i: grouped_over_slots(module, x_dev, slot_idx[i % groups], w,
                                                    pool.tensors), groups, device, seconds, clock)
    hit_s = step_s / k
    cpu_s = _per_item(lambda i: one_expert(module, x, hosts[experts[i][0]].expert(experts[i][1])),
                      n, torch.device("cpu"), seconds, clock)
    nbytes = host.expert_bytes
    hw = Hardware("bench-calibrated", h2d_gbps=nbytes / copy_s / 1e9,
                  gpu_mem_gbps=nbytes / hit_s / 1e9, cpu_mem_gbps=nbytes / cpu_s / 1e9,
                  cpu_gflops=1e6, transfer_latency_s=0.0,
                  layer_overhead_s=layer_overhead(device, top_k, clock=clock),
                  source=f"measured by expertcache bench on {device} at {nbytes} bytes per expert")
    return hw, replace(hw, name="bench-calibrated-staging", h2d_gbps=nbytes / staging_s / 1e9)


def layer_overhead(device: torch.device, top_k: int, steps: int = 200,
                   clock=time.perf_counter) -> float:
    """Seconds of one ``run_step`` whose math is negligible: the runtime's fixed cost per layer."""
    from ..config import CacheConfig
    from ..runtime.engine import ExpertCache
    from ..runtime.experts import run_step
    from .model import BenchShape, experts_module, host_experts

    k = min(top_k, 8)
    shape = BenchShape("tiny", 2, 16, k, 8, 8, "fp32")
    module, hosts = experts_module(shape), host_experts(shape)
    cache = ExpertCache(CacheConfig(slots=16, partition="global"), hosts, k, device)
    gen = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(16, generator=gen)[:k] for _ in range(steps)]).to(device)
    w = torch.full((1, k), 1.0 / k, device=device)
    x = torch.zeros(1, 8, device=device)
    with torch.no_grad():
        for s in range(20):  # warm-up: allocator, first-call dispatch
            run_step(cache, s % 2, module, x, idx[s:s + 1], w)
        _sync(device)
        start = clock()
        for s in range(steps):
            run_step(cache, s % 2, module, x, idx[s:s + 1], w)
        _sync(device)
    # scaled from the tiny top-k to the real one: dispatch grows with the experts per step
    return (clock() - start) / steps * top_k / k


def _per_item(fn, n: int, device: torch.device, seconds: float, clock=time.perf_counter) -> float:
    """Mean seconds per call of ``fn(i)`` cycling i over 0..n-1, for about ``seconds``."""
    fn(0)
    _sync(device)
    calls, start = 0, clock()
    while True:
        for _ in range(8):
            fn(calls % n)
            calls += 1
        _sync(device)
        elapsed = clock() - start
        if elapsed > seconds and calls >= min(n, 32):
            return elapsed / calls


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
