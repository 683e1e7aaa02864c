"""GGUF MoE models through the cache equal transformers' own GGUF loading of the same file.

transformers dequantizes every tensor at load (gguf-py's numpy dequantizer); the cache
keeps the experts in their blocks and dequantizes them with torch on use or on load.
Logits must agree within 1e-4 (float32) and greedy tokens exactly, for each expert
type, slot format, miss path and partition.
"""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch

import expertcache
from expertcache.ggufmodel.header import read_header
from gguf_models import EXPERT_FF, write_gguf
from offload_check import assert_offload_matches, expected

PROMPT = torch.tensor([[5, 9, 77, 120, 3, 44, 200, 17]])
TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4")


def reference(path):
    """transformers' own GGUF loading, with the expert FF size its qwen3moe mapping does not read."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    values = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    assert values.get("moe_intermediate_size", 768) != EXPERT_FF  # the trap is still there: keep the fix
    values["moe_intermediate_size"] = EXPERT_FF
    config = AutoConfig.for_model(**values)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config).eval()


@pytest.fixture(scope="module", params=TYPES)
def gguf_file(request, tmp_path_factory):
    path = write_gguf(tmp_path_factory.mktemp(request.param) / "tiny.gguf", "qwen3_moe", request.param)
    return (path, *expected(reference(path), PROMPT))


@pytest.mark.parametrize("slot_format", ["quantized", "dequantized"])
@pytest.mark.parametrize("miss,partition", [("fetch", "global"), ("cpu", "per-layer"), ("auto", "global"),
                                            ("fetch", "per-layer")])
def test_gguf_equals_transformers(gguf_file, slot_format, miss, partition):
    path, logits, tokens = gguf_file
    model = assert_offload_matches(path, PROMPT, logits, tokens, slot_format=slot_format, miss=miss,
                                   partition=partition)
    stats = model.expertcache.stats()
    summary = model.expertcache.summary()
    assert summary["slot_format"] == slot_format and summary["host_memory"] == "mmap"
    assert stats.pool["host_memory"] == "mmap" and "no CUDA" in stats.pool["host_memory_reason"]
    assert stats.to_dict()["pool"]["bytes_per_load"] == model.expertcache.expert_bytes


def test_quantized_bytes_cross_and_fill_slots(tmp_path):
    """Slots and copies are counted in stored bytes: 3.x times fewer than the float32 expert."""
    path = write_gguf(tmp_path / "q4k.gguf", "qwen3_moe", "Q4_K", down_type="Q6_K")
    header = read_header(path)
    expected = sum(header.first_layer[p].nbytes // 8 for p in ("gate.weight", "up.weight", "down.weight"))
    assert header.expert_bytes == expected == 2 * 512 * 144 + 256 * 2 * 210  # Q4_K 144 B, Q6_K 210 B / 256
    quantized = expertcache.offload(path, slots=6, slot_format="quantized", cpu_kernel="torch")
    dequantized = expertcache.offload(path, slots=6, slot_format="dequantized", cpu_kernel="torch")
    f32_expert = 3 * 256 * 512 * 4
    assert quantized.expertcache.pool.slot_bytes == (6 + 2) * expected
    assert dequantized.expertcache.pool.slot_bytes == (6 + 2) * f32_expert
    with torch.no_grad():
        quantized.generate(PROMPT, max_new_tokens=4, do_sample=False)
    stats = quantized.expertcache.stats()
    assert stats.h2d_bytes() == stats.total().misses * expected  # fetch: every miss moves its stored bytes


@pytest.mark.parametrize("slot_format", ["quantized", "dequantized"])
def test_layers_with_different_types_like_q4_k_m(tmp_path, slot_format):
    """Q4_K_M stores ffn_down_exps in Q6_K in some layers and Q4_K in others: slots fit the largest,
    each load moves its own layer's bytes, outputs equal transformers'."""
    path = write_gguf(tmp_path / "q4km.gguf", "qwen3_moe", "Q4_K", down_type=["Q6_K", "Q4_K"])
    header = read_header(path)
    sizes = [header.layer_expert_bytes(b) for b in header.moe_blocks]
    assert sizes[0] > sizes[1] and header.expert_bytes == sizes[0]
    assert header.quant_types["down.weight"] == "Q4_K/Q6_K"
    ref = reference(path)
    model = expertcache.offload(path, slots=6, slot_format=slot_format, cpu_kernel="torch")
    with torch.no_grad():
        assert (model(PROMPT).logits - ref(PROMPT).logits).abs().max().item() <= 1e-4
        want = ref.generate(PROMPT, max_new_tokens=8, do_sample=False)
        assert torch.equal(model.generate(PROMPT, max_new_tokens=8, do_sample=False), want)
    stats = model.expertcache.stats()
    assert stats.h2d_bytes() == sum(stats.layer(l, p).misses * sizes[l] for l in (0, 1) for p in ("prefill", "decode"))
    if slot_format == "quantized":
        assert model.expertcache.pool.slot_bytes == 8 * sizes[0]


def test_budget_counts_the_slot_format(tmp_path):
    path = write_gguf(tmp_path / "q4.gguf", "qwen3_moe", "Q4_0", experts=32)
    budget = 16 * 2 ** 20
    q = expertcache.offload(path, gpu_memory=budget, slot_format="quantized").expertcache
    d = expertcache.offload(path, gpu_memory=budget, slot_format="dequantized").expertcache
    assert q.pool.slot_bytes + q.pool.scratch_bytes <= budget
    assert d.pool.slot_bytes + d.expert_bytes <= budget
    assert q.pool.slots > 3 * d.pool.slots  # Q4_0: 18 bytes per 32 weights against 128 in float32


def test_baselines_move_quantized_bytes(tmp_path):
    path = write_gguf(tmp_path / "q8.gguf", "qwen3_moe", "Q8_0")
    ref = reference(path)
    with torch.no_grad():
        want = ref.generate(PROMPT, max_new_tokens=6, do_sample=False)
    for baseline in ("resident", "copy-every-pass", "cpu"):
        model = expertcache.offload(path, baseline=baseline, cpu_kernel="torch")
        with torch.no_grad():
            assert torch.equal(model.generate(PROMPT, max_new_tokens=6, do_sample=False), want), baseline
        stats, cache = model.expertcache.stats(), model.expertcache
        if baseline == "copy-every-pass":  # every routed expert of every step crosses, in stored bytes
            assert stats.h2d_bytes() == stats.total().accesses * cache.expert_bytes
        else:
            assert stats.h2d_bytes() == 0


def test_split_gguf_equals_single_file(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "split").mkdir()
    single = write_gguf(tmp_path / "one" / "m.gguf", "qwen3_moe", "Q8_0")
    first = write_gguf(tmp_path / "split" / "m.gguf", "qwen3_moe", "Q8_0", split_max_tensors=10)
    assert first.name.startswith("m-00001-of-0000")
    assert len(read_header(first).paths) > 1
    a = expertcache.offload(single, slots=6)
    b = expertcache.offload(first, slots=6)
    with torch.no_grad():
        assert torch.equal(a(PROMPT).logits, b(PROMPT).logits)


def test_tokenizer_from_the_gguf(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "qwen3_moe", "Q8_0")
    from expertcache.loaders import load_tokenizer

    tok = load_tokenizer(path)
    ids = tok("the cat").input_ids
    assert tok.decode(ids) == "the cat" and len(ids) < len("the cat")  # merges applied


def test_qwen2moe_with_shared_expert(tmp_path):
    path = write_gguf(tmp_path / "q2.gguf", "qwen2_moe", "Q8_0")
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    values = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    values.update(moe_intermediate_size=EXPERT_FF, shared_expert_intermediate_size=256)
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                               config=AutoConfig.for_model(**values)).eval()
    model = expertcache.offload(path, slots=6, cpu_kernel="torch")
    with torch.no_grad():
        assert (model(PROMPT).logits - ref(PROMPT).logits).abs().max().item() <= 1e-4


def test_imatrix_of_the_gguf_pins_its_hot_experts(tmp_path):
    """The imatrix belongs to the GGUF the user downloaded: --imatrix works with it."""
    from test_imatrix_reader import write_imatrix

    path = write_gguf(tmp_path / "m.gguf", "qwen3_moe", "Q8_0")
    counts = np.array([[90, 1, 1, 1, 1, 1, 1, 80], [1, 70, 1, 1, 1, 1, 60, 1]], dtype=np.int64)
    imatrix = write_imatrix(tmp_path / "imatrix.gguf", counts)
    model = expertcache.offload(path, slots=8, imatrix=imatrix, imatrix_mode="pin")
    table = model.expertcache.table
    assert {0, 7, 8 + 1, 8 + 6} <= set(table.pinned)  # the hottest two per layer, as int keys
    with torch.no_grad():
        model.generate(PROMPT, max_new_tokens=4, do_sample=False)
    assert {0, 7, 9, 14} <= set(table.pinned)  # still resident after decoding
    with pytest.raises(ValueError, match="8 experts"):
        expertcache.offload(path, slots=8, imatrix=write_imatrix(tmp_path / "other.gguf"))


# -- GPT-OSS (MXFP4 experts with biases, gate/up interleaved) -----------------------------
def gpt_oss_reference(path):
    """The HF model the file was written from, its experts replaced by gguf-py's dequantization.

    transformers 5.24 cannot read a gpt-oss GGUF itself (pinned below), so the reference is
    independent of our code: gguf-py's numpy dequantizer and HF's own layout.
    """
    from gguf_models import tiny_model

    ref = tiny_model("gpt_oss")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}

    def weights(name):
        t = tensors[name]
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
    with torch.no_grad():
        for layer, block in enumerate(ref.model.layers):
            experts = block.mlp.experts
            gate, up, down = (weights(f"blk.{layer}.ffn_{k}_exps.weight") for k in ("gate", "up", "down"))
            gate_up = torch.stack([gate, up], dim=2).reshape(gate.shape[0], -1, gate.shape[2])  # [E, 2I, H]
            experts.gate_up_proj.copy_(gate_up.transpose(1, 2))   # HF: [E, H, 2I]
            experts.down_proj.copy_(down.transpose(1, 2))         # HF: [E, I, H]
    return ref.eval()


@pytest.fixture(scope="module")
def gpt_oss_file(tmp_path_factory):
    path = write_gguf(tmp_path_factory.mktemp("gptoss") / "gpt-oss.gguf", "gpt_oss", "MXFP4")
    return (path, *expected(gpt_oss_reference(path), PROMPT))


@pytest.mark.parametrize("slot_format", ["quantized", "dequantized"])
@pytest.mark.parametrize("miss,partition", [("fetch", "global"), ("cpu", "per-layer")])
def test_gpt_oss_gguf(gpt_oss_file, slot_format, miss, partition):
    path, logits, tokens = gpt_oss_file
    model = assert_offload_matches(path, PROMPT, logits, tokens, slot_format=slot_format, miss=miss,
                                   partition=partition)
    assert model.expertcache.summary()["quant"] == ["F32", "MXFP4"]  # biases stay F32


def test_transformers_still_cannot_read_gpt_oss_gguf(gpt_oss_file):
    """Pins why the loader maps gpt-oss metadata itself: drop that code when this starts failing."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with pytest.raises(TypeError):
        load_gguf_checkpoint(str(gpt_oss_file[0]), return_tensors=False)


