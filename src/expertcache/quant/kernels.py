"""Block dequantizers written here: each mirrors gguf-py's numpy `dequantize_blocks` operation
for operation (same float32 products in the same order), so the results are equal bit for bit.

Why not transformers' versions of these types: they build small shift and level tensors from
Python tuples on every call (`torch.tensor(..., device=data.device)`), and on CUDA each of those
is a pageable host-to-device copy that waits for the stream. Here constants are made on the device
(`torch.arange`) or cached per device once, so a call on a GPU only queues kernels.

Every function takes `blocks [N, block_bytes]` uint8 (N blocks) and returns float32
`[N, block_elements]`.
"""

from __future__ import annotations

import torch

# ggml's kvalues_iq4nl: the 16 levels an IQ4 nibble indexes
_IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# ggml's kvalues_mxfp4: the FP4 E2M1 values doubled, indexed by the nibble (bit 3 is the sign);
# ggml pairs them with half the E8M0 scale (ggml_e8m0_to_fp32_half), and so do we
_MXFP4_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A float32 lookup table on `device`, copied there once per process."""
    key = (name, device)
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return _TABLES[key]


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of each block, as float32 `[N, 1]`."""
    return blocks[:, start:start + 2].view(torch.float16).float()


def _fields(x: torch.Tensor, step: int, count: int) -> torch.Tensor:
    """`x [..., W]` -> `[..., count, W]`: x >> (step * i) for i < count (shifts made on device)."""
    shift = torch.arange(0, step * count, step, device=x.device, dtype=x.dtype)
    return x.unsqueeze(-2) >> shift.reshape(count, 1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """`[N, 16]` bytes -> `[N, 32]`: low nibbles are elements 0-15, high nibbles 16-31."""
    return torch.cat([qs & 0xF, qs >> 4], dim=1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """`[N, 4]` bytes of a little-endian uint32 -> its 32 bits `[N, 32]`, bit i for element i."""
    return (_fields(qh.unsqueeze(-1), 1, 8) & 1).reshape(qh.shape[0], 32)  # [N, 4, 8, 1]


def q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # 18 bytes: fp16 d, 16 bytes of nibbles
    return _half(blocks, 0) * (_nibbles(blocks[:, 2:18]).to(torch.int8) - 8).float()


def q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles
    return _half(blocks, 0) * _nibbles(blocks[:, 4:20]).float() + _half(blocks, 2)


def q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # 22 bytes: fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles
    q = _nibbles(blocks[:, 6:22]) | (_bits32(blocks[:, 2:6]) << 4)
    return _half(blocks, 0) * (q.to(torch.int8) - 16).float()


def q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # 24 bytes: fp16 d, fp16 m, 4 bytes of fifth bits, 16 bytes of nibbles
    q = _nibbles(blocks[:, 8:24]) | (_bits32(blocks[:, 4:8]) << 4)
    return _half(blocks, 0) * q.float() + _half(blocks, 2)


def q2_k(blocks: torch.Tensor) -> torch.Tensor:
    # 84 bytes: 16 scale/min bytes, 64 bytes of 2-bit quants, fp16 d, fp16 dmin
    n = blocks.shape[0]
    scales, qs = blocks[:, 0:16], blocks[:, 16:80]
    dl = (_half(blocks, 80) * (scales & 0xF).float()).reshape(n, 16, 1)
    ml = (_half(blocks, 82) * (scales >> 4).float()).reshape(n, 16, 1)
    q = (_fields(qs.reshape(n, 2, 32), 2, 4) & 3).reshape(n, 16, 16).float()  # 16 groups of 16
    return (dl * q - ml).reshape(n, 256)


def q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # 110 bytes: 32 bytes high-bit mask, 64 bytes of 2-bit quants, 12 bytes of 6-bit scales, fp16 d
    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, 0:32], blocks[:, 32:96], blocks[:, 96:108]
    low = torch.cat([scales[:, :8] & 0xF, scales[:, :8] >> 4], dim=1)  # [N, 16]
    high = (_fields(scales[:, 8:12], 2, 4) & 3).reshape(n, 16)
    sc = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (_half(blocks, 108) * sc).reshape(n, 16, 1)
    ql = (_fields(qs.reshape(n, 2, 32), 2, 4) & 3).reshape(n, 16, 16)
    # the high bit is an inverted borrow: 4 is subtracted where the mask bit is clear
    qh = ((_fields(hmask, 1, 8) & 1) ^ 1).reshape(n, 16, 16)
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, 256)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit scales and mins -> two `[N, 8]` (get_scale_min_k4)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.float(), mn.float()


