"""Weight tiles for the fused MoE kernel (``runtime/fused_kernels.py``), decoded in registers.

Each loader returns float32 ``[BK, BN]``: input columns ``k`` [BK, 1] by output rows of one
expert, ``rowp`` [1, BN] (pointers to each row's first element or byte). Quantized rows are ggml
blocks along the row, as the slots hold them; each element finds its block, its bytes and its
scales itself, so a tile may start anywhere in a row and no block is ever written out decoded.
The arithmetic mirrors ``quant/kernels.py`` (itself equal to gguf-py bit for bit): the same float32
products, so the only difference left is the order of the matmul's sums.

Imports Triton: only ``fused_kernels.py`` imports this module, and only once Triton is known there.
"""

from __future__ import annotations

import triton
import triton.language as tl

# format ids, the ``FMT`` constexpr of the kernels (runtime/fused.py maps names to them); globals a
# kernel reads must be tl.constexpr (the compiler refuses plain ints, the interpreter does not)
FLOAT, Q8_0, Q4_K, Q6_K, Q5_K, MXFP4 = (tl.constexpr(i) for i in range(6))


@triton.jit
def _u8(p, mask):
    """Bytes at ``p`` as int32 (masked lanes read 0)."""
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(p, mask):
    """The little-endian fp16 at ``p`` as float32."""
    bits = _u8(p, mask) | (_u8(p + 1, mask) << 8)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _i8(p, mask):
    """The signed byte at ``p`` as float32."""
    b = _u8(p, mask)
    return tl.where(b > 127, b - 256, b).to(tl.float32)


@triton.jit
def _scale_min_k4(s, j, mask):
    """Q4_K/Q5_K's 6-bit scale and min of sub-block ``j`` (0..7) from the 12 bytes at ``s``
    (ggml's get_scale_min_k4)."""
    lo = j < 4
    s_j = _u8(s + j, mask)
    s_j4 = _u8(s + j + 4, mask)
    s_jm4 = _u8(s + tl.where(lo, j, j - 4), mask)
    sc = tl.where(lo, s_j & 63, (s_j4 & 0xF) | ((s_jm4 >> 6) << 4))
    mn = tl.where(lo, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def q8_0(rowp, k, mask):
    # 34 bytes a block of 32: fp16 d, 32 int8
    p = rowp + (k // 32) * 34
    return _f16(p, mask) * _i8(p + 2 + k % 32, mask)


@triton.jit
def _k_block(rowp, k, k0, BYTES: tl.constexpr):
    """The 256-element block a K-quant tile lies in: its bytes per row ``p`` [1, BN] and each
    column's index in it ``i`` [BK, 1]. A tile never straddles two blocks (k0 is a multiple of BK,
    which divides 256), so the block's fp16 fields load once per row, not once per element."""
    tl.static_assert(tl.constexpr(256) % k.shape[0] == 0)
    b = k0 // 256
    return rowp + b * BYTES, k - b * 256


@triton.jit
def q4_k(rowp, k, k0, mask):
    # 144 bytes a block of 256: fp16 d, fp16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles;
    # sub-block j (32 elements) is the low (j even) or high nibbles of bytes 32*(j//2)..+31.
    # mask [1, BN]: the rows (K-quant rows are whole blocks: every column of a tile is in range)
    p, i = _k_block(rowp, k, k0, 144)
    j = i // 32
    q = (_u8(p + 16 + (j // 2) * 32 + i % 32, mask) >> ((j % 2) * 4)) & 0xF
    sc, mn = _scale_min_k4(p + 4, j, mask)
    return (_f16(p, mask) * sc) * q.to(tl.float32) - _f16(p + 2, mask) * mn


@triton.jit
def q5_k(rowp, k, k0, mask):
    # 176 bytes: fp16 d, fp16 dmin, 12 bytes of scales/mins, 32 bytes of fifth bits (bit j of
    # byte l for element 32j + l), 128 bytes of nibbles as Q4_K's
    p, i = _k_block(rowp, k, k0, 176)
    j = i // 32
    low = (_u8(p + 48 + (j // 2) * 32 + i % 32, mask) >> ((j % 2) * 4)) & 0xF
    high = (_u8(p + 16 + i % 32, mask) >> j) & 1
    sc, mn = _scale_min_k4(p + 4, j, mask)
    return (_f16(p, mask) * sc) * (low | (high << 4)).to(tl.float32) - _f16(p + 2, mask) * mn


@triton.jit
def q6_k(rowp, k, k0, mask):
    # 210 bytes: 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8 scales, fp16 d.
    # Element 128h + r: low nibble of byte 64h + r%64 (shifted by 4 for r >= 64), high pair of
    # byte 128 + 32h + r%32 (shifted by 2 * (r // 32)); scale i // 16
    p, i = _k_block(rowp, k, k0, 210)
    h = i // 128
    r = i % 128
    low = (_u8(p + h * 64 + r % 64, mask) >> ((r // 64) * 4)) & 0xF
    high = (_u8(p + 128 + h * 32 + r % 32, mask) >> ((r // 32) * 2)) & 3
    q = (low | (high << 4)) - 32
    return (_f16(p + 208, mask) * _i8(p + 192 + i // 16, mask)) * q.to(tl.float32)


@triton.jit
def mxfp4(rowp, k, mask):
    # 17 bytes a block of 32: an E8M0 exponent, then element j in the low nibble of byte j and
    # element j + 16 in its high nibble. Values: FP4 E2M1 doubled (0 1 2 3 4 6 8 12, bit 3 the
    # sign) times half the exponent's scale, as ggml (kvalues_mxfp4, ggml_e8m0_to_fp32_half)
    p = rowp + (k // 32) * 17
    i = k % 32
    byte = _u8(p + 1 + i % 16, mask)
    nib = tl.where(i < 16, byte & 0xF, byte >> 4)
    mag = nib & 7
    big = (2 + (mag & 1)) << tl.maximum((mag >> 1) - 1, 0)   # 4 6 8 12 for mag 4..7
    value = tl.where(mag < 4, mag, big).to(tl.float32)
    value = tl.where(nib >= 8, -value, value)
    e = _u8(p, mask)
    bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)  # e < 2: the subnormals 2^-128, 2^-127
    return bits.to(tl.float32, bitcast=True) * value


@triton.jit
def tile(ptr, rowp_offs, k, k0, col_stride, mask, nmask, FMT: tl.constexpr):
    """One weight tile [BK, BN] as float32 (FLOAT: in the pool's own dtype): columns ``k`` [BK, 1]
    from ``k0`` (a multiple of BK), rows ``rowp_offs`` [1, BN]; ``mask`` [BK, BN], ``nmask`` [1, BN]
    the rows alone."""
    if FMT == FLOAT:
        w = tl.load(ptr + rowp_offs + k.to(tl.int64) * col_stride, mask=mask, other=0.0)
    elif FMT == Q8_0:
        w = q8_0(ptr + rowp_offs, k, mask)
    elif FMT == Q4_K:
        w = q4_k(ptr + rowp_offs, k, k0, nmask)
    elif FMT == Q6_K:
        w = q6_k(ptr + rowp_offs, k, k0, nmask)
    elif FMT == Q5_K:
        w = q5_k(ptr + rowp_offs, k, k0, nmask)
    else:
        w = mxfp4(ptr + rowp_offs, k, mask)
    return w