# -- Mixtral (arch llama, q/k permuted) and OLMoE: configs from llama.cpp's keys -----------------
def family_reference(path, family: str):
    """The HF model the file was written from, its experts replaced by gguf-py's dequantization
    of the file's (F32: the same values). transformers maps no GGUF of either family (pinned
    below), so the reference is the source model: equal logits also prove the loader undid
    llama.cpp's q/k permutation (``tests/test_ggml_graph.py`` compares llama.cpp's own logits)."""
    from gguf_models import tiny_model

    ref = tiny_model(family)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}

    def weights(name):
        t = tensors[name]
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
    with torch.no_grad():
        for layer, block in enumerate(ref.model.layers):
            if not hasattr(block.mlp, "experts"):
                continue  # DeepSeek's dense first layer
            gate, up, down = (weights(f"blk.{layer}.ffn_{k}_exps.weight") for k in ("gate", "up", "down"))
            block.mlp.experts.gate_up_proj.copy_(torch.cat([gate, up], dim=1))   # [E, 2I, H]: gate rows first
            block.mlp.experts.down_proj.copy_(down)                              # [E, H, I]
    return ref.eval()


@pytest.fixture(scope="module", params=[("mixtral", "F32"), ("mixtral", "Q8_0"), ("olmoe", "F32"), ("olmoe", "Q4_K")],
                ids=lambda p: "-".join(p))
