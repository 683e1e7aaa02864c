"""Dequantization on CUDA: the same bits as on the CPU, and no host sync per call.

The runtime dequantizes on the device every step while copies run on another stream, so a call
must only queue kernels. `torch.cuda.set_sync_debug_mode("error")` turns any synchronizing call
(a device read on the host, a blocking host-to-device copy) into an error. Run by
benchmarks/gpu_check.sh (pytest -m gpu).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from quant_fixtures import random_blocks  # noqa: E402

from expertcache.quant.dequant import HOST_COPY_PER_CALL, dequantize, transformers_lacks  # noqa: E402
from expertcache.quant.formats import SUPPORTED  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False); "
                              "run benchmarks/gpu_check.sh on a GPU machine"),
]


@pytest.mark.parametrize("name", SUPPORTED)
def test_cuda_bits_equal_cpu_and_no_sync(name):
    if why := transformers_lacks(name):  # the GPU image's transformers 5.17 has no IQ1_S, ...
        pytest.skip(why)
    shape = (3, 4, 512)  # E, R, C
    blocks = torch.from_numpy(random_blocks(name, 12, 512, np.random.default_rng(1)))
    want = dequantize(blocks, name, shape)
    data = blocks.cuda()
    dequantize(data, name, shape)  # warm-up: per-device tables are copied once
    torch.cuda.synchronize()
    mode = "warn" if name in HOST_COPY_PER_CALL else "error"  # the documented exception
    torch.cuda.set_sync_debug_mode(mode)
    try:
        got = dequantize(data, name, shape)
        got_bf16 = dequantize(data, name, shape, torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))
    assert torch.equal(got_bf16.cpu(), want.to(torch.bfloat16))


def test_hf_layouts_on_cuda_equal_cpu_and_no_sync():
    from expertcache.quant.hf import fp8_block, mxfp4_hf

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 8, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 141, (2, 8, 4), dtype=torch.uint8, generator=g)
    weight = (torch.randn(2, 300, 200, generator=g) * 100).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 3, 2, generator=g) * 1e-2
    cuda = [t.cuda() for t in (blocks, scales, weight, scale_inv)]
    mxfp4_hf(*cuda[:2])  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got_mx = mxfp4_hf(*cuda[:2], torch.float32)
        got_fp8 = fp8_block(*cuda[2:], (128, 128), torch.float32)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got_mx.cpu(), mxfp4_hf(blocks, scales, torch.float32))
    assert torch.equal(got_fp8.cpu(), fp8_block(weight, scale_inv, (128, 128), torch.float32))
