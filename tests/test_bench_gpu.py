"""The decode benchmark on CUDA: same accounting and outputs as on the CPU.

Skipped without a CUDA device; ``benchmarks/gpu_check.sh`` runs ``pytest -m gpu``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,  # 143 s on the H200: gpu_check.sh runs it in its tests-slow step
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device: run benchmarks/gpu_check.sh on a GPU machine"),
]

from expertcache.bench.run import run_strategies  # noqa: E402
from expertcache.bench.strategies import plan  # noqa: E402
from expertcache.bench.workload import cut  # noqa: E402
from expertcache.presets import preset  # noqa: E402
from expertcache.sim.replay import replay  # noqa: E402
from expertcache.stats import DECODE  # noqa: E402
from expertcache.trace.synth import synth_trace  # noqa: E402


def test_bench_on_cuda_counts_and_outputs():
    trace = cut(synth_trace("qwen3-30b-a3b", 48, seed=3, prompt=8), 3, None)
    result = run_strategies(trace, preset("qwen3-30b-a3b"), plan(["lru"], [48, 96]), scale=0.05,
                            dtype="fp32", device="cuda", hardware="calibrate")
    assert result.device.type == "cuda" and result.clock == "wall"
    nbytes, L, k = result.shape.expert_bytes, trace.num_layers, trace.top_k
    ref = next(r for r in result.runs if r.strategy.kind == "resident")
    for run in result.runs:
        s = run.strategy
        if s.kind == "copy-every-pass":
            assert run.h2d_decode == len(run.seconds) * L * k * nbytes
        if s.kind in ("cache", "belady"):
            assert run.h2d_decode == run.decode.misses * nbytes
            sim = replay(trace, s.sim_policy, s.slots).stats.total(DECODE)
            assert (run.decode.hits, run.decode.misses) == (sim.hits, sim.misses)
        # cpu computes on the host, the rest on the device: same math, other kernels
        torch.testing.assert_close(run.outputs, ref.outputs, rtol=1e-4, atol=1e-4)
    assert result.hardware.h2d_gbps > 0.5  # pinned host -> device copies, measured
