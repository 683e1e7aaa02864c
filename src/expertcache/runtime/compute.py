"""Expert math: a grouped matmul over pool slots, and one expert on given weights.

Both follow transformers' experts contract (``@use_experts_implementation``): fused
``gate_up_proj`` (or ``up_proj``), ``down_proj``, optional biases, ``is_transposed``
(GPT-OSS stores ``[E, in, out]``), the module's own ``_apply_gate`` or ``act_fn`` and
an optional post-expert norm, so every family computes exactly as its eager code.
"""

from __future__ import annotations

from collections import Counter

import torch

# torch's own grouped matmul (public ``F.grouped_mm`` from torch 2.10, ``torch._grouped_mm`` before):
# called directly, not through transformers' private dispatcher, whose names and rules change
# between releases (the GPU image has transformers 5.17, development 5.25)
GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# the only (device capability majors, dtype) with torch's fast grouped kernel: bf16 on Hopper (sm90)
# and Blackwell (sm100). Elsewhere torch falls back to a loop that reads the offsets back to the
# host, a sync per call, and the loop of matmuls over used slots is the better choice.
FAST_GROUPED_MM = {9, 10}
# most weight elements one grouped matmul's view spans (int32 indexing stays safe below it)
GROUPED_MAX_ELEMENTS = 2 ** 31 - 1
# most groups (weight rows of the pool) one grouped matmul takes: torch's CUDA kernel raises
# "Can't process more than 1024 groups" past it (issue 29, defect 1)
GROUPED_MAX_GROUPS = 1024


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    out = x @ w if transposed else torch.nn.functional.linear(x, w)
    return out if b is None else out + b


def _activate(module: torch.nn.Module, proj: torch.Tensor) -> torch.Tensor:
    return module._apply_gate(proj) if getattr(module, "has_gate", True) else module.act_fn(proj)


