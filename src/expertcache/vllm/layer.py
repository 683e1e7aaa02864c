"""The RoutedExperts subclass vLLM instantiates once the plug-in is registered.

Without ``additional_config["expertcache"]`` it is vLLM's class unchanged. With it, the
layer's quant method creates the expert tensors on the host (``pool.create_on_host``,
hooked in ``_get_quant_method``, which vLLM calls just before ``create_weights``); the
layer joins the model's session at construction (checks run there, before loading),
hands its repacked experts to the host store right after vLLM's
``process_weights_after_loading``, and routes ``forward_modular`` through the step.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

from . import checks, device, step
from .pool import create_on_host
from .session import session_for
from .settings import from_additional_config


def _settings():
    from vllm.config import get_current_vllm_config

    vllm_config = get_current_vllm_config()
    return vllm_config, from_additional_config(vllm_config.additional_config)


class ExpertCacheRoutedExperts(RoutedExperts):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        vllm_config, settings = _settings()
        self._expertcache = None
        self._ec_device = False  # set by device.attach once the planner 'device' buffers exist
        if settings is None:
            return
        checks.check_layer(self)
        checks.check_graphs(vllm_config, vllm_config.device_config.device.type, settings.planner)
        session = session_for(settings, vllm_config)
        index = session.join(self)
        checks.check_capacity(settings.cache.slots, settings.cache.partition, len(session.layers),
                              self.top_k, self.global_num_experts)
        self._expertcache = (session, index)
        _wrap_after_loading(self, session, index)

    def _get_quant_method(self, prefix, quant_config, moe_config):
        """vLLM's quant method; with the plug-in on, its ``create_weights`` allocates on the host."""
        method = super()._get_quant_method(prefix, quant_config, moe_config)
        if _settings()[1] is not None and method.__class__.__name__ == "UnquantizedFusedMoEMethod":
            create_on_host(method)  # other methods are refused by check_layer right after
        return method

    def _expertcache_kernel(self, x, topk_weights, topk_ids):
        """vLLM's modular kernel on the pool, told the pool's row count.

        This is ``UnquantizedFusedMoEMethod.forward_native`` (what ``quant_method.apply``
        runs on every platform) with one change: ``global_num_experts`` is the pool's
        ``slots + staging`` rows, the range of the remapped ids, instead of the layer's E.
        vLLM's Triton path sizes its per-expert bookkeeping by that count
        (``moe_align_block_size``): ids at or above it would be dropped or written out
        of bounds. No ``expert_map`` (no expert parallelism: checks.py). Shared experts
        are not passed: with no EP/DP, vLLM's prepare/finalize is not asynchronous, so
        the runner runs them itself (session.take_weights checks it).
        """
        rows = self.w13_weight.shape[0]
        return self.quant_method.moe_kernel.apply(
            hidden_states=x, w1=self.w13_weight, w2=self.w2_weight, topk_weights=topk_weights,
            topk_ids=topk_ids, activation=self.activation,
            apply_router_weight_on_input=self.apply_router_weight_on_input,
            global_num_experts=rows, expert_map=None)

    def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None,
                        shared_experts_input=None):
        if self._expertcache is None:
            return super().forward_modular(x, topk_weights, topk_ids, shared_experts,
                                           shared_experts_input)
        # Shared experts already ran in the runner (no expert parallelism: checks.py).
        if self._ec_device:  # planner 'device': fixed-shape tensor work, traced inline (device.py)
            return device.run_layer(self, x, topk_weights, topk_ids)
        if torch.compiler.is_compiling():  # traced: one opaque node (op.py)
            return torch.ops.expertcache.vllm_moe_step(x, topk_weights, topk_ids, self.layer_name)
        # eager: the same function without the op's dispatch (about 11 us a call on the CPU)
        session, index = self._expertcache
        return step.run(session, index, self, self._expertcache_kernel, x, topk_weights, topk_ids)


def _wrap_after_loading(layer, session, index) -> None:
    """Run vLLM's repacking first, then move the experts out and the pool in."""
    qm = layer.quant_method
    original = qm.process_weights_after_loading

    def after_loading(module):
        original(module)
        if module is layer:
            session.take_weights(index, layer)

    qm.process_weights_after_loading = after_loading