def family_file(request, tmp_path_factory):
    family, experts = request.param
    path = write_gguf(tmp_path_factory.mktemp(family) / f"{family}.gguf", family, experts)
    return (family, path, *expected(family_reference(path, family), PROMPT))


@pytest.mark.parametrize("slot_format", ["quantized", "dequantized"])
@pytest.mark.parametrize("miss,partition", [("fetch", "global"), ("cpu", "per-layer")])
def test_mixtral_and_olmoe_gguf_equal_their_source_model(family_file, slot_format, miss, partition):
    family, path, logits, tokens = family_file
    model = assert_offload_matches(path, PROMPT, logits, tokens, slot_format=slot_format, miss=miss,
                                   partition=partition)
    assert model.config.model_type == family and model.config.intermediate_size == EXPERT_FF
    if family == "olmoe":   # llama.cpp's OLMoE: the top-k weights are not renormalised
        assert model.config.norm_topk_prob is False
        assert model.model.layers[0].self_attn.q_norm.weight.numel() == model.config.hidden_size


@pytest.mark.parametrize("family,experts", [("mixtral", "F32"), ("mixtral", "Q8_0"), ("olmoe", "F32"),
                                            ("olmoe", "Q8_0")])
def test_mixtral_and_olmoe_through_ggml_on_the_cpu(tmp_path, family, experts):
    """The CPU engine with ggml's kernels (experts, dense weights, the one graph a token) against
    the source model. F32: logits within float rounding, greedy tokens equal. Q8_0 (of the
    source's values): ggml rounds the activations to 8 bits, so logits within 2% and the same
    top-1 wherever the source's top-1 margin exceeds the largest logit difference (the tiny
    random models' margins are small: greedy runs part ways). The K-quant fixtures' random
    blocks are compared path against path in tests/test_ggml_graph.py."""
    path = write_gguf(tmp_path / "m.gguf", family, experts)
    logits, tokens = expected(family_reference(path, family), PROMPT)
    model = expertcache.offload(path, device="cpu", baseline="resident", cpu_kernel="ggml")
    assert model.expertcache.summary()["cpu_graph"] == "on"
    with torch.no_grad():
        got = model(PROMPT).logits
        out = model.generate(PROMPT, max_new_tokens=tokens.shape[1] - PROMPT.shape[1], do_sample=False)
    rel = ((got - logits).norm() / logits.norm()).item()
    if experts == "F32":
        assert rel < 1e-5 and torch.equal(out, tokens)
        return
    assert rel < 0.02   # measured 0.4% (Mixtral), 0.5% (OLMoE)
    for mine, ref in zip(got[0], logits[0]):                                   # [V] per position
        top = ref.topk(2).values
        if top[0] - top[1] > (mine - ref).abs().max():
            assert mine.argmax() == ref.argmax()