def q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # 144 bytes: fp16 d, fp16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles
    n = blocks.shape[0]
    sc, mn = _k_scale_min(blocks[:, 4:16])
    d = (_half(blocks, 0) * sc).reshape(n, 8, 1)
    dm = (_half(blocks, 2) * mn).reshape(n, 8, 1)
    q = (_fields(blocks[:, 16:144].reshape(n, 4, 32), 4, 2) & 0xF).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, 256)


def q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # 176 bytes: fp16 d, fp16 dmin, 12 bytes of scales/mins, 32 bytes of fifth bits, 128 of nibbles
    n = blocks.shape[0]
    sc, mn = _k_scale_min(blocks[:, 4:16])
    d = (_half(blocks, 0) * sc).reshape(n, 8, 1)
    dm = (_half(blocks, 2) * mn).reshape(n, 8, 1)
    ql = (_fields(blocks[:, 48:176].reshape(n, 4, 32), 4, 2) & 0xF).reshape(n, 8, 32)
    qh = (_fields(blocks[:, 16:48], 1, 8) & 1).reshape(n, 8, 32)
    return (d * (ql | (qh << 4)).float() - dm).reshape(n, 256)


def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # 210 bytes: 128 bytes low nibbles, 64 bytes high pairs, 16 int8 scales, fp16 d
    n = blocks.shape[0]
    d = (_half(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()).reshape(n, 16, 1)
    ql = (_fields(blocks[:, 0:128].reshape(n, 2, 64), 4, 2) & 0xF).reshape(n, 8, 32)
    qh = (_fields(blocks[:, 128:192].reshape(n, 2, 32), 2, 4) & 3).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, 256)


def iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    # 18 bytes: fp16 d, 16 bytes of nibbles indexing the IQ4 levels
    levels = _table("iq4", _IQ4_LEVELS, blocks.device)
    return _half(blocks, 0) * levels[_nibbles(blocks[:, 2:18]).long()]


def iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # 136 bytes: fp16 d, uint16 of high scale pairs, 4 bytes of low scale nibbles, 128 of nibbles
    n = blocks.shape[0]
    low = (_fields(blocks[:, 4:8].unsqueeze(-1), 4, 2) & 0xF).reshape(n, 8)  # low, high per byte
    high_word = blocks[:, 2].to(torch.int32) | (blocks[:, 3].to(torch.int32) << 8)  # [N]
    high = (_fields(high_word.unsqueeze(-1), 2, 8) & 3).reshape(n, 8).to(torch.uint8)
    dl = (_half(blocks, 0) * ((low | (high << 4)).to(torch.int8) - 32).float()).reshape(n, 8, 1)
    nib = (_fields(blocks[:, 8:136].reshape(n, 8, 16), 4, 2) & 0xF).reshape(n, 8, 32)
    levels = _table("iq4", _IQ4_LEVELS, blocks.device)
    return (dl * levels[nib.long()]).reshape(n, 256)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents -> 2^(e-127) / 2 in float32, from bits as ggml_e8m0_to_fp32_half:
    e < 2 gives the subnormals 2^-128 and 2^-127, which a float exponent field cannot hold."""
    e = e.to(torch.int32)
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


def mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    # 17 bytes: one E8M0 exponent, then element j in the low nibble of byte j and element j + 16
    # in its high nibble (ggml's order; HF's GPT-OSS checkpoints pair even/odd elements instead)
    values = _table("mxfp4", _MXFP4_DOUBLED, blocks.device)[_nibbles(blocks[:, 1:17]).long()]
    return _e8m0_half(blocks[:, :1]) * values


BY_NAME = {
    "Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1,
    "Q2_K": q2_k, "Q3_K": q3_k, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k,
    "IQ4_NL": iq4_nl, "IQ4_XS": iq4_xs, "MXFP4": mxfp4,
}
