"""Load a GGUF MoE model for the cache: the dense part dequantized (or, on the CPU with ggml,
left in its blocks too: ``gguf_dense.py``), the experts left in their blocks.

transformers' own GGUF loading dequantizes every tensor into host memory (a
Qwen3-30B-A3B Q4_K_M file becomes 60 GiB of bf16). Here transformers supplies what it
is good at (the config mapping, the GGUF -> HF tensor names, the tokenizer; for the archs it
does not map, gpt-oss, ``llama`` with experts (Mixtral), ``olmoe`` and ``deepseek2``
(DeepSeek-V3/R1, Kimi-K2: their MLA's kv_b_proj rebuilt from llama.cpp's split k_b / v_b), the
config comes from llama.cpp's metadata keys here) and the model is built empty (``common.empty_model``); only the non-expert tensors are
dequantized and assigned. Each MoE layer's experts stay as byte views of the file
(``host_memory='mmap'``) or copies of those bytes (pinned with CUDA; both built by
``runtime.host``), in a ``QuantExperts`` with the ``Codec`` that turns them into the
weights the transformers experts module computes with.
"""

from __future__ import annotations

import functools
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from gguf.constants import ExpertGatingFuncType, Keys

from ..config import CacheConfig
from ..ggufmodel.header import _EXPERT, VOCAB_ARRAYS, GgufModel, TensorRef, read_header
from ..ggufmodel.reader import read_gguf, write_metadata_only
from ..quant.dequant import dequantize
from ..runtime.device import compute_dtype
from ..runtime.host import file_bytes, host_mode
from ..runtime.quantized import Codec, Kind, Part, QuantExperts
from ..runtime.cpudense import REPORT_ATTR
from .common import drop_expert_params, empty_model, find_experts
from .gguf_dense import dense_choice, place_stored, tie_stored

# GGUF archs whose gate/up rows alternate in the model (GPT-OSS's _apply_gate reads them so)
_INTERLEAVED = {"gpt-oss"}
# DeepSeek's kv_b_proj as llama.cpp's converter splits it (per head: k rows transposed, v rows)
_MLA_SPLIT = re.compile(r"^blk\.(\d+)\.attn_([kv])_b\.weight$")


def load_gguf(path: str | Path, config: CacheConfig, device: torch.device):
    """(model with empty experts modules, [(name, experts module)], [QuantExperts per layer], header)."""
    header = read_header(path)
    # decided before any tensor is read: host_memory='copy' without the RAM for it fails first
    tiered = config.host_memory == "tiered"
    mode, reason = ("tiered", "") if tiered else \
        host_mode(config.host_memory, device, "GGUF experts", header.experts_bytes)
    dtype = compute_dtype(config.dtype, device)
    hf_config = _hf_config(header)
    model = empty_model(hf_config, dtype)
    dense = dense_choice(config.cpu_kernel, device)
    _load_dense(model, header, hf_config, dtype, dense)
    setattr(model, REPORT_ATTR, dense)
    found = find_experts(model)
    if len(found) != len(header.moe_blocks):
        raise ValueError(f"{header.paths[0].name}: the model has {len(found)} MoE layers but the file "
                         f"has experts in {len(header.moe_blocks)} blocks")
    codecs = [expert_codec(header.experts[block], header.arch, dtype) for block in header.moe_blocks]
    if tiered:  # a RAM tier over the file, read around the page cache (runtime/tiered.py)
        hosts = _tiered_hosts(header, codecs, config, device)
    else:
        hosts = [QuantExperts(_part_tensors(header.experts[block], mode), codec, mode, reason)
                 for block, codec in zip(header.moe_blocks, codecs)]
    drop_expert_params(found)
    return model.eval(), found, hosts, header


def expert_codec(layer: dict[str, TensorRef], arch: str, dtype: torch.dtype) -> Codec:
    """How one layer's expert tensors become gate_up_proj / down_proj (and biases)."""
    first = layer
    parts = tuple(Part(name, ref.fmt, ref.shape[1:]) for name, ref in sorted(first.items()))
    join = "interleave" if arch in _INTERLEAVED else "concat"
    kinds = []
    for suffix, proj in (("weight", "gate_up_proj"), ("bias", "gate_up_proj_bias")):
        if f"gate_up.{suffix}" in first:
            kinds.append(Kind(proj, "one", (f"gate_up.{suffix}",)))
        elif f"gate.{suffix}" in first:
            kinds.append(Kind(proj, join, (f"gate.{suffix}", f"up.{suffix}")))
    kinds.append(Kind("down_proj", "one", ("down.weight",)))
    if "down.bias" in first:
        kinds.append(Kind("down_proj_bias", "one", ("down.bias",)))
    return Codec(parts, tuple(kinds), dtype)