def test_mixtral_permuted_q_and_k_stay_quantized_for_ggml(tmp_path):
    """Quantized q/k of arch llama are kept as the file's blocks for ggml, their rows put back in
    transformers' order (a row reorder: each row's blocks whole): their outputs equal the
    dequantized, un-permuted torch weights' within ggml's 8-bit activations; left in the
    file's order they would be another matrix (relative difference ~1.4)."""
    from expertcache.runtime.cpudense import GgmlLinear

    path = write_gguf(tmp_path / "m.gguf", "mixtral", "Q8_0", dense_type="Q8_0")
    fast = expertcache.offload(path, device="cpu", baseline="resident", cpu_kernel="ggml", cpu_graph="off")
    exact = expertcache.offload(path, device="cpu", baseline="resident", cpu_kernel="torch")
    x = torch.randn(3, fast.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for name in ("q_proj", "k_proj"):
        mine, ref = (getattr(m.model.layers[1].self_attn, name) for m in (fast, exact))
        assert isinstance(mine, GgmlLinear) and not isinstance(ref, GgmlLinear)
        with torch.no_grad():
            assert ((mine(x) - ref(x)).norm() / ref(x).norm()).item() < 0.02, name


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_mixtral_and_olmoe_tokenizers_from_the_gguf(tmp_path, family):
    """Mixtral's sentencepiece vocabulary (BOS added, pieces merged by score), OLMoE's byte-level BPE."""
    from expertcache.loaders import load_tokenizer

    tok = load_tokenizer(write_gguf(tmp_path / "m.gguf", family, "Q8_0"))
    ids = tok("the cat").input_ids
    assert tok.decode(ids, skip_special_tokens=True) == "the cat" and len(ids) < len("the cat")
    if family == "mixtral":
        assert ids == [1, tok.convert_tokens_to_ids("▁the"), tok.convert_tokens_to_ids("▁cat")]


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_transformers_still_maps_no_mixtral_or_olmoe_gguf(tmp_path, family):
    """Pins why the loader maps their metadata itself: transformers reads a ``llama`` file as a
    dense Llama and has no ``olmoe`` mapping. Drop that code when this starts failing."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = write_gguf(tmp_path / "m.gguf", family, "Q8_0")
    try:
        config = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    except ValueError as err:
        assert "not supported" in str(err)
    else:
        assert config["model_type"] == "llama" and "num_local_experts" not in config


@pytest.mark.parametrize("key,value,match", [("rope.scaling.type", "linear", "RoPE scaling 'linear' in a llama"),
                                             ("rope.dimension_count", 32, "RoPE over 32 of 64 head dimensions")])
def test_a_llama_moe_file_with_other_rope_is_refused(tmp_path, key, value, match):
    """Mixtral's RoPE is unscaled over the whole head: anything else is named, not guessed."""
    from expertcache.loaders.gguf import _hf_config

    header = read_header(write_gguf(tmp_path / "m.gguf", "mixtral", "Q8_0"))
    header.metadata[f"llama.{key}"] = value
    with pytest.raises(ValueError, match=match):
        _hf_config(header)


# -- DeepSeek-V3/R1, Kimi-K2 (arch deepseek2): MLA, sigmoid routing over groups, YaRN ---------------
@pytest.fixture(scope="module", params=["F32", "Q4_K"])
def deepseek_file(request, tmp_path_factory):
    path = write_gguf(tmp_path_factory.mktemp("ds") / "deepseek.gguf", "deepseek_v3", request.param)
    return (request.param, path, *expected(family_reference(path, "deepseek_v3"), PROMPT))


@pytest.mark.parametrize("slot_format", ["quantized", "dequantized"])
@pytest.mark.parametrize("miss,partition", [("fetch", "global"), ("cpu", "per-layer")])
def test_deepseek_gguf_equals_its_source_model(deepseek_file, slot_format, miss, partition):
    """The file's config, MLA (kv_b_proj rebuilt from k_b / v_b), router bias, dense first layer and
    shared expert equal the source model's: its logits within 1e-4 and greedy tokens, with slots.
    llama.cpp's own logits for the fixture: tests/test_ggml_graph.py."""
    _, path, logits, tokens = deepseek_file
    model = assert_offload_matches(path, PROMPT, logits, tokens, slot_format=slot_format, miss=miss,
                                   partition=partition)
    cfg, src = model.config, family_reference(path, "deepseek_v3").config
    for name in ("first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
                 "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                 "n_shared_experts", "n_routed_experts", "moe_intermediate_size", "intermediate_size",
                 "num_key_value_heads"):
        assert getattr(cfg, name) == getattr(src, name), name
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["mscale_all_dim"] == 1.0
    assert len(model.expertcache.hosts) == cfg.num_hidden_layers - 1   # the dense first layer has none


@pytest.mark.parametrize("kernel", ["torch", "ggml"])
def test_deepseek_resident_on_the_cpu(tmp_path, kernel):
    """baseline='resident' (every expert computed from the host's bytes): with ggml's kernels
    through the one graph (MLA, grouped sigmoid routing), with torch's on the per-layer path.
    F32 experts: logits within float rounding of the source model's and greedy tokens equal,
    with either kernel (quantized ones through ggml: against llama.cpp's logits in
    tests/test_ggml_graph.py)."""
    path = write_gguf(tmp_path / "ds.gguf", "deepseek_v3", "F32")
    logits, tokens = expected(family_reference(path, "deepseek_v3"), PROMPT)
    model = expertcache.offload(path, device="cpu", baseline="resident", cpu_kernel=kernel)
    summary = model.expertcache.summary()
    assert summary["cpu_graph"] == ("on" if kernel == "ggml" else "off"), summary["cpu_graph_reason"]
    with torch.no_grad():
        got = model(PROMPT).logits
        out = model.generate(PROMPT, max_new_tokens=tokens.shape[1] - PROMPT.shape[1], do_sample=False)
    assert (got - logits).abs().max().item() <= 1e-5
    assert torch.equal(out, tokens)
    if kernel == "ggml":   # both prompts and every decode step ran as graphs
        decoder = model._expertcache_graph
        assert decoder.prefills == 2 and decoder.steps == tokens.shape[1] - PROMPT.shape[1] - 1


@pytest.mark.parametrize("settings", [dict(baseline="resident"), dict(slots=6)], ids=["resident", "slots"])
def test_deepseek_under_the_ram_tier_equals_all_in_ram(tmp_path, settings):
    """host_memory='tiered' with half the experts in RAM, the rest read from the file: the same
    greedy tokens as every expert in RAM (16 experts a layer, so the tier both hits and reads at
    decode). ggml's kernels, both runs: a resident run with torch's reads every expert at the
    prompt and its decode never asks the tier (Qwen3-MoE's too: not DeepSeek's to fix here)."""
    path = write_gguf(tmp_path / "ds.gguf", "deepseek_v3", "Q8_0", experts=16)
    ram = expertcache.offload(path, device="cpu", host_memory="copy", cpu_kernel="ggml", **settings)
    tier = expertcache.offload(path, device="cpu", host_memory="tiered", host_budget="50%", cpu_kernel="ggml",
                               **settings)
    want = ram.generate(PROMPT, max_new_tokens=10, do_sample=False)
    assert torch.equal(tier.generate(PROMPT, max_new_tokens=10, do_sample=False), want)
    decode = tier.expertcache.stats().pool["tier"]["decode"]
    assert decode["file_reads"] > 0 and decode["ram_hits"] > 0


def test_deepseek_before_the_kv_b_split_loads_the_same(tmp_path):
    """Files converted before llama.cpp split kv_b_proj (one ``attn_kv_b``, head sizes in
    key_length / value_length) load to the same model as today's split k_b / v_b."""
    split = write_gguf(tmp_path / "split.gguf", "deepseek_v3", "Q8_0")
    whole = write_gguf(tmp_path / "whole.gguf", "deepseek_v3", "Q8_0", split_kv_b=False)
    assert "blk.1.attn_kv_b.weight" in read_header(whole).tensors
    assert "blk.1.attn_kv_b.weight" not in read_header(split).tensors
    a, b = (expertcache.offload(p, device="cpu", baseline="resident", cpu_kernel="torch") for p in (split, whole))
    with torch.no_grad():
        assert torch.equal(a(PROMPT).logits, b(PROMPT).logits)


@pytest.mark.parametrize("dense", ["Q8_0", "Q4_0"])
def test_deepseek_quantized_k_b_and_v_b_rebuild_kv_b(tmp_path, dense):
    """Quantized k_b / v_b (3-D: [heads, rows, cols], blocks along each row) are dequantized and
    put back as the converter split them: kv_b_proj equals the merge of gguf-py's own
    dequantization of the two, exactly (the fixture's rows are 32 and 64 wide: 32-blocks only)."""
    from gguf_models import tiny_config, vocab_size

    path = write_gguf(tmp_path / "ds.gguf", "deepseek_v3", "Q8_0", dense_type=dense)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    model = expertcache.offload(path, device="cpu", baseline="resident", cpu_kernel="torch")
    cfg = tiny_config("deepseek_v3", vocab_size("deepseek_v3"))
    for layer in range(cfg.num_hidden_layers):
        k_b, v_b = (gguf.quants.dequantize(tensors[f"blk.{layer}.attn_{x}_b.weight"].data,
                                           tensors[f"blk.{layer}.attn_{x}_b.weight"].tensor_type) for x in "kv")
        assert tensors[f"blk.{layer}.attn_k_b.weight"].tensor_type == gguf.GGMLQuantizationType[dense]
        # [heads, kv_lora, nope] and [heads, v, kv_lora] -> [heads * (nope + v), kv_lora]
        want = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, cfg.kv_lora_rank)
        got = model.model.layers[layer].self_attn.kv_b_proj.weight
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want)))