def grouped_over_slots(module: torch.nn.Module, hidden: torch.Tensor, slot_idx: torch.Tensor,
                       weights: torch.Tensor, pool: dict[str, torch.Tensor],
                       groups: list[tuple[int, int]] | None = None, grouped: bool = False,
                       transposed: bool | None = None) -> torch.Tensor:
    """Experts output for the (token, rank) pairs whose slot id is below the pool size.

    hidden [T, H]; slot_idx [T, K] int64 (S = pool size means "not computed here");
    weights [T, K]; pool kind -> [S, ...]. Returns [T, H]. Reads the weights in place
    from the pool, no gather copy of any expert. ``groups``: (slot, pairs routed to it)
    in slot order, known on the host from the plan, so neither strategy syncs (derived
    from slot_idx when omitted). ``grouped``: a grouped matmul over the windows of used
    slots (the device kernel; ``_windows``); otherwise a loop of matmuls over the used
    slots (the host, or a device without torch's fast grouped kernel for this dtype). ``transposed``: whether the
    pool's weights are ``[in, out]`` (default: the module's own ``is_transposed``;
    dequantized GGUF experts are always ``[out, in]``).
    """
    first = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    S = pool[first].shape[0]
    T, K = slot_idx.shape
    if transposed is None:
        transposed = getattr(module, "is_transposed", False)
    if groups is None:
        groups = sorted(Counter(s for s in slot_idx.reshape(-1).tolist() if s < S).items())
    n = sum(count for _, count in groups)              # pairs computed here (host-known: no sync)
    ids, perm = torch.sort(slot_idx.reshape(-1))       # [T*K] pairs grouped by slot; excluded last
    ids, perm = ids[:n], perm[:n]                      # [N] only the pairs of this pass
    x = hidden[perm // K]                              # [N, H], tokens grouped by slot
    w_up, w_down = pool[first], pool["down_proj"]
    per_slot = max(w_up[0].numel(), w_down[0].numel())
    matmul = _grouped(ids, _windows(groups, per_slot)) if grouped else _looped(groups)
    b_up = pool[first + "_bias"][ids] if first + "_bias" in pool else None
    proj = matmul(x, w_up, transposed)
    proj = _activate(module, proj if b_up is None else proj + b_up)
    out = matmul(proj, w_down, transposed)
    if "down_proj_bias" in pool:
        out = out + pool["down_proj_bias"][ids]
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    out = out * weights.reshape(-1)[perm].unsqueeze(-1)           # [N, H]
    full = out.new_zeros(T * K, out.shape[-1])                    # pairs not computed here add 0
    full[perm] = out                                              # unique indices: deterministic
    return full.view(T, K, -1).sum(dim=1).to(hidden.dtype)        # [T, H], rank-order sum per token


def _windows(groups: list[tuple[int, int]], per_slot: int) -> list[tuple[int, int, int, int]]:
    """(lo, hi, first pair, end pair) per window: runs of the used slots, each under
    ``GROUPED_MAX_ELEMENTS`` weight elements and ``GROUPED_MAX_GROUPS`` slots from its first
    slot to its last.

    One grouped matmul reads the slots ``lo..hi-1`` of a window (views, no copy), never the
    whole pool: at real sizes a pool is thousands of groups and a weight view past 2^31
    elements (768 bf16 Qwen3 slots: 2.4e9), which no test at 4-8 layers reaches. ``groups``
    (slot, pairs) in slot order is host-known, so this reads nothing back.
    """
    out, first, start = [], 0, 0
    for i, (slot, _) in enumerate(groups):
        span = slot - groups[first][0] + 1
        if i > first and (span * per_slot > GROUPED_MAX_ELEMENTS or span > GROUPED_MAX_GROUPS):
            end = start + sum(n for _, n in groups[first:i])
            out.append((groups[first][0], groups[i - 1][0] + 1, start, end))
            first, start = i, end
    if groups:
        out.append((groups[first][0], groups[-1][0] + 1, start, start + sum(n for _, n in groups[first:])))
    return out


def _grouped(ids: torch.Tensor, windows: list[tuple[int, int, int, int]]):
    """One grouped matmul per window; per-slot offsets computed on the device from the sorted ids."""
    offsets = [torch.cumsum(slot_counts(ids[a:b] - lo, hi - lo), dim=0, dtype=torch.int32)
               for lo, hi, a, b in windows]

    def matmul(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
        outs = []
        for (lo, hi, a, b), offs in zip(windows, offsets):
            part = w[lo:hi]
            outs.append(GROUPED_MM(x[a:b].to(w.dtype), part if transposed else part.transpose(-2, -1), offs=offs))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    return matmul


def slot_counts(local: torch.Tensor, size: int) -> torch.Tensor:
    """Pairs per slot: ``local`` [N] slot ids in ``0..size-1`` -> int32 [size]. A scatter-add into a
    fixed-size buffer: ``torch.histc`` on CUDA ints synchronizes the stream (issue 29, defect 3)."""
    counts = torch.zeros(size, dtype=torch.int32, device=local.device)
    return counts.scatter_add(0, local.long(), torch.ones_like(local, dtype=torch.int32))


def _looped(groups: list[tuple[int, int]]):
    """A matmul per used slot; on the CPU this beats grouped_mm, whose cost grows with S."""
    def matmul(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
        out = x.new_zeros(x.shape[0], w.shape[-1] if transposed else w.shape[-2])
        start = 0
        for slot, n in groups:
            a, start = start, start + n
            out[a:start] = x[a:start] @ w[slot] if transposed else torch.nn.functional.linear(x[a:start], w[slot])
        return out
    return matmul


def fast_grouped_mm(device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None) -> bool:
    """Whether torch has a fast grouped kernel here: CUDA, bf16, sm90 or sm100 (``FAST_GROUPED_MM``)."""
    return (GROUPED_MM is not None and device_type == "cuda" and dtype == torch.bfloat16
            and capability is not None and capability[0] in FAST_GROUPED_MM)


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether pools on ``device`` in ``dtype`` take one grouped matmul (else a loop over used slots):
    only where torch's fast kernel exists, and only if a probe on the device gives the right sums."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if not fast_grouped_mm(device.type, dtype, capability):
        return False  # the host (the loop is faster there), or torch's syncing fallback
    try:
        x = torch.ones(4, 16, device=device, dtype=dtype)
        w = torch.ones(2, 16, 16, device=device, dtype=dtype)
        offs = torch.tensor([2, 4], device=device, dtype=torch.int32)
        y = GROUPED_MM(x, w, offs=offs)
        return bool(torch.allclose(y.float().cpu(), torch.full((4, 16), 16.0)))
    except (RuntimeError, NotImplementedError):
        return False


def one_expert(module: torch.nn.Module, x: torch.Tensor, w: dict[str, torch.Tensor],
               transposed: bool | None = None) -> torch.Tensor:
    """One expert's MLP on tokens ``x`` [N, H] with its weights ``w`` (kind -> one expert's tensor)."""
    first = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    if transposed is None:
        transposed = getattr(module, "is_transposed", False)
    x = x.to(w[first].dtype)
    proj = _activate(module, _linear(x, w[first], w.get(first + "_bias"), transposed))
    out = _linear(proj, w["down_proj"], w.get("down_proj_bias"), transposed)
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    return out
