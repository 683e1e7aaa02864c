"""host_memory='tiered' over a safetensors checkpoint: experts read by the offsets its header gives.

The tier must compute what the all-in-RAM load computes (float checkpoints of every family whose
experts transformers merges from per-expert tensors, and block FP8), read only what steps need,
and refuse damaged files and layouts it cannot read by offset with one line.
"""

from __future__ import annotations

import json
import struct

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import expertcache  # noqa: E402
from expertcache.ggufmodel.safetensors import read_header  # noqa: E402
from tiny_moe import save_checkpoint, tiny_model  # noqa: E402

PROMPT = torch.tensor([[5, 9, 77, 12, 3, 44]])
NEW = 8
RUNS = {"resident": dict(device="cpu", baseline="resident"), "slots": dict(device="cpu", slots=4)}
# FP8 has no ggml CPU kernel: its slots are dequantized, so baseline='resident' over the tier is
# refused (it would copy every expert into RAM slots); baseline='cpu' computes from the tier's rows.
RUNS_FP8 = {"cpu": dict(device="cpu", baseline="cpu"), "slots": dict(device="cpu", slots=4)}
RUNS_ALL = {**RUNS, **RUNS_FP8}


def _pair(path, run: str, budget="50%"):
    """(the all-in-RAM model, the tiered one) of one checkpoint."""
    ref = expertcache.offload(path, host_memory="copy", **RUNS_ALL[run])
    got = expertcache.offload(path, host_memory="tiered", host_budget=budget, **RUNS_ALL[run])
    return ref, got


def _assert_same(ref, got):
    assert torch.equal(got.generate(PROMPT, max_new_tokens=NEW, do_sample=False),
                       ref.generate(PROMPT, max_new_tokens=NEW, do_sample=False))
    with torch.no_grad():
        assert torch.allclose(got(PROMPT).logits, ref(PROMPT).logits, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    def make(family: str):
        path = tmp_path_factory.mktemp(family)
        save_checkpoint(tiny_model(family), path)
        return path
    return make


# Mixtral: transformers renames block_sparse_moe -> mlp and merges w1 / w3 / w2; GraniteMoE keeps
# one fused [E, 2I, H] tensor per layer; DeepSeek-V3: a dense first layer and shared experts.
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "granitemoe"])
@pytest.mark.parametrize("run", list(RUNS))
def test_a_float_checkpoint_tiered_equals_all_in_ram(checkpoints, family, run):
    ref, got = _pair(checkpoints(family), run)
    _assert_same(ref, got)
    tier = got.expertcache.tier.stats()
    assert tier["decode"]["file_reads"] > 0 and tier["decode"]["file_bytes"] > 0
    assert tier["rows"] < got.expertcache.num_layers * got.expertcache.num_experts  # the rest stays in the file


def test_fp8_checkpoint_tiered_equals_all_in_ram(tmp_path):
    """Block FP8 (DeepSeek-V3 / Qwen3-FP8 layout): float8 weights and their scale tiles, per expert."""
    from test_hf_quant import write_fp8

    for family, ff in (("qwen3_moe", 192), ("deepseek_v3", None)):  # 192: partial scale tiles
        path, _ = write_fp8(tmp_path / family, family=family, **({"ff": ff} if ff else {}))
        for run in RUNS_FP8:
            ref, got = _pair(path, run)
            _assert_same(ref, got)
            parts = {p.name for p in got.expertcache.hosts[0].codec.parts}
            assert {"gate.weight", "gate.scale", "down.weight", "down.scale"} <= parts
        with pytest.raises(ValueError, match=r"dequantized slots .*Use baseline='cpu'"):
            expertcache.offload(path, host_memory="tiered", host_budget="50%", **RUNS["resident"])


def test_expert_offsets_are_the_headers(checkpoints):
    """The tier reads expert e of a part where the header puts ``experts.e.*``: those bytes are the tensor's."""
    from safetensors import safe_open

    path = checkpoints("qwen3_moe")
    model = expertcache.offload(path, device="cpu", baseline="resident", host_memory="tiered", host_budget="50%")
    store = model.expertcache.tier
    rng = store.layers[1]["down.weight"]
    file, offset = rng.where(5)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        want = f.get_tensor("model.layers.1.mlp.experts.5.down_proj.weight").contiguous().view(torch.uint8)
    with open(file, "rb") as fh:
        fh.seek(offset)
        assert fh.read(rng.nbytes) == want.numpy().tobytes()