def test_deepseek_with_half_of_kv_b_is_refused(tmp_path):
    from expertcache.loaders.common import empty_model
    from expertcache.loaders.gguf import _hf_config, _load_dense
    from expertcache.loaders.gguf_dense import dense_choice

    header = read_header(write_gguf(tmp_path / "ds.gguf", "deepseek_v3", "Q8_0"))
    del header.tensors["blk.2.attn_v_b.weight"]
    config = _hf_config(header)
    with pytest.raises(ValueError, match=r"blk.2.attn_k_b.weight without its other half \(attn_v_b\)"):
        _load_dense(empty_model(config, torch.float32), header, config, torch.float32,
                    dense_choice("torch", torch.device("cpu")))


def test_deepseek_router_stays_float32(tmp_path):
    """transformers keeps DeepSeek's router and its selection bias in float32 (from_pretrained's
    ``_keep_in_fp32_modules_strict``); a bfloat16 load keeps them so too."""
    path = write_gguf(tmp_path / "ds.gguf", "deepseek_v3", "Q8_0")
    model = expertcache.offload(path, device="cpu", baseline="resident", dtype="bfloat16", cpu_kernel="torch")
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    src = _stored_bias(path)
    assert torch.equal(gate.e_score_correction_bias, src)


def _stored_bias(path):
    """The selection bias of block 1 as the file stores it (exp_probs_b.bias, float32)."""
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.exp_probs_b.bias")
    return torch.from_numpy(np.array(tensor.data, dtype=np.float32))


