"""The fused MoE kernel over the slot pool (issue 31): which pools and experts it serves, the
pairs sorted into blocks on the device, and the call.

``fused_experts(x [T, H], weights [T, K], rows [T, K], layout) -> [T, H]``: every (token, rank)
pair whose pool row is in ``0..size-1`` through its row's expert (rows outside: nothing, as
``compute.grouped_over_slots``'s sentinel S). The pairs are sorted into blocks of ``BLOCK_M`` pairs
of one row each (``align``: vLLM's moe_align_block_size, but with fixed shapes and no host read, and
a grid sized from T*K, never from the pool), then two Triton programs (``fused_kernels.py``) read
each block's weights where they lie in the pool: float slots as they are, quantized slots' ggml
blocks (Q8_0, Q4_K, Q5_K, Q6_K, MXFP4) decoded in registers (``fused_formats.py``), no scratch.
Work and bytes read follow the pairs, not the pool's size.

What it computes: SiLU-gated experts (``silu(gate) * up``, Qwen / Mixtral / OLMoE / DeepSeek),
without biases or a post-expert norm. Anything else (GPT-OSS's clamped GLU with biases, ungated
experts, FP8 and the other GGUF types) keeps the torch path, and ``refusal`` says why. Triton is
imported only when a kernel runs (it is absent from the main environment; on the CPU its
interpreter, ``TRITON_INTERPRET=1``, runs the same programs for the tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

BLOCK = (16, 64, 64)  # BLOCK_M pairs (tl.dot's least), BN output, BK input columns per step
NAME = "triton-fused"
# slot formats the kernel decodes -> its FMT constexpr (fused_formats.py)
QUANT = {"Q8_0": 1, "Q4_K": 2, "Q6_K": 3, "Q5_K": 4, "MXFP4": 5}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# False: every pool keeps the torch path (benchmarks and tests compare the two on one machine)
ENABLED = True


@dataclass(frozen=True)
class Weight:
    """One projection in the pool: ``tensor`` [S, ...], row ``slot`` apart, output row ``row``
    apart, input column ``col`` apart (float; quantized rows are ggml blocks), from output row
    ``row0`` (the up rows after the gate rows of a fused gate_up)."""

    tensor: torch.Tensor
    fmt: int
    slot: int
    row: int
    col: int
    row0: int = 0


@dataclass(frozen=True)
class Layout:
    """The three projections of one layer's experts in the pool, and their sizes."""

    gate: Weight
    up: Weight
    down: Weight
    hidden: int
    inter: int
    size: int             # pool rows: ids at or past it are not computed here
    dtype: torch.dtype    # the compute dtype (activations, the matmul inputs)


@cache
def triton_refusal() -> str | None:
    """Why the kernel cannot run in this process, or None."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


def device_refusal(device: torch.device) -> str | None:
    """Why the kernel does not serve pools on ``device``: CUDA only (on the CPU, torch's grouped
    matmul or ggml read the slots; the interpreter is for tests), and Triton present."""
    if not ENABLED:
        return "the fused kernel is turned off (expertcache.runtime.fused.ENABLED = False)"
    if torch.device(device).type != "cuda":
        return f"pools on {torch.device(device).type}: the fused kernel runs on CUDA"
    return triton_refusal()


def layout_for(module: torch.nn.Module, pool: dict[str, torch.Tensor], codec=None,
               transposed: bool = False) -> Layout | str:
    """The kernel's layout of ``pool`` for ``module``'s experts (``codec``: quantized slots, one
    layer's), or why the kernel does not serve them (the device, Triton, the family, the format)."""
    refusal = device_refusal(next(iter(pool.values())).device) or module_refusal(module)
    if refusal is not None:
        return refusal
    return float_layout(pool, transposed) if codec is None else quant_layout(pool, codec)


_GATES: dict[type, str | None] = {}


def module_refusal(module: torch.nn.Module) -> str | None:
    """Why ``module`` (a transformers experts module) is not ``silu(gate) * up`` without biases or
    post norm, or None. The gate is probed once per class: its output on values past any clamp
    must equal SiLU-gated (GPT-OSS's clamped GLU, interleaved, and DeepSeek-V4's clamps are not)."""
    if not getattr(module, "has_gate", True):
        return f"{type(module).__name__} is ungated (act_fn on up_proj): the fused kernel computes silu(gate) * up"
    if getattr(module, "has_post_expert_norm", False):
        return f"{type(module).__name__} has a post-expert norm, which the fused kernel does not apply"
    if getattr(module, "has_bias", False):
        return f"{type(module).__name__} has expert biases, which the fused kernel does not add"
    kind = type(module)
    if kind not in _GATES:
        z = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)) * 12  # past GPT-OSS's limit 7
        want = torch.nn.functional.silu(z[:, :8]) * z[:, 8:]
        try:
            got = module._apply_gate(z)
            same = got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        except Exception:  # noqa: BLE001  any failure means: not the gate the kernel computes
            same = False
        _GATES[kind] = None if same else (f"{kind.__name__}'s gate is not silu(gate) * up (e.g. GPT-OSS's "
                                          "clamped GLU): the torch path computes it")
    return _GATES[kind]


