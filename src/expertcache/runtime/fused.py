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

What it computes: SiLU-gated experts (``silu(gate) * up``: Qwen, Mixtral, OLMoE, DeepSeek-V3) and
GPT-OSS's clamped GLU on interleaved gate/up rows, with or without biases, float or ``[in, out]``
(transposed) slots; the gate is probed on the module (``module_gate``), never assumed from a name.
Anything else (ungated experts, a post-expert norm, other clamps, FP8 and the other GGUF types)
keeps the torch path, and ``layout_for`` says why (``stats().pool["expert_kernel_reason"]``). Triton is
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


SILU, GPT_OSS = 0, 1  # the ACT constexpr: silu(gate) * up; GPT-OSS's clamped GLU, (up + 1) * glu
FLOAT_PARTS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # quantized slots' biases


@dataclass(frozen=True)
class Gate:
    """How an experts module turns gate/up outputs into the activation (probed, ``module_gate``)."""

    act: int                 # SILU or GPT_OSS
    interleaved: bool        # a fused gate_up's gate rows are the even ones (GPT-OSS), else the first half
    alpha: float = 0.0       # GPT-OSS: glu = gate * sigmoid(alpha * gate)
    limit: float = 0.0       # GPT-OSS: gate <= limit, |up| <= limit


@dataclass(frozen=True)
class Weight:
    """One projection in the pool: ``tensor`` [S, ...], pool rows ``slot`` apart; output row n at
    ``off + n * row``, input column k ``k * col`` further (float; quantized rows are ggml blocks
    and ``off``/``row`` count bytes)."""

    tensor: torch.Tensor
    fmt: int
    slot: int
    row: int
    col: int
    off: int = 0


@dataclass(frozen=True)
class Bias:
    """One bias in the pool: ``tensor`` [S, ...] float, pool rows ``slot`` apart, output n at
    ``off + n * step``."""

    tensor: torch.Tensor
    slot: int
    step: int = 1
    off: int = 0


@dataclass(frozen=True)
class Layout:
    """The three projections of one layer's experts in the pool, their biases, their sizes."""

    gate: Weight
    up: Weight
    down: Weight
    hidden: int
    inter: int
    size: int             # pool rows: ids at or past it are not computed here
    dtype: torch.dtype    # the compute dtype (activations, the matmul inputs)
    act: Gate
    biases: tuple[Bias, Bias, Bias] | None = None   # gate, up, down


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
    if not pool:
        return "no slots"
    refusal = device_refusal(next(iter(pool.values())).device)
    if refusal is not None:
        return refusal
    gate = module_gate(module)
    if isinstance(gate, str):
        return gate
    return float_layout(pool, transposed, gate) if codec is None else quant_layout(pool, codec, gate)


_GATES: dict[tuple, Gate | str] = {}


def _gpt_oss(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def module_gate(module: torch.nn.Module) -> Gate | str:
    """What ``module``'s gate computes (``Gate``), or why the kernel does not compute it. Probed once
    per class and parameters, on values past any clamp: SiLU-gated (Qwen, Mixtral, OLMoE,
    DeepSeek-V3) or GPT-OSS's clamped GLU on interleaved rows; anything else (DeepSeek-V4's clamps,
    ungated experts, a post-expert norm) keeps the torch path."""
    name = type(module).__name__
    if not getattr(module, "has_gate", True):
        return f"{name} is ungated (act_fn on up_proj): the fused kernel computes gated experts"
    if getattr(module, "has_post_expert_norm", False):
        return f"{name} has a post-expert norm, which the fused kernel does not apply"
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    key = (type(module), alpha, limit)
    if key not in _GATES:
        z = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)) * 12  # past GPT-OSS's limit 7
        try:
            got = module._apply_gate(z)
        except Exception:  # noqa: BLE001  any failure means: not a gate the kernel computes
            got = None

        def same(want: torch.Tensor) -> bool:
            return got is not None and got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)

        _GATES[key] = f"{name}'s gate is neither silu(gate) * up nor GPT-OSS's clamped GLU: the torch path computes it"
        if same(torch.nn.functional.silu(z[:, :8]) * z[:, 8:]):
            _GATES[key] = Gate(SILU, False)
        elif isinstance(alpha, (int, float)) and isinstance(limit, (int, float)) and \
                same(_gpt_oss(z[:, ::2], z[:, 1::2], alpha, limit)):
            _GATES[key] = Gate(GPT_OSS, True, float(alpha), float(limit))
    return _GATES[key]


def module_refusal(module: torch.nn.Module) -> str | None:
    """Why the kernel does not compute ``module``'s experts, or None."""
    gate = module_gate(module)
    return gate if isinstance(gate, str) else None