def test_deepseek_tokenizer_from_the_gguf(tmp_path):
    from expertcache.loaders import load_tokenizer

    tok = load_tokenizer(write_gguf(tmp_path / "ds.gguf", "deepseek_v3", "Q8_0"))
    ids = tok("the cat").input_ids
    assert tok.decode(ids, skip_special_tokens=True) == "the cat"


def test_transformers_still_maps_no_deepseek2_gguf(tmp_path):
    """Pins why the loader maps deepseek2's keys itself. Drop that code when this starts failing."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with pytest.raises(ValueError, match="not supported"):
        load_gguf_checkpoint(str(write_gguf(tmp_path / "ds.gguf", "deepseek_v3", "Q8_0")), return_tensors=False)


def test_deepseek2_keys_llama_cpp_leaves_out_read_as_it_does(tmp_path):
    """Absent group counts (llama.cpp: no groups; Kimi-K2 writes one group), scale (no scaling) and
    norm (not renormalised), and no q_lora_rank (a plain attn_q, DeepSeek-V2-Lite's layout)."""
    from expertcache.loaders.gguf import _hf_config

    header = read_header(write_gguf(tmp_path / "ds.gguf", "deepseek_v3", "Q8_0"))
    for key in ("expert_group_count", "expert_group_used_count", "expert_weights_scale", "expert_weights_norm",
                "attention.q_lora_rank"):
        header.metadata.pop(f"deepseek2.{key}")
    cfg = _hf_config(header)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.norm_topk_prob) == (1, 1, 1.0, False)
    assert cfg.q_lora_rank is None