# -- bad input: one line each -----------------------------------------------------------------
def test_truncated_and_damaged_files_are_refused(checkpoints, tmp_path):
    import shutil

    src = checkpoints("qwen3_moe")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    weights = bad / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) - 100])
    with pytest.raises(ValueError, match=r"ends at byte \d+ but the file has \d+; the file is truncated"):
        expertcache.offload(bad, device="cpu", baseline="resident", host_memory="tiered", host_budget="50%")
    weights.write_bytes(data[:8] + b"x" + data[9:])    # the JSON's opening brace overwritten
    with pytest.raises(ValueError, match="header is not valid JSON"):
        read_header(weights)
    weights.write_bytes(struct.pack("<Q", len(data)) + data[8:])
    with pytest.raises(ValueError, match="not a safetensors file, or truncated"):
        read_header(weights)


def test_a_missing_expert_tensor_is_named(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil

    bad = tmp_path / "missing"
    shutil.copytree(checkpoints("qwen3_moe"), bad)
    state = load_file(bad / "model.safetensors")
    del state["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.3\.up_proj\.weight is missing"):
        expertcache.offload(bad, device="cpu", baseline="resident", host_memory="tiered", host_budget="50%")


def test_layouts_not_read_by_offset_say_so(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="holds its experts transposed .*Convert the model to GGUF"):
        expertcache.offload(checkpoints("gpt_oss"), device="cpu", baseline="resident", host_memory="tiered",
                            host_budget="50%")
    from test_hf_quant import write_gpt_oss_mxfp4

    path = write_gpt_oss_mxfp4(tmp_path / "mxfp4")
    with pytest.raises(ValueError, match="does not read GPT-OSS MXFP4 checkpoints by offset"):
        expertcache.offload(path, device="cpu", baseline="resident", host_memory="tiered", host_budget="50%")
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    (bin_only / "config.json").write_text(json.dumps(tiny_model("qwen3_moe").config.to_dict()))
    torch.save({}, bin_only / "pytorch_model.bin")
    with pytest.raises(ValueError, match="reads experts by offset from safetensors files; this checkpoint has none"):
        expertcache.offload(bin_only, device="cpu", baseline="resident", host_memory="tiered", host_budget="50%")


def test_transformers_conversion_mapping_as_read_here():
    """Pins the transformers internals the tier's loader reads (conversion_mapping): Mixtral's
    renaming, and the per-expert merges whose '*' is the expert index."""
    from expertcache.loaders.tiered_checkpoint import _converters, renamer

    assert renamer("mixtral")("model.layers.3.block_sparse_moe.gate.weight") == "model.layers.3.mlp.gate.weight"
    assert renamer("qwen3_moe")("model.layers.3.mlp.gate.weight") == "model.layers.3.mlp.gate.weight"
    merges = {target: (sources, ops) for sources, target, ops in _converters("qwen3_moe")}
    sources, ops = merges["mlp.experts.gate_up_proj"]
    assert sources == ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"]
    assert ops == ["MergeModulelist", "Concatenate"]
    assert merges["mlp.experts.down_proj"] == (["mlp.experts.*.down_proj.weight"], ["MergeModulelist"])


def test_plan_sizes_a_checkpoint_from_its_headers(checkpoints, tmp_path):
    """`plan DIR` (and the cost model) reads layers, experts, top-k and one expert's bytes from
    config.json and the safetensors headers: float in its own dtype, FP8 with its scale tiles."""
    from expertcache.costmodel import model_experts
    from test_hf_quant import write_fp8

    m = model_experts(str(checkpoints("qwen3_moe")), compute_dtype="float32")
    assert (m.layers, m.experts, m.top_k, m.quant) == (2, 8, 2, "f32")
    assert m.cost.expert_bytes == 3 * 24 * 32 * 4 and m.cost.expert_flops == 2.0 * 3 * 24 * 32
    path, _ = write_fp8(tmp_path / "fp8", ff=192)         # hidden 256; 128 x 128 tiles, partial at 192
    m = model_experts(str(path), compute_dtype="bfloat16")
    scales = 2 * (2 * 2) + 2 * 2                           # gate, up [2, 2] tiles; down [2, 2] tiles
    assert m.quant == "f8_e4m3" and m.cost.expert_bytes == 3 * 192 * 256 + 4 * scales
    assert m.cost.compute_bytes == 3 * 192 * 256 * 2        # dequantized into bf16
    with pytest.raises(ValueError, match="no expert tensors"):
        (tmp_path / "dense").mkdir()
        (tmp_path / "dense" / "config.json").write_text('{"num_experts_per_tok": 2}')
        from safetensors.torch import save_file
        save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, tmp_path / "dense" / "model.safetensors")
        model_experts(str(tmp_path / "dense"))