def _fused_rows(rows: int, row: int, gate: Gate) -> tuple[int, int, int]:
    """(row step, gate offset, up offset) of one tensor holding gate and up rows (``rows`` of them,
    ``row`` apart): interleaved, or gate rows then up rows."""
    return (2 * row, 0, row) if gate.interleaved else (row, 0, rows // 2 * row)


def float_layout(pool: dict[str, torch.Tensor], transposed: bool, gate: Gate = Gate(SILU, False)) -> Layout | str:
    """The layout of float slots (``gate_up_proj`` [S, 2I, H], ``down_proj`` [S, H, I]; transposed:
    [S, H, 2I] and [S, I, H]; biases ``gate_up_proj_bias`` [S, 2I], ``down_proj_bias`` [S, H]), or
    why the kernel refuses them."""
    names = {"gate_up_proj", "down_proj"}
    if not names <= set(pool) <= names | {"gate_up_proj_bias", "down_proj_bias"}:
        return f"pool kinds {sorted(pool)}: the fused kernel takes gate_up_proj and down_proj (and their biases)"
    gu, d = pool["gate_up_proj"], pool["down_proj"]
    if gu.dtype not in FLOAT_DTYPES or d.dtype != gu.dtype:
        return f"slots of {gu.dtype}: the fused kernel takes float32, float16 or bfloat16 slots"
    o, i = (2, 1) if transposed else (1, 2)                 # dims of output rows, input columns
    inter, hidden = gu.shape[o] // 2, gu.shape[i]
    step, g0, u0 = _fused_rows(gu.shape[o], gu.stride(o), gate)
    up_gate = [Weight(gu, 0, gu.stride(0), step, gu.stride(i), off) for off in (g0, u0)]
    down = Weight(d, 0, d.stride(0), d.stride(o), d.stride(i))
    biases = None
    if "gate_up_proj_bias" in pool or "down_proj_bias" in pool:
        def bias(name: str, width: int) -> torch.Tensor:  # a missing one: zeros (made only then)
            return pool[name] if name in pool else gu.new_zeros(gu.shape[0], width)

        gub, db = bias("gate_up_proj_bias", 2 * inter), bias("down_proj_bias", hidden)
        bstep, b0, b1 = _fused_rows(2 * inter, 1, gate)
        biases = (Bias(gub, gub.stride(0), bstep, b0), Bias(gub, gub.stride(0), bstep, b1), Bias(db, db.stride(0)))
    return Layout(*up_gate, down, hidden, inter, gu.shape[0], gu.dtype, gate, biases)


def quant_layout(pool: dict[str, torch.Tensor], codec, gate: Gate = Gate(SILU, False)) -> Layout | str:
    """The layout of quantized slots (``pool[part]`` [S, bytes], one layer's ``codec``:
    ``runtime/quantized.py``), or why the kernel refuses them."""
    kinds = {k.name: k for k in codec.kinds}
    names = {"gate_up_proj", "down_proj"}
    if not names <= set(kinds) <= names | {"gate_up_proj_bias", "down_proj_bias"}:
        return f"expert weights {sorted(kinds)}: the fused kernel takes gate_up_proj and down_proj (and their biases)"
    gu, dk, part = kinds["gate_up_proj"], kinds["down_proj"], codec.part
    two = "interleave" if gate.interleaved else "concat"  # the join whose rows the module's gate reads
    if (gu.join not in ("one", two) or (gu.join == two) != (len(gu.parts) == 2) or dk.join != "one"
            or any(k.join not in ("one", two) for k in kinds.values())):
        return (f"joins {sorted({k.join for k in kinds.values()})} with "
                f"{'interleaved' if gate.interleaved else 'first-half'} gate rows: the fused kernel reads "
                "gate and up parts, or one part of both")
    weights = [part[p] for k in (gu, dk) for p in k.parts]
    if any(p.fmt.name not in QUANT for p in weights):
        return (f"{', '.join(sorted({p.fmt.name for p in weights}))} slots: the fused kernel decodes "
                f"{', '.join(QUANT)}; the torch path dequantizes these")

    def weight(name: str, step: int | None = None, off: int = 0) -> Weight:
        fmt, t = part[name].fmt, pool[name]
        rb = fmt.row_bytes(part[name].shape[-1])
        return Weight(t, QUANT[fmt.name], t.stride(0), rb if step is None else step * rb, 1, off * rb)

    if gu.join == "one":
        step, g0, u0 = _fused_rows(part[gu.parts[0]].shape[0], 1, gate)
        up_gate = [weight(gu.parts[0], step, g0), weight(gu.parts[0], step, u0)]
    else:
        up_gate = [weight(gu.parts[0]), weight(gu.parts[1])]
    biases = _quant_biases(pool, kinds, part, gate)
    if isinstance(biases, str):
        return biases
    d = part[dk.parts[0]]
    return Layout(*up_gate, weight(dk.parts[0]), d.shape[0], d.shape[1], pool[dk.parts[0]].shape[0], codec.dtype,
                  gate, biases)


def _quant_biases(pool, kinds, part, gate: Gate):
    """The biases of quantized slots (float parts, viewed in their own dtype), None, or a refusal."""
    if "gate_up_proj_bias" not in kinds and "down_proj_bias" not in kinds:
        return None
    if not {"gate_up_proj_bias", "down_proj_bias"} <= set(kinds):
        return "a gate_up or down bias without the other: the fused kernel takes both"
    names = kinds["gate_up_proj_bias"].parts + kinds["down_proj_bias"].parts
    if any(part[n].fmt.name not in FLOAT_PARTS for n in names):
        return f"bias parts in {sorted({part[n].fmt.name for n in names})}: the fused kernel reads float biases"
    view = {n: pool[n].view(FLOAT_PARTS[part[n].fmt.name]) for n in names}
    if len(names) == 3:                                   # gate, up, down: one part each
        return tuple(Bias(view[n], view[n].stride(0)) for n in names)
    step, b0, b1 = _fused_rows(part[names[0]].shape[0], 1, gate)
    gub, db = view[names[0]], view[names[1]]
    return Bias(gub, gub.stride(0), step, b0), Bias(gub, gub.stride(0), step, b1), Bias(db, db.stride(0))


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