def _hf_config(header: GgufModel):
    """transformers' config mapping (or, for the archs it does not map, ours from llama.cpp's
    metadata keys), corrected by the tensor shapes it does not read."""
    from transformers import AutoConfig

    own = _OWN_MAPPING.get(header.arch)
    values = own(header) if own else transformers_config(header.paths[0])  # less tie_word_embeddings: below
    # transformers 5.24 ignores expert_feed_forward_length (and the shared expert's size)
    values[_EXPERT_FF_KEY.get(header.model_type, "moe_intermediate_size")] = header.expert_ff
    shared = header.tensors.get(f"blk.{header.moe_blocks[0]}.ffn_gate_shexp.weight")
    if shared is not None and "n_shared_experts" not in values:  # DeepSeek: expert FF x n_shared_experts
        values["shared_expert_intermediate_size"] = shared.shape[0]
    # transformers looks for output.weight in the first file only; in a split model it may be in another
    values["tie_word_embeddings"] = "output.weight" not in header.tensors
    embed = header.tensors.get("token_embd.weight")
    if embed is not None:
        values["vocab_size"] = embed.shape[0]
    values.pop("model_type", None)
    return AutoConfig.for_model(header.model_type, **values)


def transformers_config(path: Path) -> dict:
    """``load_gguf_checkpoint(path)["config"]`` less ``tie_word_embeddings``: transformers' own
    mapping, run on a copy of the file's metadata without the vocabulary arrays.

    ``load_gguf_checkpoint`` parses every field with gguf-py's GGUFReader, element by element,
    the vocabulary too (14.3 s on a 731 MiB Qwen3-MoE file), though the config uses only its length.
    Of the tensors it only asks which exist: output.weight, for tie_word_embeddings (left out
    here: ``_hf_config`` sets it from the tensors), and stablelm's biases (not an architecture
    run here). So it gets a tiny GGUF: the metadata entries copied byte for byte
    (``write_metadata_only``), no tensors and, where the file has no ``{arch}.vocab_size``, that
    key set to the number of tokens: what transformers falls back to (``vocab_size =
    len(tokens)``), and without it it would log a warning. A temporary file, since the function
    takes a path.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    source = read_gguf(path, skip=VOCAB_ARRAYS)
    if not source.raw:  # read through gguf-py (big-endian, other versions): no bytes to copy
        values = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    else:
        with tempfile.TemporaryDirectory(prefix="expertcache-gguf-") as tmp:
            copy = write_metadata_only(source, Path(tmp) / path.name, drop=VOCAB_ARRAYS,
                                       extra_uint32=_vocab_size_stand_in(source))
            values = dict(load_gguf_checkpoint(str(copy), return_tensors=False)["config"])
    values.pop("tie_word_embeddings", None)  # the copy has no tensors, so it would say True
    return values


def _vocab_size_stand_in(source) -> dict[str, int]:
    """``{arch}.vocab_size`` set to the token count, unless the file states it (transformers then uses that)."""
    tokens = source.fields.get("tokenizer.ggml.tokens")
    arch = source.fields.get("general.architecture")
    if tokens is None or arch is None:
        return {}
    key = Keys.LLM.VOCAB_SIZE.format(arch=arch.value)
    return {} if key in source.fields else {key: tokens.count}


def _gpt_oss_values(header: GgufModel) -> dict:
    """GptOssConfig values from llama.cpp's gpt-oss metadata keys (transformers 5.24 crashes
    reading its rope metadata)."""
    values = _llama_cpp_values(header)
    sliding = header.metadata.get("gpt-oss.attention.sliding_window")
    if sliding is not None:
        values["sliding_window"] = sliding
    rope = {"rope_type": "default", "rope_theta": float(header.metadata.get("gpt-oss.rope.freq_base", 150000.0))}
    factor = header.metadata.get("gpt-oss.rope.scaling.factor")
    if factor is not None:
        original = header.metadata.get("gpt-oss.rope.scaling.original_context_length", 4096)
        rope.update(rope_type="yarn", factor=float(factor), beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=int(original))
    values["rope_parameters"] = rope
    return values


def _unscaled_values(header: GgufModel) -> dict:
    """MixtralConfig / OlmoeConfig values from llama.cpp's metadata keys (transformers maps no
    GGUF of either: Mixtral is arch ``llama`` with experts, which it reads as a dense Llama).
    Their RoPE is unscaled and covers the whole head; anything else is refused, not guessed."""
    meta, arch = header.metadata, header.arch
    values = _llama_cpp_values(header)
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{header.paths[0].name}: RoPE scaling {scaling!r} in a {arch} MoE file is not read "
                         "(Mixtral and OLMoE use unscaled RoPE)")
    head_dim = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    if meta.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{header.paths[0].name}: RoPE over {meta[f'{arch}.rope.dimension_count']} of "
                         f"{head_dim} head dimensions (partial rotary) is not read for {arch}")
    values["rope_parameters"] = {"rope_type": "default",
                                 "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0))}
    values.setdefault("pad_token_id", None)  # not the config class's default id, which names another vocabulary
    if arch == "olmoe":  # llama.cpp's OLMoE: no renormalised top-k weights, no qkv clipping
        values.update(norm_topk_prob=False, clip_qkv=None)
    return values


def _llama_cpp_values(header: GgufModel) -> dict:
    """The config values every llama.cpp MoE arch states under ``{arch}.*`` and ``tokenizer.ggml.*``."""
    meta, arch = header.metadata, header.arch
    keys = {"num_hidden_layers": "block_count", "max_position_embeddings": "context_length",
            "hidden_size": "embedding_length", "num_attention_heads": "attention.head_count",
            "num_key_value_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
            "rms_norm_eps": "attention.layer_norm_rms_epsilon", "num_experts_per_tok": "expert_used_count",
            _EXPERT_COUNT_KEY.get(header.model_type, "num_experts"): "expert_count"}
    values = {name: meta[f"{arch}.{key}"] for name, key in keys.items() if f"{arch}.{key}" in meta}
    for name in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if f"tokenizer.ggml.{name}" in meta:
            values[name.replace("padding", "pad")] = int(meta[f"tokenizer.ggml.{name}"])
    return values


def _deepseek_values(header: GgufModel) -> dict:
    """DeepseekV3Config values from llama.cpp's ``deepseek2`` keys (DeepSeek-V3/R1, Kimi-K2:
    transformers maps no GGUF of them).

    llama.cpp's converter writes multi-head latent attention as MQA over the latent: one kv
    head, ``key_length`` kv_lora_rank + rope dims, ``value_length`` kv_lora_rank; a head's sizes
    are ``key_length_mla`` / ``value_length_mla`` (files before the k_b / v_b split: ``key_length``
    / ``value_length`` themselves). transformers' DeepSeek-V3 routes by sigmoid; the softmax
    routing of DeepSeek-V2/V2.5 files (``expert_gating_func`` softmax, or absent: llama.cpp then
    reads softmax) is refused, as is what transformers would compute otherwise than llama.cpp.
    """
    meta, name = header.metadata, header.paths[0].name

    def key(suffix, default=None):
        return meta.get(f"deepseek2.{suffix}", default)
    gating = key("expert_gating_func")
    if gating != ExpertGatingFuncType.SIGMOID:
        told = "none (llama.cpp reads softmax)" if gating is None else _GATING.get(gating, gating)
        raise ValueError(f"{name}: deepseek2 expert gating {told}: the softmax routing of DeepSeek-V2/V2.5 "
                         "is not read (transformers' DeepSeek-V3 routes by sigmoid; V3, R1 and Kimi-K2 files load)")
    for suffix, what in (("nextn_predict_layers", "multi-token-prediction layers"),
                         ("attention.temperature_scale", "attention temperature scaling")):
        if key(suffix):
            raise ValueError(f"{name}: deepseek2 {what} ({suffix} = {key(suffix)}) are not read")
    values = _llama_cpp_values(header)
    values.pop("head_dim", None)  # key_length: the latent's, not a head's (the config sets head_dim)
    values["num_key_value_heads"] = values["num_attention_heads"]  # MLA expands the latent for each head
    rope = key("rope.dimension_count")
    head_k = key("attention.key_length_mla") or key("attention.key_length")
    head_v = key("attention.value_length_mla") or key("attention.value_length")
    values.update(q_lora_rank=key("attention.q_lora_rank"), kv_lora_rank=key("attention.kv_lora_rank"),
                  qk_rope_head_dim=rope, qk_nope_head_dim=head_k - rope, v_head_dim=head_v,
                  first_k_dense_replace=key("leading_dense_block_count", 0),
                  intermediate_size=key("feed_forward_length"), n_shared_experts=key("expert_shared_count", 0),
                  # llama.cpp: an absent (or zero) scale does not scale; group count 0: no groups
                  routed_scaling_factor=float(key("expert_weights_scale") or 1.0),
                  norm_topk_prob=bool(key("expert_weights_norm", False)),
                  n_group=key("expert_group_count") or 1, topk_group=key("expert_group_used_count") or 1,
                  rope_interleave=True, attention_bias=False,  # ggml's RoPE rotates adjacent pairs, as DeepSeek's
                  rope_parameters=_deepseek_rope(meta, name), pad_token_id=values.get("pad_token_id"),
                  num_mtp_layers=0)  # the converter leaves the MTP layers out (nextn refused above)
    _check_deepseek_shapes(header, values)
    return values


def _deepseek_rope(meta: dict, name: str) -> dict:
    """transformers' rope_parameters for what llama.cpp computes from a deepseek2 file's RoPE keys.

    YaRN: llama.cpp reads ``yarn_log_multiplier`` as 0.1 x transformers' ``mscale_all_dim``
    and takes ``mscale`` equal to it (its files do not store mscale; DeepSeek-V2 and V3 set
    the two equal), so the rotary dims are not rescaled and q.k is scaled by
    ``yarn_get_mscale(factor, mscale_all_dim)`` squared, as transformers' ``yarn_apply_mscale``.
    Without the multiplier llama.cpp would still scale q.k by YaRN's mscale, transformers not:
    refused, like an attention factor (llama.cpp and transformers read it differently).
    """
    rope = {"rope_type": "default", "rope_theta": float(meta.get("deepseek2.rope.freq_base", 10000.0))}
    scaling = meta.get("deepseek2.rope.scaling.type", "none")
    if scaling == "none":
        return rope
    if scaling != "yarn":
        raise ValueError(f"{name}: RoPE scaling {scaling!r} in a deepseek2 file is not read (DeepSeek uses YaRN)")
    for suffix in ("attn_factor", "yarn_attn_factor"):
        value = meta.get(f"deepseek2.rope.scaling.{suffix}")
        if value is not None and value != 1.0:
            raise ValueError(f"{name}: deepseek2 rope.scaling.{suffix} = {value} is not reproduced "
                             "(llama.cpp and transformers apply it differently)")
    log_mul = meta.get("deepseek2.rope.scaling.yarn_log_multiplier")
    if not log_mul:
        raise ValueError(f"{name}: deepseek2 YaRN without rope.scaling.yarn_log_multiplier: llama.cpp then scales "
                         "the whole q.k by YaRN's mscale and transformers only the rotary part; not reproduced")
    mscale = round(float(log_mul) / 0.1, 6)  # stored as float32 0.1 * mscale_all_dim
    rope.update(rope_type="yarn", factor=float(meta["deepseek2.rope.scaling.factor"]),
                original_max_position_embeddings=int(meta["deepseek2.rope.scaling.original_context_length"]),
                beta_fast=float(meta.get("deepseek2.rope.scaling.yarn_beta_fast", 32.0)),
                beta_slow=float(meta.get("deepseek2.rope.scaling.yarn_beta_slow", 1.0)),
                mscale=mscale, mscale_all_dim=mscale, truncate=True)  # truncate: ggml floors / ceils the ramp
    return rope


def _check_deepseek_shapes(header: GgufModel, values: dict) -> None:
    """The head sizes read from the keys against the first MoE block's tensors: a file the keys
    misdescribe fails here in one line, not as a shape error deep in loading."""
    block, heads = header.moe_blocks[0], values["num_attention_heads"]
    head_k = values["qk_nope_head_dim"] + values["qk_rope_head_dim"]
    q = header.tensors.get(f"blk.{block}.attn_q_b.weight") or header.tensors.get(f"blk.{block}.attn_q.weight")
    shexp = header.tensors.get(f"blk.{block}.ffn_gate_shexp.weight")
    checks = [(q, heads * head_k, "q rows (heads x (nope + rope dims))"),
              (shexp, header.expert_ff * values["n_shared_experts"], "shared expert rows (expert FF x shared count)")]
    for ref, rows, what in checks:
        if ref is not None and ref.shape[0] != rows:
            raise ValueError(f"{header.paths[0].name}: {ref.name} has {ref.shape[0]} rows but the deepseek2 keys "
                             f"give {rows} {what}")
    if values["first_k_dense_replace"] != block:
        raise ValueError(f"{header.paths[0].name}: experts from block {block} but deepseek2.leading_dense_block_count "
                         f"= {values['first_k_dense_replace']}")


# archs whose config comes from llama.cpp's keys here, not transformers' GGUF mapping
_OWN_MAPPING = {"gpt-oss": _gpt_oss_values, "llama": _unscaled_values, "olmoe": _unscaled_values,
                "deepseek2": _deepseek_values}
# model_type -> its config's name for one expert's FF size and for the number of experts
_EXPERT_FF_KEY = {"gpt_oss": "intermediate_size", "mixtral": "intermediate_size", "olmoe": "intermediate_size"}
_EXPERT_COUNT_KEY = {"gpt_oss": "num_local_experts", "mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts"}
_GATING = {int(t): t.name.lower() for t in ExpertGatingFuncType}


@contextmanager
def one_name_map():
    """gguf-py's ``get_tensor_name_map`` built once per (arch, layers) inside the block.

    transformers' ``get_gguf_hf_weights_map`` walks the model's modules recursively and builds
    gguf-py's ``TensorNameMap`` (every name of every block) anew in each call: 679 times for a
    48-layer Qwen3-MoE, 22 s of a 54 s load (EPYC sandbox). It imports the function from the
    ``gguf`` module at each call, so a cached one in its place serves them all (pinned by
    tests/test_gguf_names.py)."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def _load_dense(model, header: GgufModel, hf_config, dtype: torch.dtype, dense) -> None:
    """Dequantize every non-expert tensor and assign it under its transformers name, except
    those ``gguf_dense.place_stored`` leaves in the file for ggml (``dense``: its report)."""
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map)

    processor = TENSOR_PROCESSORS.get(header.arch, TensorProcessor)(config=hf_config.to_dict())
    # the arch named: gguf-py has no "mixtral" (llama.cpp writes it as "llama")
    with one_name_map():
        names = get_gguf_hf_weights_map(model, processor, model_type=header.arch)
    for block in range(hf_config.num_hidden_layers):  # not in gguf-py's name map: GPT-OSS's sinks,
        names.setdefault(f"blk.{block}.attn_sinks.weight", f"model.layers.{block}.self_attn.sinks")
        # DeepSeek's router bias (llama.cpp's converter renames e_score_correction_bias to .bias)
        names.setdefault(f"blk.{block}.exp_probs_b.bias", f"model.layers.{block}.mlp.gate.e_score_correction_bias")
    stored = place_stored(model, header, names, processor, dtype, dense)
    # transformers' float32-only weights (DeepSeek's router and its bias) stay float32, as from_pretrained keeps them
    fp32 = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    state, mla = {}, {}
    for name, ref in header.tensors.items():
        if _EXPERT.match(name) or name in stored:
            continue
        weights = _dequantized(ref).numpy()
        split = _MLA_SPLIT.match(name)
        if split:  # kv_b_proj rebuilt once both halves are read (each half dropped then)
            mla.setdefault(split[1], {})[split[2]] = weights
            if len(mla[split[1]]) == 2:
                halves = mla.pop(split[1])
                state[f"model.layers.{split[1]}.self_attn.kv_b_proj.weight"] = _mla_kv_b(**halves).to(dtype)
            continue
        result = processor.process(weights=weights, name=name, tensor_key_mapping=names,
                                   parsed_parameters={"tensors": {}})
        if result.name in names:
            hf_name = names[result.name]
            kept = torch.float32 if any(part in hf_name for part in fp32) else dtype
            state[hf_name] = torch.from_numpy(np.ascontiguousarray(result.weights)).to(kept)
    if mla:
        block, (half,) = next(iter(mla.items()))
        raise ValueError(f"{header.paths[0].name}: blk.{block}.attn_{half}_b.weight without its other half "
                         f"(attn_{'v' if half == 'k' else 'k'}_b): the file's latent attention is incomplete")
    expert_params = {f"{n}.{p}" for n, m in model.named_modules() for p, _ in m.named_parameters(recurse=False)
                     if ".experts" in n or n.endswith("experts")}
    missing = set(model.load_state_dict(state, strict=False, assign=True).missing_keys) - expert_params
    # a deepseek2 file without exp_probs_b: llama.cpp adds no bias; the buffer's zeros add none either
    missing = {m for m in missing if not m.endswith("e_score_correction_bias")}
    if getattr(hf_config, "tie_word_embeddings", False):
        if not tie_stored(model, dense):
            model.tie_weights()
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"{header.paths[0].name}: tensors missing for {len(missing)} model weights "
                         f"({', '.join(sorted(missing)[:4])}{', ...' if len(missing) > 4 else ''}); "
                         "the file does not match transformers' layout for this architecture")


