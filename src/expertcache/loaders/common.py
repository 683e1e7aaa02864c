"""What every loader shares: finding the experts modules and building a model without weights."""

from __future__ import annotations

import torch


def find_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The experts modules in forward order (MoE-layer index = position in this list)."""
    found = [(name, m) for name, m in model.named_modules()
             if hasattr(m, "num_experts") and (hasattr(m, "_expertcache") or any(
                 hasattr(m, kind) or hasattr(m, kind + "_blocks")
                 for kind in ("gate_up_proj", "up_proj", "down_proj")))]
    if not found:
        raise ValueError(f"{type(model).__name__} has no MoE layers (no experts module holding fused "
                         "gate_up_proj/down_proj); expertcache needs a Mixture-of-Experts model such as "
                         "Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, DeepSeek-V3 or Granite-MoE")
    return found


def empty_model(hf_config, dtype: torch.dtype):
    """The model without allocating weights (buffers such as rotary tables stay real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)


def drop_expert_params(found) -> None:
    """Delete the empty (meta) expert parameters of a model built empty: the cache serves them."""
    for _, module in found:
        for name, _ in list(module.named_parameters(recurse=False)):
            delattr(module, name)
