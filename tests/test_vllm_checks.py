"""Which CUDA graph modes the vLLM plug-in accepts, per planner (runs without vLLM: the
check reads only the config's fields)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from expertcache.vllm.checks import MOE_OPS, check_graphs


def config(mode: str, full: bool, splitting=(), eager=False):
    mode = SimpleNamespace(name=mode, has_full_cudagraphs=lambda: full)
    return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=mode, splitting_ops=list(splitting)),
                           model_config=SimpleNamespace(enforce_eager=eager))


@pytest.mark.parametrize("mode, full", [("FULL_AND_PIECEWISE", True), ("FULL_DECODE_ONLY", True),
                                        ("FULL", True), ("PIECEWISE", False)])
def test_host_planner_refuses_graphs_that_freeze_a_plan_device_planner_accepts_them(mode, full):
    with pytest.raises(ValueError) as err:
        check_graphs(config(mode, full), "cuda", "host")
    assert f"cudagraph_mode {mode}" in str(err.value) and "planner 'device'" in str(err.value)
    check_graphs(config(mode, full), "cuda", "device")  # the step is fixed-shape device work


def test_host_planner_runs_eager_or_piecewise_with_the_moe_ops_split_out():
    check_graphs(config("PIECEWISE", False, ("vllm::unified_attention", *MOE_OPS)), "cuda", "host")
    check_graphs(config("FULL_AND_PIECEWISE", True, eager=True), "cuda", "host")
    check_graphs(config("FULL_AND_PIECEWISE", True), "cpu", "host")  # no CUDA graphs on the CPU