@pytest.mark.parametrize("change,match", [
    ({"expert_gating_func": 1}, "gating softmax: the softmax routing of DeepSeek-V2/V2.5 is not read"),
    ({"expert_gating_func": None}, "gating none \\(llama.cpp reads softmax\\)"),
    ({"rope.scaling.yarn_log_multiplier": None}, "YaRN without rope.scaling.yarn_log_multiplier"),
    ({"rope.scaling.type": "linear"}, "RoPE scaling 'linear' in a deepseek2 file"),
    ({"rope.scaling.attn_factor": 0.5}, "rope.scaling.attn_factor = 0.5 is not reproduced"),
    ({"nextn_predict_layers": 1}, "multi-token-prediction layers .* are not read"),
    ({"leading_dense_block_count": 0}, "experts from block 1 but deepseek2.leading_dense_block_count = 0"),
    ({"attention.key_length_mla": 64}, "attn_q_b.weight has 192 rows but the deepseek2 keys give 256"),
    ({"expert_shared_count": 2}, "ffn_gate_shexp.weight has 512 rows but the deepseek2 keys give 1024"),
])
def test_a_deepseek2_file_llama_cpp_reads_otherwise_is_refused(tmp_path, change, match):
    """What transformers' DeepSeek-V3 would compute otherwise than llama.cpp, or keys that disagree
    with the tensors, is named in one line, not guessed."""
    from expertcache.loaders.gguf import _hf_config

    header = read_header(write_gguf(tmp_path / "ds.gguf", "deepseek_v3", "Q8_0"))
    for key, value in change.items():
        header.metadata.pop(f"deepseek2.{key}", None)
        if value is not None:
            header.metadata[f"deepseek2.{key}"] = value
    with pytest.raises(ValueError, match=match):
        _hf_config(header)


