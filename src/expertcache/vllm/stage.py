"""The device step's staging copy on CUDA: a fixed grid that skips the rows nobody missed.

``layer_step`` gives a step ``n = min(T*K, E)`` staging rows (a shape, so that a CUDA graph
can replay it) but only the first ``count`` of them hold experts that missed (a value on
the device). Plain torch would copy all n rows over PCIe every layer step, hits included;
this Triton kernel launches the same fixed grid and returns at once in the rows at or past
``count``, so only the misses cross the bus. ``src`` is the host store read through a
device view of its pinned memory (UVA). Tested with Triton's interpreter on the CPU
(tests/vllm_plugin/test_vllm_stage.py); not run on a GPU in this session.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per program along a row


@triton.jit
def _stage_rows(dst, src, order, count, D, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    if r < tl.load(count):
        expert = tl.load(order + r).to(tl.int64)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < D
        row = tl.load(src + expert * D + offs, mask=mask)
        tl.store(dst + r.to(tl.int64) * D + offs, row, mask=mask)


def stage_rows(dst: torch.Tensor, src: torch.Tensor, order: torch.Tensor, count: torch.Tensor) -> None:
    """dst [n, ...] <- src[order[r]] for r < count; rows at or past count untouched.

    dst: the pool's staging rows (contiguous); src [E, ...] the host store (a device view);
    order [n] int expert ids, needed experts first; count 0-dim int32 on the device.
    """
    n = dst.shape[0]
    D = dst[0].numel()
    _stage_rows[(n, triton.cdiv(D, BLOCK))](dst, src, order, count, D, BLOCK=BLOCK)
