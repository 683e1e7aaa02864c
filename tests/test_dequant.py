"""Torch dequantization equals gguf-py's numpy reference bit for bit, for every supported type.

Also: other output dtypes are the float32 result cast; bad input fails with a clear ValueError;
the HF-native layouts (GPT-OSS MXFP4, block FP8) equal transformers' own dequantization; the
library internals we build on keep their module path and signature; formats.py stays torch-free.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from quant_fixtures import random_blocks, write_tensor  # noqa: E402

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from expertcache.quant import kernels  # noqa: E402
from expertcache.quant.dequant import HOST_COPY_PER_CALL, dequantize  # noqa: E402
from expertcache.quant.formats import SUPPORTED, check_supported, quant_format  # noqa: E402


def reference(blocks: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """gguf-py's float32 dequantization, shaped like ours."""
    qtype = gguf.GGMLQuantizationType[name]
    return gguf.quants.dequantize(blocks, qtype).reshape(shape)


def assert_bits_equal(got: torch.Tensor, want: np.ndarray) -> None:
    """Equal as float32 bit patterns: -0.0 vs 0.0 or one ulp would fail."""
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    got_bits, want_bits = got.numpy().view(np.uint32), want.astype(np.float32).view(np.uint32)
    bad = int((got_bits != want_bits).sum())
    assert bad == 0, f"{bad} of {want.size} values differ"


# (rows, cols): one block, several blocks per row, many rows; K/IQ types need cols % 256 == 0
SHAPES = [(1, 256), (3, 512), (16, 768)]


@pytest.mark.parametrize("name", SUPPORTED)
@pytest.mark.parametrize("quantized", [True, False], ids=["gguf-quantized", "random-bytes"])
def test_bit_exact_vs_gguf_py(name, quantized):
    rng = np.random.default_rng(zlib.crc32(f"{name}{quantized}".encode()))
    for rows, cols in SHAPES:
        blocks = random_blocks(name, rows, cols, rng, quantize_floats=quantized)
        got = dequantize(torch.from_numpy(blocks), name, (rows, cols))
        assert_bits_equal(got, reference(blocks, name, (rows, cols)))


@pytest.mark.parametrize("name", SUPPORTED)
def test_bit_exact_3d_expert_tensor(name):
    # [E, R, C] as GGUF stores ffn_*_exps, given as a flat byte buffer; one expert's slice too
    experts, rows, cols = 3, 4, 512
    rng = np.random.default_rng(7)
    blocks = random_blocks(name, experts * rows, cols, rng, quantize_floats=False)
    want = reference(blocks, name, (experts, rows, cols))
    data = torch.from_numpy(blocks).reshape(-1)
    assert_bits_equal(dequantize(data, name, (experts, rows, cols)), want)
    per_expert = quant_format(name).nbytes((rows, cols))
    one = data[per_expert: 2 * per_expert]  # expert 1: a slice at a byte offset, as a slot holds it
    assert_bits_equal(dequantize(one, name, (rows, cols)), want[1])


def test_mxfp4_extreme_exponents():
    # E8M0 0 and 1 are float32 subnormals in ggml's half-scale; 254 is the largest normal
    rng = np.random.default_rng(3)
    blocks = random_blocks("MXFP4", 6, 64, rng, quantize_floats=False).reshape(6, 2, 17)
    blocks[:, 0, 0] = [0, 1, 2, 126, 127, 254]
    blocks[:, 1, 0] = [128, 3, 200, 50, 253, 1]
    blocks = blocks.reshape(6, 34)
    with np.errstate(over="ignore"):  # 2^126 * 12 is inf in both, and must stay so
        want = reference(blocks, "MXFP4", (6, 64))
    assert np.isinf(want).any()
    assert_bits_equal(dequantize(torch.from_numpy(blocks), "MXFP4", (6, 64)), want)