def float_layout(pool: dict[str, torch.Tensor], transposed: bool) -> Layout | str:
    """The layout of float slots (``gate_up_proj`` [S, 2I, H], ``down_proj`` [S, H, I]; transposed:
    [S, H, 2I] and [S, I, H]), or why the kernel refuses them."""
    if set(pool) != {"gate_up_proj", "down_proj"}:
        return f"pool kinds {sorted(pool)}: the fused kernel takes gate_up_proj and down_proj, no biases"
    gu, d = pool["gate_up_proj"], pool["down_proj"]
    if gu.dtype not in FLOAT_DTYPES or d.dtype != gu.dtype:
        return f"slots of {gu.dtype}: the fused kernel takes float32, float16 or bfloat16 slots"
    o, i = (2, 1) if transposed else (1, 2)                 # dims of output rows, input columns
    inter, hidden = gu.shape[o] // 2, gu.shape[i]
    gate = Weight(gu, 0, gu.stride(0), gu.stride(o), gu.stride(i))
    up = Weight(gu, 0, gu.stride(0), gu.stride(o), gu.stride(i), inter)
    down = Weight(d, 0, d.stride(0), d.stride(o), d.stride(i))
    return Layout(gate, up, down, hidden, inter, gu.shape[0], gu.dtype)


def quant_layout(pool: dict[str, torch.Tensor], codec) -> Layout | str:
    """The layout of quantized slots (``pool[part]`` [S, bytes], one layer's ``codec``:
    ``runtime/quantized.py``), or why the kernel refuses them."""
    kinds = {k.name: k for k in codec.kinds}
    if set(kinds) != {"gate_up_proj", "down_proj"}:
        return f"expert weights {sorted(kinds)}: the fused kernel takes gate_up_proj and down_proj, no biases"
    gu, dk, part = kinds["gate_up_proj"], kinds["down_proj"], codec.part
    if gu.join == "concat" and len(gu.parts) == 2:
        (g, g0), (u, u0) = (gu.parts[0], 0), (gu.parts[1], 0)
    elif gu.join == "one":
        (g, g0), (u, u0) = (gu.parts[0], 0), (gu.parts[0], part[gu.parts[0]].shape[0] // 2)
    else:
        return f"gate_up_proj joined by {gu.join!r}: the fused kernel reads gate rows, then up rows"
    if dk.join != "one":
        return f"down_proj joined by {dk.join!r}: the fused kernel reads one down part"
    for name in {g, u, dk.parts[0]}:
        if part[name].fmt.name not in QUANT:
            return (f"{part[name].fmt.name} slots: the fused kernel decodes {', '.join(QUANT)}; "
                    "the torch path dequantizes these")

    def weight(name: str, row0: int) -> Weight:
        fmt, t = part[name].fmt, pool[name]
        return Weight(t, QUANT[fmt.name], t.stride(0), fmt.row_bytes(part[name].shape[-1]), 1, row0)

    inter = part[dk.parts[0]].shape[1]
    return Layout(weight(g, g0), weight(u, u0), weight(dk.parts[0], 0), part[dk.parts[0]].shape[0], inter,
                  pool[g].shape[0], codec.dtype)


def align(rows: torch.Tensor, size: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted into blocks of one pool row each; fixed shapes, no host read.

    rows [T, K] pool rows (outside ``0..size-1``: not computed). Returns ``pair_ids`` int32
    [NB * block_m] (pair index t * K + k, or N = T*K for padding) and ``block_rows`` int32 [NB]
    (-1: an unused block). NB = ceil((N + U * (block_m - 1)) / block_m) with U = min(N, size) is the
    most blocks N pairs can fill (each used row wastes under one block), so the grid follows the
    pairs; vLLM's moe_align_block_size sizes it by the expert count instead.
    """
    flat = rows.reshape(-1).long()                                        # [N]
    N = flat.numel()
    NB = -(-(N + min(N, size) * (block_m - 1)) // block_m)
    valid = (flat >= 0) & (flat < size)
    order, perm = torch.sort(torch.where(valid, flat, size), stable=True)  # [N] rows, pairs by row
    i = torch.arange(N, device=flat.device)
    start = torch.ones(N, dtype=torch.bool, device=flat.device)
    start[1:] = order[1:] != order[:-1]                                   # a row's first pair
    first = torch.cummax(torch.where(start, i, 0), dim=0).values          # [N] its index
    pos = i - first                                                       # rank within the row
    group = torch.cumsum(start.long(), 0) - 1                             # [N] row number 0..U-1
    count = torch.zeros(N, dtype=torch.long, device=flat.device).scatter_add(0, group, torch.ones_like(group))
    blocks = (count + block_m - 1) // block_m                             # per row number
    block = (torch.cumsum(blocks, 0) - blocks)[group] + pos // block_m   # [N] each pair's block
    keep = order < size
    dump = NB * block_m                                                   # where dropped pairs go
    pair_ids = torch.full((dump + 1,), N, dtype=torch.int32, device=flat.device)
    pair_ids.scatter_(0, torch.where(keep, block * block_m + pos % block_m, dump), perm.int())
    block_rows = torch.full((NB + 1,), -1, dtype=torch.int32, device=flat.device)
    block_rows.scatter_(0, torch.where(keep, block, NB), torch.where(keep, order, -1).int())
    return pair_ids[:dump], block_rows[:NB]


def fused_experts(x: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, layout: Layout,
                  block: tuple[int, int, int] = BLOCK) -> torch.Tensor:
    """Experts output [T, H] for x [T, H], routing weights [T, K] and pool rows [T, K] (module doc)."""
    from .fused_kernels import launch

    T, K = rows.shape
    pair_ids, block_rows = align(rows, layout.size, block[0])
    out = launch(x.to(layout.dtype).contiguous(), weights.reshape(-1).contiguous(), pair_ids, block_rows,
                 layout, K, block)                                        # [N, H] float32
    return out.view(T, K, -1).sum(dim=1).to(x.dtype)
