"""What the plug-in refuses, each in one line, before vLLM loads a weight.

The cache needs the router's top-k ids before the experts run: vLLM hands them to
``RoutedExperts.forward_modular``. Monolithic kernels route inside the kernel and never
expose them. The slot pool copies whole rows of ``w13_weight`` / ``w2_weight``; per-expert
scales (quantized methods) and biases are not pooled yet. Expert parallelism splits the
experts over ranks (a different problem). On CUDA, a captured graph replays the copies
and the id remapping of the step it captured: only eager steps or piecewise graphs
with the MoE op outside them run the plan each step.
"""

from __future__ import annotations

MOE_OPS = ("vllm::moe_forward", "vllm::moe_forward_shared")
# unquantized backends whose weight processing runs on host tensors and whose kernel takes
# any expert count (TRITON sizes moe_align_block_size by it; CPU indexes rows directly)
HOST_SAFE_BACKENDS = ("TRITON", "CPU")


def check_layer(layer) -> None:
    """ValueError when ``layer`` (a RoutedExperts being built) cannot be cached."""
    qm = layer.quant_method
    method = type(qm).__name__
    backend = _backend(qm)
    if qm.is_monolithic:
        raise ValueError(f"expertcache: {layer.layer_name}: quantization method {method} selected the "
                         f"monolithic MoE backend {backend}, which routes inside the kernel and never "
                         "exposes the expert ids; choose a modular backend (docs/vllm.md lists them) "
                         "or run without the expertcache plug-in")
    if layer.quant_config is not None or method != "UnquantizedFusedMoEMethod":
        raise ValueError(f"expertcache: {layer.layer_name}: quantization method {method} (backend "
                         f"{backend}) is modular but its per-expert scales are not pooled yet; the "
                         "plug-in caches unquantized bf16/fp16/fp32 experts (docs/vllm.md)")
    moe = layer.moe_config
    if moe.has_bias:
        raise ValueError(f"expertcache: {layer.layer_name}: experts with biases are not pooled yet; "
                         "the plug-in caches bias-free experts (Qwen3-MoE, Mixtral, DeepSeek, OLMoE)")
    if getattr(layer.expert_map_manager, "num_fused_shared_experts", 0):
        raise ValueError(f"expertcache: {layer.layer_name}: vLLM fused the shared experts into the routed "
                         "experts (ROCm AITER); the plug-in pools routed experts only: run without "
                         "shared-expert fusion")
    backend_name = getattr(qm.unquantized_backend, "name", str(qm.unquantized_backend))
    if backend_name not in HOST_SAFE_BACKENDS:
        raise ValueError(f"expertcache: {layer.layer_name}: unquantized MoE backend {backend_name}: the "
                         "plug-in repacks experts on the host and calls the kernel with the pool's row "
                         f"count, read and tested for {', '.join(HOST_SAFE_BACKENDS)} only; on CUDA pass "
                         "--moe-backend triton")
    par = moe.moe_parallel_config
    if par.use_ep or par.dp_size > 1:
        raise ValueError("expertcache: expert or data parallelism splits the experts over ranks; "
                         "the plug-in caches each rank's full expert set: run without "
                         "--enable-expert-parallel / --data-parallel-size")


def check_graphs(vllm_config, device_type: str, planner: str = "host") -> None:
    """On CUDA with the host planner: refuse graph modes that would freeze one step's plan.

    The device planner's step is fixed-shape device work (vllm/device.py): every graph mode
    replays it correctly, FULL_DECODE_ONLY and FULL_AND_PIECEWISE included.
    """
    if device_type != "cuda" or planner == "device":
        return
    comp = vllm_config.compilation_config
    mode = comp.cudagraph_mode
    if mode is None or vllm_config.model_config.enforce_eager or mode.name == "NONE":
        return
    split = set(comp.splitting_ops or ())
    if mode.has_full_cudagraphs() or not split.issuperset(MOE_OPS):
        raise ValueError(f"expertcache: cudagraph_mode {mode.name} would replay one step's expert plan; "
                         "use planner 'device' (any graph mode), --enforce-eager, or --compilation-config "
                         "'{\"cudagraph_mode\": \"PIECEWISE\", \"splitting_ops\": [\"vllm::unified_attention\", "
                         "\"vllm::unified_attention_with_output\", \"vllm::moe_forward\", "
                         "\"vllm::moe_forward_shared\"]}' (docs/vllm.md)")


def check_capacity(slots: int | None, partition: str, layers_so_far: int, top_k: int,
                   num_experts: int) -> None:
    """Slots fewer than one step's top-k: known when the layers are built, before loading."""
    if slots is None:
        return
    from ..cache import partition_shares
    try:
        partition_shares(layers_so_far if partition == "per-layer" else 1, num_experts,
                         slots, partition, top_k)
    except ValueError as err:
        where = f" (with at least {layers_so_far} MoE layers)" if partition == "per-layer" else ""
        raise ValueError(f"expertcache: slots={slots}{where}: {err}") from None


def _backend(qm) -> str:
    for attr in ("unquantized_backend", "fp8_backend", "mxfp4_backend", "backend"):
        value = getattr(qm, attr, None)
        if value is not None:
            return getattr(value, "name", str(value))
    cls = getattr(qm, "experts_cls", None)
    return getattr(cls, "__name__", "unknown")
