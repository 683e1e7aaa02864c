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


def _layer(backend: str, fused_shared: int = 0):
    from enum import Enum

    Backend = Enum("UnquantizedMoeBackend", [backend])
    method = type("UnquantizedFusedMoEMethod", (), {"is_monolithic": False,
                                                    "unquantized_backend": Backend[backend]})()
    moe = SimpleNamespace(has_bias=False, moe_parallel_config=SimpleNamespace(use_ep=False, dp_size=1))
    return SimpleNamespace(quant_method=method, quant_config=None, layer_name="model.layers.0.mlp.experts",
                           moe_config=moe, expert_map_manager=SimpleNamespace(num_fused_shared_experts=fused_shared))


def test_cuda_backends_other_than_triton_are_refused_by_name():
    from expertcache.vllm.checks import check_layer

    check_layer(_layer("TRITON"))
    check_layer(_layer("CPU"))
    for backend in ("FLASHINFER_CUTLASS", "FLASHINFER_TRTLLM", "BATCHED_TRITON", "MOONEP"):
        with pytest.raises(ValueError) as err:
            check_layer(_layer(backend))
        assert f"unquantized MoE backend {backend}" in str(err.value) and "--moe-backend triton" in str(err.value)
    with pytest.raises(ValueError, match="fused the shared experts"):
        check_layer(_layer("TRITON", fused_shared=1))
