"""The fused MoE kernel's two Triton programs (``runtime/fused.py`` sorts the pairs and calls them).

1. ``gate_up``: per block of pairs routed to one pool row and a column tile of the expert's
   intermediate width I, ``silu(x W_gate^T) * (x W_up^T)`` into ``act`` [N, I] (pair order).
2. ``down``: per block and a column tile of the hidden width H, ``act W_down^T`` times the pair's
   routing weight into ``out`` [N, H] (pair order, float32); the caller sums each token's K rows.

Both read their row's weights where they lie in the pool (float tiles, or ggml blocks decoded in
registers by ``fused_formats.tile``), so a step reads the weights of the rows it uses and nothing
else. Blocks whose row is -1 (the grid is sized for the most blocks N pairs can need) return at
once. Shapes: M = BLOCK_M pairs, BN output columns, BK input columns per step.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .fused_formats import tile


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in float32. UPCAST (Triton's interpreter, whose bf16 dot is wrong on the
    CPU): both sides as float32 first, which holds bf16/fp16 values exactly."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _rounded(x, dtype):
    """``x`` rounded to the compute dtype where the torch path rounds, kept in float32."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _gate_up(x_ptr, pair_ptr, brow_ptr, act_ptr,
             g_ptr, g_slot, g_row, g_col, g_off, u_ptr, u_slot, u_row, u_col, u_off,
             gb_ptr, gb_slot, gb_step, gb_off, ub_ptr, ub_slot, ub_step, ub_off, alpha, limit,
             H, I, top_k, num_pairs,
             FMT_G: tl.constexpr, FMT_U: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
             PREC: tl.constexpr, UPCAST: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(brow_ptr + b).to(tl.int64)
    if row < 0:
        return
    pairs = tl.load(pair_ptr + b * BM + tl.arange(0, BM))          # [BM] pair ids, N = padding
    pmask = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)                    # [BN] intermediate columns
    nmask = n < I
    n64 = n.to(tl.int64)
    g_rows = (row * g_slot + g_off + n64 * g_row)[None, :]          # [1, BN]
    u_rows = (row * u_slot + u_off + n64 * u_row)[None, :]
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < H
        xt = tl.load(x_ptr + tokens[:, None] * H + k[None, :], mask=pmask[:, None] & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & nmask[None, :]
        wg = tile(g_ptr, g_rows, k[:, None], k0, g_col, wmask, nmask[None, :], FMT_G).to(xt.dtype)  # [BK, BN]
        acc_g += _dot(xt, wg, PREC, UPCAST)
        wu = tile(u_ptr, u_rows, k[:, None], k0, u_col, wmask, nmask[None, :], FMT_U).to(xt.dtype)
        acc_u += _dot(xt, wu, PREC, UPCAST)
    # rounded where the torch path rounds: each projection, its bias sum, each step of the gate
    dtype = act_ptr.dtype.element_ty
    gate = _rounded(acc_g, dtype)
    up = _rounded(acc_u, dtype)
    if HAS_BIAS:
        gb = tl.load(gb_ptr + row * gb_slot + gb_off + n64 * gb_step, mask=nmask, other=0.0)
        ub = tl.load(ub_ptr + row * ub_slot + ub_off + n64 * ub_step, mask=nmask, other=0.0)
        gate = _rounded(gate + _rounded(gb, dtype)[None, :], dtype)
        up = _rounded(up + _rounded(ub, dtype)[None, :], dtype)
    if ACT == 0:   # silu(gate) * up
        h = _rounded(gate * tl.sigmoid(gate), dtype) * up
    else:          # GPT-OSS: (clamp(up) + 1) * clamp(gate) * sigmoid(alpha * clamp(gate))
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        glu = _rounded(gate * _rounded(tl.sigmoid(_rounded(gate * alpha, dtype)), dtype), dtype)
        h = _rounded(up + 1.0, dtype) * glu
    tl.store(act_ptr + pairs.to(tl.int64)[:, None] * I + n[None, :], h.to(dtype),
             mask=pmask[:, None] & nmask[None, :])


@triton.jit
def _down(act_ptr, pair_ptr, brow_ptr, tw_ptr, out_ptr,
          d_ptr, d_slot, d_row, d_col, d_off, db_ptr, db_slot, db_step, db_off,
          H, I, num_pairs,
          FMT_D: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(brow_ptr + b).to(tl.int64)
    if row < 0:
        return
    pairs = tl.load(pair_ptr + b * BM + tl.arange(0, BM))
    pmask = pairs < num_pairs
    p64 = pairs.to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)                    # [BN] hidden columns
    nmask = n < H
    n64 = n.to(tl.int64)
    d_rows = (row * d_slot + d_off + n64 * d_row)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < I
        a = tl.load(act_ptr + p64[:, None] * I + k[None, :], mask=pmask[:, None] & kmask[None, :], other=0.0)
        w = tile(d_ptr, d_rows, k[:, None], k0, d_col, kmask[:, None] & nmask[None, :], nmask[None, :], FMT_D).to(a.dtype)
        acc += _dot(a, w, PREC, UPCAST)
    dtype = act_ptr.dtype.element_ty
    y = _rounded(acc, dtype)                                         # the down output, rounded
    if HAS_BIAS:
        db = tl.load(db_ptr + row * db_slot + db_off + n64 * db_step, mask=nmask, other=0.0)
        y = _rounded(y + _rounded(db, dtype)[None, :], dtype)
    tw = tl.load(tw_ptr + pairs, mask=pmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + p64[:, None] * H + n[None, :], y * tw[:, None], mask=pmask[:, None] & nmask[None, :])


def launch(x: torch.Tensor, topk_weights: torch.Tensor, pair_ids: torch.Tensor, block_rows: torch.Tensor,
           layout, top_k: int, block: tuple[int, int, int]) -> torch.Tensor:
    """Both programs over ``block_rows`` [NB] blocks of ``pair_ids`` [NB * BM]; -> float32 [N, H]
    of weighted expert outputs in pair order (0 for pairs no block holds)."""
    BM, BN, BK = block
    N, H, I = topk_weights.numel(), layout.hidden, layout.inter
    act = torch.empty(N, I, dtype=x.dtype, device=x.device)
    out = torch.zeros(N, H, dtype=torch.float32, device=x.device)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 slots: no TF32 rounding
    upcast = os.environ.get("TRITON_INTERPRET") == "1"
    g, u, d, gate = layout.gate, layout.up, layout.down, layout.act
    bias = layout.biases is not None
    gb, ub, db = layout.biases if bias else (_NO_BIAS(x),) * 3
    NB = block_rows.shape[0]
    _gate_up[(NB, triton.cdiv(I, BN))](
        x, pair_ids, block_rows, act, g.tensor, g.slot, g.row, g.col, g.off, u.tensor, u.slot, u.row, u.col, u.off,
        gb.tensor, gb.slot, gb.step, gb.off, ub.tensor, ub.slot, ub.step, ub.off, gate.alpha, gate.limit,
        H, I, top_k, N, FMT_G=g.fmt, FMT_U=u.fmt, HAS_BIAS=bias, ACT=gate.act, PREC=prec, UPCAST=upcast,
        BM=BM, BN=BN, BK=BK)
    _down[(NB, triton.cdiv(H, BN))](
        act, pair_ids, block_rows, topk_weights, out, d.tensor, d.slot, d.row, d.col, d.off,
        db.tensor, db.slot, db.step, db.off, H, I, N, FMT_D=d.fmt, HAS_BIAS=bias, PREC=prec, UPCAST=upcast,
        BM=BM, BN=BN, BK=BK)
    return out


class _NO_BIAS:
    """A stand-in bias argument for layouts without biases (HAS_BIAS=False: never read)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.tensor, self.slot, self.step, self.off = x, 0, 0, 0