def _mla_kv_b(k: np.ndarray, v: np.ndarray) -> torch.Tensor:
    """transformers' ``kv_b_proj.weight`` of a layer from llama.cpp's ``attn_k_b`` / ``attn_v_b``.

    llama.cpp's converter splits kv_b_proj [heads * (nope + v), kv_lora] per head into its k
    rows, transposed (for MLA's absorbed q.k), and its v rows; this undoes exactly that.
    k: [heads, kv_lora, nope], v: [heads, v, kv_lora] -> [heads * (nope + v), kv_lora].
    """
    kv_lora = k.shape[1]
    kv_b = np.concatenate([k.transpose(0, 2, 1), v], axis=1)                      # [heads, nope + v, kv_lora]
    return torch.from_numpy(kv_b.reshape(-1, kv_lora))


def _dequantized(ref: TensorRef) -> torch.Tensor:
    """A (small, non-expert) tensor as float32, read from the file."""
    data = np.fromfile(ref.file, dtype=np.uint8, count=ref.nbytes, offset=ref.offset)
    return dequantize(torch.from_numpy(data), ref.fmt, ref.shape, torch.float32)


def _part_tensors(parts: dict[str, TensorRef], mode: str) -> dict[str, torch.Tensor]:
    """One layer's expert tensors as [E, bytes per expert] uint8: file views or copies."""
    return {name: file_bytes(ref.file, ref.offset, ref.shape[0], ref.nbytes // ref.shape[0], mode)
            for name, ref in parts.items()}


def _tiered_hosts(header: GgufModel, codecs: list[Codec], config: CacheConfig, device: torch.device):
    from ..runtime.tiered import PartRange, build_tiered

    layers = [{name: PartRange(ref.file, ref.offset, ref.nbytes // ref.shape[0])
               for name, ref in header.experts[block].items()} for block in header.moe_blocks]
    # the dense weights: dequantized already, or read by ggml through the page cache (budget 'auto' leaves them room)
    dense = sum(p.stat().st_size for p in header.paths) - header.experts_bytes
    return build_tiered(layers, codecs, header.num_experts, header.top_k, config.host_budget,
                        config.host_policy, device, dense_bytes=dense)


def load_gguf_tokenizer(path: Path):
    """The tokenizer stored in the GGUF metadata (transformers converts it)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    header = read_header(path)
    first = header.paths[0]
    # Given a gguf_file, AutoTokenizer builds the model config with load_gguf_checkpoint only to
    # pick the tokenizer class from its model_type: a full GGUFReader parse (14.3 s on a 731 MiB
    # Qwen3-MoE file). tokenizer_type names that model_type, so AutoTokenizer takes the class from
    # its own table; the tokenizer itself is still converted by transformers from the file.
    # GPT-OSS: AutoTokenizer's config goes through transformers' gpt-oss mapping, which crashes;
    # deepseek_v3 has no entry in AutoTokenizer's table (its checkpoints ship their tokenizer class).
    if header.arch in ("gpt-oss", "deepseek2"):
        cls, kwargs = PreTrainedTokenizerFast, {}
    else:
        cls, kwargs = AutoTokenizer, {"tokenizer_type": header.model_type}
    try:
        return cls.from_pretrained(first.parent, gguf_file=first.name, **kwargs)
    except (KeyError, ValueError, OSError) as err:
        raise ValueError(f"{path}: no usable tokenizer in the GGUF metadata (tokenizer.ggml.*: {err}); "
                         "use a GGUF converted with its tokenizer") from None
