"""Expert math: a grouped matmul over pool slots, and one expert on given weights.

Both follow transformers' experts contract (``@use_experts_implementation``): fused
``gate_up_proj`` (or ``up_proj``), ``down_proj``, optional biases, ``is_transposed``
(GPT-OSS stores ``[E, in, out]``), the module's own ``_apply_gate`` or ``act_fn`` and
an optional post-expert norm, so every family computes exactly as its eager code.
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import _grouped_mm  # dispatches to grouped_mm or a loop


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    out = x @ w if transposed else torch.nn.functional.linear(x, w)
    return out if b is None else out + b


def _activate(module: torch.nn.Module, proj: torch.Tensor) -> torch.Tensor:
    return module._apply_gate(proj) if getattr(module, "has_gate", True) else module.act_fn(proj)


def grouped_over_slots(module: torch.nn.Module, hidden: torch.Tensor, slot_idx: torch.Tensor,
                       weights: torch.Tensor, pool: dict[str, torch.Tensor],
                       grouped: bool | None = None) -> torch.Tensor:
    """Experts output for the (token, rank) pairs whose slot id is below the pool size.

    hidden [T, H]; slot_idx [T, K] int64 (S = pool size means "not computed here");
    weights [T, K]; pool kind -> [S, ...]. Returns [T, H]. Reads weights in place from
    the pool: grouped matmul over slots, no gather copy of any expert. ``grouped``
    forces one matmul strategy (default: grouped on a device, a slot loop on the host).
    """
    first = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    w_up, w_down = pool[first], pool["down_proj"]
    S = w_up.shape[0]
    T, K = slot_idx.shape
    transposed = getattr(module, "is_transposed", False)
    flat = slot_idx.reshape(-1)                        # [T*K]
    ids, perm = torch.sort(flat)                       # group pairs by slot; excluded ones sort last
    x = hidden[perm // K]                              # [T*K, H], tokens grouped by slot
    matmul = _slot_matmul(ids, S, ids.device.type != "cpu" if grouped is None else grouped)
    bias_ids = ids.clamp(max=S - 1)
    b_up = pool[first + "_bias"][bias_ids] if first + "_bias" in pool else None
    proj = matmul(x, w_up, transposed)
    proj = _activate(module, proj if b_up is None else proj + b_up)
    out = matmul(proj, w_down, transposed)
    if "down_proj_bias" in pool:
        out = out + pool["down_proj_bias"][bias_ids]
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    # rows past offsets[-1] are uninitialised kernel output: select zero there, never multiply
    out = torch.where((ids < S).unsqueeze(-1), out, 0.0) * weights.reshape(-1)[perm].unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return out[inv].view(T, K, -1).sum(dim=1).to(hidden.dtype)  # [T, H]


def _slot_matmul(ids: torch.Tensor, S: int, grouped: bool):
    """x [N, in] grouped by sorted slot ids -> [N, out] with each group's slot weight.

    Device: one grouped matmul (offsets per slot; ids == S fall past the last offset).
    Host: a loop over the slots actually used; CPU grouped_mm costs grow with S.
    """
    if grouped:
        counts = torch.histc(ids.float() if ids.device.type == "cpu" else ids.int(),  # CPU histc: floats
                             bins=S, min=0, max=S - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return lambda x, w, transposed: _grouped_mm(x, w if transposed else w.transpose(-2, -1),
                                                    offs=offsets)
    slots, counts = torch.unique_consecutive(ids, return_counts=True)
    groups, start = [], 0
    for slot, n in zip(slots.tolist(), counts.tolist()):  # host tensors: no sync involved
        if slot < S:
            groups.append((slot, start, start + n))
        start += n

    def matmul(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
        out = x.new_zeros(x.shape[0], w.shape[-1] if transposed else w.shape[-2])
        for slot, a, b in groups:
            out[a:b] = x[a:b] @ w[slot] if transposed else torch.nn.functional.linear(x[a:b], w[slot])
        return out
    return matmul


def one_expert(module: torch.nn.Module, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """One expert's MLP on tokens ``x`` [N, H] with its weights ``w`` (kind -> one expert's tensor)."""
    first = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    transposed = getattr(module, "is_transposed", False)
    x = x.to(w[first].dtype)
    proj = _activate(module, _linear(x, w[first], w.get(first + "_bias"), transposed))
    out = _linear(proj, w["down_proj"], w.get("down_proj_bias"), transposed)
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    return out