@pytest.mark.parametrize("name", ["F32", "F16", "Q8_0", "Q4_K", "MXFP4"])
def test_unaligned_start(name):
    # bytes that start at an odd address (a slice of a mapped file) still read as fp16/fp32
    rng = np.random.default_rng(4)
    blocks = random_blocks(name, 2, 256, rng)
    buf = torch.zeros(blocks.size + 1, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(blocks.reshape(-1))
    assert_bits_equal(dequantize(buf[1:], name, (2, 256)), reference(blocks, name, (2, 256)))


def test_mxfp4_is_ggml_nibble_order():
    # one block, scale byte 128 (gguf-py's half scale: 1.0 * doubled values = the E2M1 values x 2)
    qs = np.zeros(16, np.uint8)
    qs[0] = 0x72  # element 0 <- nibble 2 (1.0), element 16 <- nibble 7 (6.0)
    qs[1] = 0x09  # element 1 <- nibble 9 (-0.5)
    block = torch.from_numpy(np.concatenate([[128], qs]).astype(np.uint8))
    out = dequantize(block, "MXFP4", (32,))
    assert out[0].item() == 2.0 and out[16].item() == 12.0 and out[1].item() == -1.0
    assert out[2:16].abs().sum().item() == 0 and out[17:].abs().sum().item() == 0


@pytest.mark.parametrize("name", ["F16", "BF16", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "MXFP4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_output_is_float32_cast(name, dtype):
    rng = np.random.default_rng(11)
    data = torch.from_numpy(random_blocks(name, 4, 256, rng))
    want = dequantize(data, name, (4, 256)).to(dtype)
    got = dequantize(data, name, (4, 256), dtype=dtype)
    assert got.dtype == dtype
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_accepts_every_spelling_of_a_type():
    rng = np.random.default_rng(5)
    data = torch.from_numpy(random_blocks("Q4_0", 2, 64, rng))
    want = dequantize(data, "Q4_0", (2, 64))
    for spelling in ("q4_0", 2, gguf.GGMLQuantizationType.Q4_0, quant_format("Q4_0")):
        assert torch.equal(dequantize(data, spelling, (2, 64)), want)


def test_rejects_non_uint8_data():
    with pytest.raises(ValueError, match="uint8"):
        dequantize(torch.zeros(34, dtype=torch.int8), "Q8_0", (32,))


def test_rejects_wrong_byte_count():
    with pytest.raises(ValueError, match=r"Q8_0 tensor of shape \(2, 32\) takes 68 bytes, got 67"):
        dequantize(torch.zeros(67, dtype=torch.uint8), "Q8_0", (2, 32))


def test_rejects_row_not_multiple_of_block():
    with pytest.raises(ValueError, match="Q4_K needs rows that are multiples of 256"):
        dequantize(torch.zeros(144, dtype=torch.uint8), "Q4_K", (1, 128))


@pytest.mark.parametrize("name", ["TQ2_0", "Q8_K", "I32"])
def test_unsupported_type_is_named(name):
    with pytest.raises(ValueError, match=f"blk.0.ffn_up_exps.weight: quant type {name} cannot"):
        check_supported(name, "blk.0.ffn_up_exps.weight")
    fmt = quant_format(name)
    with pytest.raises(ValueError, match=name):
        dequantize(torch.zeros(fmt.nbytes((1, 256)), dtype=torch.uint8), name, (1, 256))


def test_unknown_type_lists_supported_names():
    with pytest.raises(ValueError, match="unknown quant type 'Q9_9'.*Q4_K"):
        quant_format("Q9_9")
    with pytest.raises(ValueError, match="unknown quant type 5"):
        quant_format(5)  # a retired ggml id (Q4_3) that gguf-py does not list


def test_formats_sizes_match_ggml():
    q4k, mxfp4 = quant_format("Q4_K"), quant_format(39)
    assert (q4k.ggml_type, q4k.block_elements, q4k.block_bytes) == (12, 256, 144)
    assert (mxfp4.name, mxfp4.block_elements, mxfp4.block_bytes) == ("MXFP4", 32, 17)
    # one Qwen3-30B-A3B expert in Q4_K: gate + up [768, 2048] + down [2048, 768] = 2.53 MiB
    # (the files' 2.72 MiB mixes Q4_K and Q6_K tensors)
    assert 3 * q4k.nbytes((768, 2048)) == 2_654_208
    assert quant_format("BF16").nbytes([2, 3, 4]) == 48
    with pytest.raises(ValueError, match="MXFP4 needs rows that are multiples of 32"):
        mxfp4.row_bytes(48)


def test_formats_module_is_torch_free():
    code = ("import sys; import expertcache.quant.formats, expertcache.quant; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_transformers_internals_we_rely_on():
    # dequant.py calls this function directly for the block types transformers has
    from transformers.integrations.gguf import dequant as hf

    params = list(inspect.signature(hf.dequantize).parameters)
    assert params == ["data", "ggml_type", "dtype"]
    have = {hf.GGML_NAME[t] for t in hf.GGML_BLOCK}
    borrowed = set(SUPPORTED) - {"F32", "F16", "BF16"} - set(kernels.BY_NAME)
    assert borrowed == {"Q8_0", *HOST_COPY_PER_CALL}
    assert borrowed <= have, f"transformers lost {sorted(borrowed - have)}"


class _HostTensors(TorchDispatchMode):
    """Counts tensors built from Python data (torch.tensor -> aten.lift_fresh): on CUDA each is
    a pageable host-to-device copy that waits for the stream, a sync per step for the runtime."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += "lift_fresh" in str(func)
        return func(*args, **(kwargs or {}))


def _host_tensors_per_call(fn) -> int:
    fn()  # the first call may build per-device tables, once
    with _HostTensors() as mode:
        fn()
    return mode.count


@pytest.mark.parametrize("name", SUPPORTED)
def test_no_host_tensor_per_call(name):
    data = torch.from_numpy(random_blocks(name, 2, 256, np.random.default_rng(0)))
    count = _host_tensors_per_call(lambda: dequantize(data, name, (2, 256)))
    if name in HOST_COPY_PER_CALL:
        # the documented exception (transformers' grid IQ code); fails once it is fixed upstream,
        # so that the caveat in dequant.py can go
        assert count > 0
    else:
        assert count == 0


def test_hf_layouts_build_no_host_tensor_per_call():
    from expertcache.quant.hf import fp8_block, mxfp4_hf

    blocks, scales = _mxfp4_checkpoint()
    assert _host_tensors_per_call(lambda: mxfp4_hf(blocks, scales)) == 0
    weight, scale_inv = _fp8((2, 300, 200), (2, 3, 2))
    assert _host_tensors_per_call(lambda: fp8_block(weight, scale_inv)) == 0


def test_write_tensor_round_trips_through_gguf_file(tmp_path):
    rng = np.random.default_rng(2)
    shape = (2, 3, 256)  # E, R, C
    blocks = random_blocks("Q4_K", 6, 256, rng)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    write_tensor(writer, "blk.0.ffn_up_exps.weight", blocks, "Q4_K", shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(path)).tensors[0]
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q4_K
    assert list(tensor.shape) == [256, 3, 2]  # ggml lists dimensions innermost first
    assert np.array_equal(np.asarray(tensor.data).reshape(-1), blocks.reshape(-1))


# --- HF-native layouts -----------------------------------------------------------------------

def _mxfp4_checkpoint(experts=3, rows=6, groups=4, seed=0):
    """Random GPT-OSS-style blocks [E, R, G, 16] and scales [E, R, G], with the E8M0 extremes."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 141, (experts, rows, groups), dtype=torch.uint8, generator=g)
    scales[0, 0] = torch.tensor([0, 1, 254, 255], dtype=torch.uint8)[:groups]
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp4_hf_equals_convert_moe_packed_tensors(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from expertcache.quant.hf import mxfp4_hf

    blocks, scales = _mxfp4_checkpoint()
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, C, R]: transposed
    got = mxfp4_hf(blocks, scales, dtype)
    assert got.shape == (3, 6, 128) and got.dtype == dtype
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.transpose(1, 2).contiguous().view(bits), want.contiguous().view(bits))
    # one expert [R, G, 16] gives that expert's slice
    assert torch.equal(mxfp4_hf(blocks[2], scales[2], dtype), got[2])


def test_mxfp4_hf_nibble_order_differs_from_ggml():
    from expertcache.quant.hf import mxfp4_hf

    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x72  # HF: element 0 <- 1.0, element 1 <- 6.0 (ggml: elements 0 and 16)
    out = mxfp4_hf(blocks, torch.full((1, 1), 127, dtype=torch.uint8), torch.float32)
    assert out[0, :2].tolist() == [1.0, 6.0] and out[0, 2:].abs().sum().item() == 0
    # the same bytes read as a ggml block put 6.0 at element 16
    ggml = dequantize(torch.cat([torch.tensor([127], dtype=torch.uint8), blocks.reshape(-1)]),
                      "MXFP4", (32,))
    assert ggml[0].item() == 1.0 and ggml[16].item() == 6.0 and ggml[1].item() == 0.0


def test_mxfp4_hf_and_ggml_agree_after_repacking_nibbles():
    # the same weights in both layouts (as a GGUF converter writes GPT-OSS) dequantize equally
    from expertcache.quant.hf import mxfp4_hf

    blocks, scales = _mxfp4_checkpoint(experts=1, rows=5, groups=3)
    blocks, scales = blocks[0], scales[0].clamp(110, 140)  # [R, G, 16], [R, G]
    nibbles = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).reshape(5, 3, 32)  # HF order
    ggml = nibbles[..., :16] | (nibbles[..., 16:] << 4)  # ggml: element j low, j + 16 high
    ggml_bytes = torch.cat([scales.unsqueeze(-1), ggml], dim=-1)  # [R, G, 17]
    want = mxfp4_hf(blocks, scales, torch.float32)
    assert torch.equal(dequantize(ggml_bytes, "MXFP4", (5, 96)), want)


def test_mxfp4_hf_rejects_bad_input():
    from expertcache.quant.hf import mxfp4_hf

    blocks, scales = _mxfp4_checkpoint()
    with pytest.raises(ValueError, match="uint8"):
        mxfp4_hf(blocks.to(torch.int16), scales)
    with pytest.raises(ValueError, match=r"scales \[\.\.\., R, C/32\]"):
        mxfp4_hf(blocks, scales[..., :3])


def _fp8(shape, grid, seed=1):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(shape, generator=g) * 200).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(grid, generator=g) * 1e-2 + 1e-4
    return weight, scale_inv


@pytest.mark.parametrize("shape,block", [((2, 300, 200), (128, 128)), ((3, 64, 96), (32, 64)),
                                         ((5, 7), (4, 4))])
def test_fp8_block_equals_transformers_on_ragged_shapes(shape, block):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from expertcache.quant.hf import fp8_block

    rows, cols = shape[-2:]
    grid = (*shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
    weight, scale_inv = _fp8(shape, grid)
    want = _dequantize_fp8_weight(weight, scale_inv, list(block), torch.float32)
    got = fp8_block(weight, scale_inv, block, torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    # an edge tile really uses its own scale: the last element is weight * the last scale
    last = weight[..., -1, -1].float() * scale_inv[..., -1, -1]
    assert torch.equal(got[..., -1, -1], last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_block_equals_transformers_loader(dtype):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from expertcache.quant.hf import fp8_block

    weight, scale_inv = _fp8((2, 256, 384), (2, 2, 3))
    want = Fp8Dequantize(None)._dequantize_one(weight, scale_inv, output_dtype=dtype)
    got = fp8_block(weight, scale_inv, (128, 128), dtype)
    assert got.dtype == dtype and torch.equal(got, want)


def test_fp8_block_rejects_bad_input():
    from expertcache.quant.hf import fp8_block

    weight, scale_inv = _fp8((2, 300, 200), (2, 3, 2))
    with pytest.raises(ValueError, match=r"needs weight_scale_inv \(2, 3, 2\), got \(2, 2, 2\)"):
        fp8_block(weight, scale_inv[:, :2], (128, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_block(weight.float(), scale_inv)


def test_transformers_hf_helpers_we_compare_with():
    # pinned: if these move, the equality tests above lose their reference
    from transformers.integrations import finegrained_fp8, mxfp4

    assert list(inspect.signature(mxfp4.convert_moe_packed_tensors).parameters)[:3] == [
        "blocks", "scales", "dtype"]
    assert list(inspect.signature(finegrained_fp8._dequantize_fp8_weight).parameters) == [
        "weight", "weight_scale_inv", "block_size", "dtype"]


def test_a_type_the_installed_transformers_lacks_is_refused_in_one_line(monkeypatch):
    """transformers 5.17 (the GPU image's) has no IQ1_S dequantizer: say so, not 'ggml type 19'."""
    from expertcache.quant import dequant as mod

    def lacking(data, ggml_type, dtype=torch.float32):
        raise ValueError(f"ggml type {ggml_type} is not supported yet.")

    monkeypatch.setattr(mod._hf_gguf, "dequantize", lacking)
    mod.transformers_lacks.cache_clear()
    try:
        assert mod.transformers_lacks("Q4_K") is None          # ours: never asks transformers
        why = mod.transformers_lacks("IQ1_S")
        assert why.startswith("IQ1_S blocks are dequantized by transformers'") and "upgrade transformers" in why
        with pytest.raises(ValueError, match="upgrade transformers"):
            mod.dequantize(torch.zeros(50, dtype=torch.uint8), "IQ1_S", (256,))
    finally:
        mod.transformers_lacks.cache_clear()
