"""The cached step as an opaque custom op, so that vLLM's compiled graphs call it whole.

torch.compile cannot trace the step's Python bookkeeping (the plan, dict lookups, copies
into slots); as an opaque op it is one node of the graph and runs eagerly every step.
Eager mode calls ``step.run`` directly (layer.py): nothing is traced there. The fake
implementation gives the output's shape (the kernel returns a fresh ``[T, H]`` like
``x``). Imported once per process.
"""

from __future__ import annotations

import torch

from . import step
from .session import LAYERS

OP = "expertcache::vllm_moe_step"


@torch.library.custom_op(OP, mutates_args=())
def moe_step(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
             layer_name: str) -> torch.Tensor:
    layer = LAYERS[layer_name]
    session, index = layer._expertcache
    return step.run(session, index, layer, layer._expertcache_kernel, x, topk_weights, topk_ids)


@moe_step.register_fake
def _(x, topk_weights, topk_ids, layer_name):
    return torch.empty_like(x)
