"""Load a GGUF MoE model for the cache: the dense part dequantized (or, on the CPU with ggml,
left in its blocks too: ``gguf_dense.py``), the experts left in their blocks.

transformers' own GGUF loading dequantizes every tensor into host memory (a
Qwen3-30B-A3B Q4_K_M file becomes 60 GiB of bf16). Here transformers supplies what it
is good at (the config mapping, the GGUF -> HF tensor names, the tokenizer; for the archs it
does not map, gpt-oss, ``llama`` with experts (Mixtral) and ``olmoe``, the config comes from
llama.cpp's metadata keys here) and the model is built empty (``common.empty_model``); only the non-expert tensors are
dequantized and assigned. Each MoE layer's experts stay as byte views of the file
(``host_memory='mmap'``) or copies of those bytes (pinned with CUDA; both built by
``runtime.host``), in a ``QuantExperts`` with the ``Codec`` that turns them into the
weights the transformers experts module computes with.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf.constants import Keys

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
    if shared is not None:
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


# archs whose config comes from llama.cpp's keys here, not transformers' GGUF mapping
_OWN_MAPPING = {"gpt-oss": _gpt_oss_values, "llama": _unscaled_values, "olmoe": _unscaled_values}
# model_type -> its config's name for one expert's FF size and for the number of experts
_EXPERT_FF_KEY = {"gpt_oss": "intermediate_size", "mixtral": "intermediate_size", "olmoe": "intermediate_size"}
_EXPERT_COUNT_KEY = {"gpt_oss": "num_local_experts", "mixtral": "num_local_experts"}


def _load_dense(model, header: GgufModel, hf_config, dtype: torch.dtype, dense) -> None:
    """Dequantize every non-expert tensor and assign it under its transformers name, except
    those ``gguf_dense.place_stored`` leaves in the file for ggml (``dense``: its report)."""
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map)

    processor = TENSOR_PROCESSORS.get(header.arch, TensorProcessor)(config=hf_config.to_dict())
    # the arch named: gguf-py has no "mixtral" (llama.cpp writes it as "llama")
    names = get_gguf_hf_weights_map(model, processor, model_type=header.arch)
    for block in range(hf_config.num_hidden_layers):  # GPT-OSS's sinks: not in gguf-py's name map
        names.setdefault(f"blk.{block}.attn_sinks.weight", f"model.layers.{block}.self_attn.sinks")
    stored = place_stored(model, header, names, processor, dtype, dense)
    state = {}
    for name, ref in header.tensors.items():
        if _EXPERT.match(name) or name in stored:
            continue
        weights = _dequantized(ref).numpy()
        result = processor.process(weights=weights, name=name, tensor_key_mapping=names,
                                   parsed_parameters={"tensors": {}})
        if result.name in names:
            state[names[result.name]] = torch.from_numpy(np.ascontiguousarray(result.weights)).to(dtype)
    expert_params = {f"{n}.{p}" for n, m in model.named_modules() for p, _ in m.named_parameters(recurse=False)
                     if ".experts" in n or n.endswith("experts")}
    missing = set(model.load_state_dict(state, strict=False, assign=True).missing_keys) - expert_params
    if getattr(hf_config, "tie_word_embeddings", False):
        if not tie_stored(model, dense):
            model.tie_weights()
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"{header.paths[0].name}: tensors missing for {len(missing)} model weights "
                         f"({', '.join(sorted(missing)[:4])}{', ...' if len(missing) > 4 else ''}); "
                         "the file does not match transformers' layout for this architecture")


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
    return build_tiered(layers, codecs, header.num_experts, header.top_k, config.host_budget,
                        config.host_policy, device)


def load_gguf_tokenizer(path: Path):
    """The tokenizer stored in the GGUF metadata (transformers converts it)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    header = read_header(path)
    first = header.paths[0]
    # Given a gguf_file, AutoTokenizer builds the model config with load_gguf_checkpoint only to
    # pick the tokenizer class from its model_type: a full GGUFReader parse (14.3 s on a 731 MiB
    # Qwen3-MoE file). tokenizer_type names that model_type, so AutoTokenizer takes the class from
    # its own table; the tokenizer itself is still converted by transformers from the file.
    # GPT-OSS: AutoTokenizer's config goes through transformers' gpt-oss mapping, which crashes.
    if header.arch == "gpt-oss":
        cls, kwargs = PreTrainedTokenizerFast, {}
    else:
        cls, kwargs = AutoTokenizer, {"tokenizer_type": header.model_type}
    try:
        return cls.from_pretrained(first.parent, gguf_file=first.name, **kwargs)
    except (KeyError, ValueError, OSError) as err:
        raise ValueError(f"{path}: no usable tokenizer in the GGUF metadata (tokenizer.ggml.*: {err}); "
                         "use a GGUF converted with its tokenizer") from None
