"""The RoutedExperts subclass vLLM instantiates once the plug-in is registered.

Without ``additional_config["expertcache"]`` it is vLLM's class unchanged. With it, the
layer joins the model's session at construction (checks run there, before loading),
hands its repacked experts to the host store right after vLLM's
``process_weights_after_loading``, and routes ``forward_modular`` through the opaque op.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

from . import checks, step
from .session import session_for
from .settings import from_additional_config


class ExpertCacheRoutedExperts(RoutedExperts):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
        settings = from_additional_config(vllm_config.additional_config)
        self._expertcache = None
        if settings is None:
            return
        checks.check_layer(self)
        checks.check_graphs(vllm_config, vllm_config.device_config.device.type)
        session = session_for(settings, vllm_config)
        index = session.join(self)
        checks.check_capacity(settings.cache.slots, settings.cache.partition, len(session.layers),
                              self.top_k, self.global_num_experts)
        self._expertcache = (session, index)
        _wrap_after_loading(self, session, index)

    def _expertcache_kernel(self, x, topk_weights, topk_ids):
        """vLLM's own modular path (quant_method.apply) on the pool this layer holds."""
        return RoutedExperts.forward_modular(self, x, topk_weights, topk_ids, None, None)

    def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None,
                        shared_experts_input=None):
        if self._expertcache is None:
            return super().forward_modular(x, topk_weights, topk_ids, shared_experts,
                                           shared_experts_input)
        # Shared experts already ran in the runner (no expert parallelism: checks.py).
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