# -- bad input: one clear line, nothing half-loaded ---------------------------------------
def _write(path, arch, tensors, **kv):
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        writer.add_uint32(key, value)
    for name, (data, raw) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_dense_gguf_is_refused(tmp_path):
    path = _write(tmp_path / "dense.gguf", "llama", {"blk.0.ffn_up.weight": (np.zeros((8, 32), np.float32), None)})
    with pytest.raises(ValueError, match="dense model .*'llama'"):
        expertcache.offload(path, slots=4)


def test_unsupported_architecture_is_named(tmp_path):
    path = _write(tmp_path / "dbrx.gguf", "dbrx",
                  {"blk.0.ffn_gate_exps.weight": (np.zeros((4, 8, 32), np.float32), None)},
                  **{"dbrx.expert_count": 4})
    with pytest.raises(ValueError, match="'dbrx' \\(4 experts\\) is not supported.*qwen3moe.*deepseek2"):
        expertcache.offload(path, slots=4)


def test_expert_type_that_cannot_be_dequantized_is_named(tmp_path):
    kind = gguf.GGMLQuantizationType.TQ1_0
    elems, nbytes = gguf.GGML_QUANT_SIZES[kind]
    raw = np.zeros((4, 8, 256 // elems * nbytes), np.uint8)
    tensors = {f"blk.0.ffn_{p}_exps.weight": (raw, kind) for p in ("gate", "up")}
    tensors["blk.0.ffn_down_exps.weight"] = (np.zeros((4, 256, 8), np.float32), None)
    path = _write(tmp_path / "tq.gguf", "qwen3moe", tensors, **{"qwen3moe.expert_used_count": 2})
    with pytest.raises(ValueError, match="TQ1_0 cannot be dequantized"):
        expertcache.offload(path, slots=4)


def test_truncated_gguf(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", "qwen3_moe", "Q8_0")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match="truncated"):
        expertcache.offload(path, slots=4)
    path.write_bytes(data[:100])
    with pytest.raises(ValueError, match="not a readable GGUF|truncated"):
        expertcache.offload(path, slots=4)


def test_split_gguf_with_a_missing_part(tmp_path):
    first = write_gguf(tmp_path / "m.gguf", "qwen3_moe", "Q8_0", split_max_tensors=10)
    last = sorted(tmp_path.glob("m-*.gguf"))[-1]
    last.unlink()
    with pytest.raises(ValueError, match=f"parts missing \\({last.name}\\)"):
        expertcache.offload(first, slots=4)
    with pytest.raises(ValueError, match="give the first part"):
        expertcache.offload(sorted(tmp_path.glob("m-*.gguf"))[1], slots=4)


def test_imatrix_given_as_model(tmp_path):
    from test_imatrix_reader import write_imatrix

    path = write_imatrix(tmp_path / "imatrix.gguf")
    with pytest.raises(ValueError, match="imatrix file, not a model"):
        expertcache.offload(path, slots=4)


def test_missing_gguf_path():
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        expertcache.offload("/nonexistent/model.gguf", slots=4)


def test_capacity_below_top_k_counts_quantized_slots(tmp_path):
    path = write_gguf(tmp_path / "q8.gguf", "qwen3_moe", "Q8_0")
    with pytest.raises(ValueError, match="capacity below top-k"):
        expertcache.offload(path, gpu_memory="1MiB", slot_format="dequantized")


def test_loader_never_holds_dequantized_experts(tmp_path):
    """Peak RSS of a load stays far below the experts' float32 size (measured in a fresh process)."""
    import subprocess
    import sys
    import textwrap

    path = write_gguf(tmp_path / "big.gguf", "qwen3_moe", "Q4_0", experts=64, layers=4)
    f32_experts = 4 * 64 * 3 * 256 * 512 * 4  # 402 MB dequantized; the file holds 57 MB of Q4_0
    code = textwrap.dedent(f"""
        import resource, torch, expertcache, transformers, accelerate
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        model = expertcache.offload({str(path)!r}, slots=16, slot_format="quantized", host_memory="copy")
        print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = map(int, out.stdout.split()[-2:])
    assert after - before < f32_experts / 3, (before, after)
