"""HF-native quantized checkpoints (GPT-OSS MXFP4, block FP8) through the cache, experts kept quantized.

The checkpoints are built here from tiny random float models: the experts (and, for FP8, the
attention linears, as in the released FP8 checkpoints) quantized with gguf-py (MXFP4, then
repacked to HF's nibble order) or by 128x128 blocks (FP8), saved as safetensors with the
``quantization_config`` transformers expects. References, float32:

- MXFP4 and FP8 with whole tiles: transformers' own loading of the same directory. On a
  machine without triton/kernels (MXFP4) or a CUDA FP8 GPU (FP8) it dequantizes everything
  (``Mxfp4Config(dequantize=True)``, ``Fp8Dequantize``).
- FP8 with partial edge tiles (FF 192 over 128-row tiles): transformers' loader derives the
  tile from the scale grid (``rows // scale_rows`` = 96) and mis-scales such weights, so the
  reference is the float model with every quantized weight replaced by ``quant.hf.fp8_block``
  of the stored bytes (which equals transformers' ``_dequantize_fp8_weight``, tests/test_dequant.py).

Logits must agree within 1e-4 and greedy tokens exactly, for both slot formats, the fetch,
cpu and auto miss paths and both partitions, as for GGUF files (tests/test_gguf.py).
"""

from __future__ import annotations

import copy
import json
import math
import os

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import expertcache
from expertcache.quant.hf import fp8_block, mxfp4_hf, mxfp4_hf_to_ggml
from expertcache.quant.dequant import dequantize
from offload_check import assert_offload_matches, expected
from tiny_moe import save_checkpoint, tiny_config

PROMPT = torch.tensor([[5, 9, 77, 12, 3, 44, 20, 17]])
BLOCK = (128, 128)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}


def _random_model(config, seed: int = 0):
    """As tiny_moe.tiny_model: strong routers and non-zero expert biases, so tokens spread."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")):
                p.normal_(0, 2.0)
            elif "bias" in name and ("experts" in name or "router" in name):
                p.normal_(0, 0.1)
    return model.eval()


def _set_quant(path, quant: dict) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(cfg))


# -- GPT-OSS MXFP4 --------------------------------------------------------------------------
def hf_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [E, R, C] -> HF MXFP4 (blocks [E, R, C/32, 16], scales [E, R, C/32]) via gguf-py's quantizer."""
    experts, rows, cols = weight.shape
    raw = gguf.quants.quantize(weight.reshape(-1, cols).numpy(), gguf.GGMLQuantizationType.MXFP4)
    ggml = torch.from_numpy(raw.view(np.uint8).reshape(experts, rows, cols // 32, 17))
    packed = ggml[..., 1:]
    values = torch.cat([packed & 0xF, packed >> 4], dim=-1)  # ggml: element j low, j + 16 high
    blocks = values[..., 0::2] | (values[..., 1::2] << 4)      # HF: element 2j low, 2j + 1 high
    return blocks.contiguous(), ggml[..., 0].contiguous()


def write_gpt_oss_mxfp4(path, seed: int = 0, hidden: int = 64, layers: int = 2, quantize: bool = True):
    """A tiny GPT-OSS checkpoint with MXFP4 experts, as openai/gpt-oss-* stores them.

    ``quantize=False`` writes random valid blocks instead of quantizing (gguf-py's quantizer is
    numpy, slow for large experts): for tests that look at memory, not values.
    """
    config = tiny_config("gpt_oss", hidden=hidden, layers=layers)
    config.intermediate_size = hidden  # MXFP4 blocks run along rows of 32
    model = _random_model(config, seed)
    save_checkpoint(model, path)
    state = load_file(path / "model.safetensors")
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = state.pop(key).transpose(1, 2).contiguous()  # GPT-OSS stores [E, in, out]; blocks are [E, out, in]
        if quantize:
            state[key + "_blocks"], state[key + "_scales"] = hf_mxfp4(weight)
        else:
            experts, rows, cols = weight.shape
            state[key + "_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8)
            state[key + "_scales"] = torch.randint(118, 127, (experts, rows, cols // 32), dtype=torch.uint8)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    _set_quant(path, {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                         "model.layers.*.mlp.router",
                                                                         "model.embed_tokens", "lm_head"]})
    return path


def transformers_reference(path):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if "mxfp4" in json.dumps(
        json.loads((path / "config.json").read_text())["quantization_config"]) else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu",
                                                local_files_only=True, **extra).eval()


# -- block FP8 ------------------------------------------------------------------------------
def quantize_fp8(weight: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float [R, C] -> (float8_e4m3fn [R, C], float32 weight_scale_inv [ceil(R/b0), ceil(C/b1)]).

    Scale = tile amax / 448, as DeepSeek's and transformers' quantizers; edge tiles may be partial.
    """
    rows, cols = weight.shape
    nr, nc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    padded = torch.zeros(nr * block[0], nc * block[1])
    padded[:rows, :cols] = weight
    tiles = padded.reshape(nr, block[0], nc, block[1])
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp(-448, 448).reshape(padded.shape)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.to(torch.float32)


def _fp8_target(key: str) -> bool:
    """What the released FP8 checkpoints quantize: linears, not the router, embeddings or lm_head."""
    return key.endswith("proj.weight") and ".mlp.gate." not in key


def write_fp8(path, family: str = "qwen3_moe", ff: int = 128, seed: int = 0):
    """A tiny block-FP8 checkpoint (per-expert tensors, as Qwen3-FP8 / DeepSeek-V3 store them)."""
    if family == "qwen3_moe":
        config = tiny_config("qwen3_moe", hidden=256)
        config.moe_intermediate_size, config.head_dim = ff, 64
    else:  # tiny_moe's DeepSeek-V3: dense first layer, shared expert, MLA (all under one tile)
        config = tiny_config(family)
    model = _random_model(config, seed)
    save_checkpoint(model, path)
    state = load_file(path / "model.safetensors")
    for key in [k for k in state if _fp8_target(k)]:
        state[key], state[key + "_scale_inv"] = quantize_fp8(state[key])
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    _set_quant(path, FP8_CONFIG)
    return path, model


def fp8_reference(path, float_model):
    """The float model with each quantized weight replaced by fp8_block of the stored bytes."""
    model = copy.deepcopy(float_model)
    state = load_file(path / "model.safetensors")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, scale in ((k[:-len("_scale_inv")], v) for k, v in state.items() if k.endswith("_scale_inv")):
            weight = fp8_block(state[key], scale, BLOCK, torch.float32)
            if ".experts." not in key:
                params[key].copy_(weight)
                continue
            prefix, expert, proj = key.removesuffix(".weight").rsplit(".", 2)  # ...experts, N, gate_proj
            e, fused = int(expert), params
            inter = fused[prefix + ".down_proj"].shape[-1]
            if proj == "down_proj":
                fused[prefix + ".down_proj"][e] = weight
            else:
                rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                fused[prefix + ".gate_up_proj"][e, rows] = weight
    return model.eval()


# -- fixtures -------------------------------------------------------------------------------
CHECKPOINTS = ("mxfp4", "fp8", "fp8-partial-tiles", "fp8-deepseek")


@pytest.fixture(scope="module", params=CHECKPOINTS)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "mxfp4":
        ref = transformers_reference(write_gpt_oss_mxfp4(path))
    elif request.param == "fp8":
        path, float_model = write_fp8(path, ff=128)
        ref = transformers_reference(path)
        mine = fp8_reference(path, float_model)  # the two references agree where transformers' applies
        with torch.no_grad():
            assert (ref(PROMPT).logits - mine(PROMPT).logits).abs().max().item() <= 1e-5
    elif request.param == "fp8-partial-tiles":
        ref = fp8_reference(*write_fp8(path, ff=192))
    else:
        path, float_model = write_fp8(path, family="deepseek_v3")
        ref = fp8_reference(path, float_model)
    return (path, *expected(ref, PROMPT))


@pytest.mark.parametrize("slot_format", ["quantized", "dequantized"])
@pytest.mark.parametrize("miss,partition", [("fetch", "global"), ("cpu", "per-layer"), ("auto", "global"),
                                            ("fetch", "per-layer")])
def test_hf_quantized_equals_reference(checkpoint, slot_format, miss, partition):
    path, logits, tokens = checkpoint
    model = assert_offload_matches(path, PROMPT, logits, tokens, slot_format=slot_format, miss=miss,
                                   partition=partition)
    summary = model.expertcache.summary()
    assert summary["slot_format"] == slot_format and summary["host_memory"] == "copy"


# -- bytes ------------------------------------------------------------------------------------
def test_mxfp4_repack_is_lossless():
    """HF blocks repacked to ggml's order dequantize (ggml path) to exactly what HF's layout gives."""
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (2, 6, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 141, (2, 6, 4), dtype=torch.uint8, generator=g)
    ggml = mxfp4_hf_to_ggml(blocks, scales)
    assert ggml.shape == (2, 6, 4 * 17) and ggml.numel() == blocks.numel() + scales.numel()
    want = mxfp4_hf(blocks, scales, torch.float32)
    assert torch.equal(dequantize(ggml.reshape(-1), "MXFP4", (2, 6, 128)), want)


def test_mxfp4_repacked_in_chunks(tmp_path, monkeypatch):
    """Experts are repacked a few at a time (bounded extra memory); the chunking changes no byte."""
    from expertcache.config import CacheConfig
    from expertcache.loaders import hf_quant

    path = write_gpt_oss_mxfp4(tmp_path)
    _, _, whole = hf_quant.load_hf_quantized(path, CacheConfig(slots=6), torch.device("cpu"))
    monkeypatch.setattr(hf_quant, "_CHUNK", 3)  # 8 experts: chunks of 3, 3, 2
    _, _, chunked = hf_quant.load_hf_quantized(path, CacheConfig(slots=6), torch.device("cpu"))
    for a, b in zip(whole, chunked):
        assert a.tensors.keys() == b.tensors.keys()
        assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    state = load_file(path / "model.safetensors")
    bad = state["model.layers.0.mlp.experts.down_proj_scales"]
    state["model.layers.0.mlp.experts.down_proj_scales"] = bad[:, :, :1].contiguous()
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"down_proj: MXFP4 experts need _blocks .* got \(8, 64, 2, 16\) "
                                         r"and \(8, 64, 1\)") as err:
        expertcache.offload(path, slots=6)
    _one_line(err)


def test_mxfp4_bytes_per_slot_and_miss(tmp_path):
    path = write_gpt_oss_mxfp4(tmp_path)
    hidden, inter = 64, 64
    expert = (2 * inter * hidden + hidden * inter) // 32 * 17 + (2 * inter + hidden) * 4  # blocks + f32 biases
    q = expertcache.offload(path, slots=6, slot_format="quantized").expertcache
    d = expertcache.offload(path, slots=6, slot_format="dequantized").expertcache
    assert q.expert_bytes == d.expert_bytes == expert
    assert q.summary()["quant"] == ["F32", "MXFP4"]
    assert q.pool.slot_bytes == (6 + 2) * expert
    assert d.pool.slot_bytes == (6 + 2) * (3 * inter * hidden + 2 * inter + hidden) * 4
    model = expertcache.offload(path, slots=6, slot_format="quantized")
    with torch.no_grad():
        model.generate(PROMPT, max_new_tokens=4, do_sample=False)
    stats = model.expertcache.stats()
    assert stats.h2d_bytes() == stats.total().misses * expert  # fetch: each miss moves the stored bytes


def test_fp8_bytes_per_slot_and_miss(tmp_path):
    path, _ = write_fp8(tmp_path, ff=192)
    hidden, inter = 256, 192
    scales = 2 * (2 * 2) + 2 * 2  # gate and up [2, 2] each, down [2, 2]: float32 each
    expert = 3 * inter * hidden + scales * 4
    model = expertcache.offload(path, slots=6, slot_format="quantized")
    cache = model.expertcache
    assert cache.expert_bytes == expert and cache.summary()["quant"] == ["F32", "F8_E4M3"]
    assert cache.pool.slot_bytes == (6 + 2) * expert
    assert cache.codec.params == 3 * inter * hidden  # scales are not parameters
    with torch.no_grad():
        model.generate(PROMPT, max_new_tokens=4, do_sample=False)
    stats = cache.stats()
    assert stats.h2d_bytes() == stats.total().misses * expert


def test_baselines_move_quantized_bytes(tmp_path):
    path, float_model = write_fp8(tmp_path, ff=128)
    with torch.no_grad():
        want = fp8_reference(path, float_model).generate(PROMPT, max_new_tokens=6, do_sample=False)
    for baseline in ("resident", "copy-every-pass", "cpu"):
        model = expertcache.offload(path, baseline=baseline)
        with torch.no_grad():
            assert torch.equal(model.generate(PROMPT, max_new_tokens=6, do_sample=False), want), baseline
        stats, cache = model.expertcache.stats(), model.expertcache
        if baseline == "copy-every-pass":
            assert stats.h2d_bytes() == stats.total().accesses * cache.expert_bytes
        else:
            assert stats.h2d_bytes() == 0


def test_sharded_checkpoint(tmp_path):
    """Released checkpoints come in shards with an index; experts of one layer may span two files."""
    path, _ = write_fp8(tmp_path, ff=128)
    single = expertcache.offload(path, slots=6)
    state = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, names in shards.items():
        save_file({k: state[k] for k in names}, path / name, metadata={"format": "pt"})
    weight_map = {k: name for name, names in shards.items() for k in names}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sharded = expertcache.offload(path, slots=6)
    with torch.no_grad():
        assert torch.equal(single(PROMPT).logits, sharded(PROMPT).logits)


# -- bad input: one clear line, nothing loaded ----------------------------------------------------
def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_fp8_scale_shape_mismatch(tmp_path):
    path, _ = write_fp8(tmp_path, ff=192)
    state = load_file(path / "model.safetensors")
    key = "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"
    state[key] = state[key][:1]  # [1, 2] instead of [2, 2]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        expertcache.offload(path, slots=6)
    assert _one_line(err) == ("model.layers.1.mlp.experts.3.up_proj.weight: FP8 weight (192, 256) with 128x128 "
                              "blocks needs weight_scale_inv (2, 2), got (1, 2)")


def test_fp8_dense_scale_shape_mismatch(tmp_path):
    path, _ = write_fp8(tmp_path, ff=128)
    state = load_file(path / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    state[key] = torch.ones(3, 3)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"q_proj.weight: FP8 weight \(256, 256\) .* needs weight_scale_inv "
                                         r"\(2, 2\), got \(3, 3\)") as err:
        expertcache.offload(path, slots=6)
    _one_line(err)


@pytest.mark.parametrize("quant,match", [
    ({**FP8_CONFIG, "weight_block_size": None}, "needs weight_block_size"),
    ({**FP8_CONFIG, "activation_scheme": "static"}, "activation_scheme='static' is not supported"),
    ({**FP8_CONFIG, "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
    ({"quant_method": "fbgemm_fp8"}, r"per-channel FP8 \(fbgemm_fp8\) experts .* are not supported"),
])
def test_fp8_settings_refused(tmp_path, quant, match):
    path, _ = write_fp8(tmp_path, ff=128)
    _set_quant(path, quant)
    with pytest.raises(ValueError, match=match) as err:
        expertcache.offload(path, slots=6)
    _one_line(err)


def test_mxfp4_config_over_float_experts(tmp_path):
    model = _random_model(tiny_config("gpt_oss"))
    save_checkpoint(model, tmp_path)
    _set_quant(tmp_path, {"quant_method": "mxfp4"})
    with pytest.raises(ValueError, match=r"experts.gate_up_proj_blocks / _scales missing") as err:
        expertcache.offload(tmp_path, slots=6)
    _one_line(err)


def test_mmap_host_memory_refused(tmp_path):
    path = write_gpt_oss_mxfp4(tmp_path)
    with pytest.raises(ValueError, match="host_memory='mmap' reads experts from a GGUF file"):
        expertcache.offload(path, slots=6, host_memory="mmap")


def test_loaded_quantized_model_points_to_the_directory(tmp_path):
    """A model whose experts transformers already holds in FP8 is refused, naming the way that works."""
    model = _random_model(tiny_config("qwen3_moe"))
    experts = model.model.layers[0].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.data.to(torch.float8_e4m3fn),
                                              requires_grad=False)
    with pytest.raises(ValueError, match="pass the checkpoint directory to offload"):
        expertcache.offload(model, slots=4)


def test_loader_never_holds_dequantized_experts(tmp_path):
    """Peak RSS while loading an MXFP4 checkpoint stays far below its experts' float32 size.

    Measured in a fresh process after loading a tiny checkpoint of the same family (which
    imports every module a load needs, the compiled eviction policy too: its 8 slots hold half
    of the tiny model's experts), the peak reset there (/proc/self/clear_refs).
    """
    import subprocess
    import sys
    import textwrap

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc to reset the peak RSS")
    (tmp_path / "tiny").mkdir()
    (tmp_path / "big").mkdir()
    tiny = write_gpt_oss_mxfp4(tmp_path / "tiny", quantize=False)
    path = write_gpt_oss_mxfp4(tmp_path / "big", hidden=1024, layers=4, quantize=False)
    f32_experts = 4 * 8 * 3 * 1024 * 1024 * 4  # 403 MB dequantized; the checkpoint holds 54 MB of MXFP4
    code = textwrap.dedent(f"""
        import re, expertcache
        expertcache.offload({str(tiny)!r}, slots=8, slot_format="quantized")
        def status(field):
            return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
        open("/proc/self/clear_refs", "w").write("5")  # peak RSS := current RSS
        before = status("VmRSS")
        model = expertcache.offload({str(path)!r}, slots=16, slot_format="quantized")
        print(before, status("VmHWM"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = map(int, out.stdout.split()[-2:])
    # the repacked copy (54 MB), the file's pages mapped while reading them (54 MB) and one chunk
    # of temporaries: measured 140 MB. A dequantized copy alone would be 403 MB.
    assert after - before < f32_experts / 2, (before, after)


def test_codec_fp8_kinds_are_checked():
    from expertcache.quant.formats import quant_format
    from expertcache.quant.hf import FP8_E4M3
    from expertcache.runtime.quantized import Codec, Kind, Part

    w, s, f = Part("w", FP8_E4M3, (4, 4)), Part("s", quant_format("F32"), (1, 1)), Part("f", quant_format("F32"), (4, 4))
    codec = Codec((w, s), (Kind("down_proj", "fp8", ("w", "s"), BLOCK),), torch.float32)
    assert codec.params == 16 and codec.expert_bytes == 16 + 4  # the scale is stored, not a parameter
    for bad in (Kind("down_proj", "fp8", ("f", "s"), BLOCK), Kind("down_proj", "fp8", ("w",), BLOCK),
                Kind("down_proj", "fp8", ("w", "s"))):
        with pytest.raises(ValueError, match="'fp8' takes"):
            Codec((w, s, f), (bad,), torch.float32)


def test_trace_record_takes_an_hf_quantized_checkpoint(tmp_path):
    """`trace record` takes what offload takes (issue 17): a block-FP8 directory records the
    same routing as the offloaded model routes."""
    from tiny_chat import chat_tokenizer

    from expertcache.integrations.record import record, record_trace

    path, _ = write_fp8(tmp_path / "fp8")
    chat_tokenizer().save_pretrained(path)
    trace = record_trace(path, "w1 w2 w3 w4", tmp_path / "t.npz", 3)
    assert trace.phases.tolist() == [0] * 4 + [1] * 2
    model = expertcache.offload(path, slots=16, device="cpu")
    ids = torch.tensor([chat_tokenizer()("w1 w2 w3 w4").input_ids])
    assert np.array_equal(record(model, ids, 3).experts, trace.experts)
