"""A safetensors checkpoint under ``host_memory='tiered'``: experts read by offset, never loaded whole.

For checkpoints larger than RAM (DeepSeek-V3 / Kimi-K2 in block FP8, Qwen3-235B in bf16).
``from_pretrained`` would load every expert; here the model is built empty
(``common.empty_model``), the dense tensors are read with ``safe_open`` and assigned
(``hf_quant._load_dense``, FP8 linears dequantized), and each MoE layer's experts become
``PartRange``s of the RAM tier (runtime/tiered.py): per expert and part, the file and offset
the safetensors header gives (``ggufmodel/safetensors.py``). The tier reads them with ``O_DIRECT``
as it does a GGUF's.

Which checkpoint tensors make up an experts module's weights is transformers' own table
(``conversion_mapping.get_checkpoint_conversion_mapping``: e.g. Qwen3-MoE's
``mlp.experts.*.gate_proj.weight`` + ``*.up_proj.weight`` -> ``mlp.experts.gate_up_proj``,
merged over experts and concatenated; Mixtral's ``block_sparse_moe`` renamed ``mlp``), read
here into a ``Codec`` of the stored parts: float parts (``BF16`` / ``F16`` / ``F32``) or FP8
weights with their ``weight_scale_inv`` tiles. A checkpoint whose experts are already one
tensor per layer in the module's own layout (``[E, rows, cols]``) is read as such.
Not read by offset: GPT-OSS's MXFP4 (its blocks are repacked for ggml at load) and transposed
fused experts; those say so in one line.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from ..config import CacheConfig
from ..quant.formats import quant_format
from ..quant.hf import FP8_E4M3
from ..runtime.device import compute_dtype
from ..runtime.host import expert_kinds
from ..runtime.quantized import Codec, Kind, Part
from ..runtime.tiered import PartRange, build_tiered
from .checkpoint import check_checkpoint_dir
from .common import drop_expert_params, empty_model, find_experts
from .hf_quant import _Checkpoint, _check_shapes, _load_dense, _quant_settings
from ..ggufmodel.safetensors import StoredTensor, stored_tensors

_FLOATS = ("BF16", "F16", "F32")


def load_tiered_checkpoint(path: str | Path, config: CacheConfig, device: torch.device):
    """(model with empty experts modules, [(name, experts module)], [TieredExperts per layer])."""
    from transformers import AutoConfig

    path = Path(path)
    check_checkpoint_dir(path)
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    qcfg = _quant_config(path, hf_config)
    dtype = compute_dtype(config.dtype, device)
    model = empty_model(hf_config, dtype)
    found = find_experts(model)
    stored = stored_tensors(path)
    rename = renamer(hf_config.model_type)
    by_model_name = {rename(k): k for k in stored}   # the name transformers gives it -> the stored name
    converters = _converters(hf_config.model_type)
    layers, codecs = [], []
    for name, module in found:
        ranges, codec = _layer(stored, by_model_name, converters, name, module, qcfg, dtype, path)
        _check_shapes(name, module, codec)
        layers.append(ranges)
        codecs.append(codec)
    num_experts = found[0][1].num_experts
    experts = sum(part.nbytes for layer in layers for part in layer.values()) * num_experts
    dense = max(sum(t.nbytes for t in stored.values()) - experts, 0)  # loaded below, after the tier
    hosts = build_tiered(layers, codecs, num_experts, _top_k(hf_config), config.host_budget,
                         config.host_policy, device, dense_bytes=dense)
    with _Checkpoint(path) as ckpt:
        _load_dense(model, ckpt, tuple(name + "." for name, _ in found), qcfg or {}, path, rename)
    drop_expert_params(found)
    return model.eval(), found, hosts


def renamer(model_type: str):
    """Checkpoint name -> the model's, by transformers' renamings for ``model_type`` (regexes,
    applied in order, as its loader applies them)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    rules = [(re.compile(src), tgt) for rule in (get_checkpoint_conversion_mapping(model_type) or [])
             if type(rule).__name__ == "WeightRenaming"
             for src, tgt in zip(rule.source_patterns, rule.target_patterns)]

    def rename(key: str) -> str:
        for pattern, target in rules:
            key = pattern.sub(target, key)
        return key
    return rename


def _converters(model_type: str) -> list[tuple[list[str], str, list[str]]]:
    """transformers' expert merges for ``model_type``: (source patterns, target pattern, operation names)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    out = []
    for rule in get_checkpoint_conversion_mapping(model_type) or []:
        if type(rule).__name__ == "WeightConverter":
            ops = [type(op).__name__ for op in rule.operations]
            for target in rule.target_patterns:
                out.append((list(rule.source_patterns), target, ops))
    return out


def _quant_config(path: Path, hf_config) -> dict | None:
    """None for a float checkpoint; block FP8's settings; MXFP4 refused (read at load, not by offset)."""
    raw = getattr(hf_config, "quantization_config", None)
    if not raw:
        return None
    qcfg = _quant_settings(path, raw)
    if qcfg["quant_method"] == "mxfp4":
        raise ValueError(f"{path}: host_memory='tiered' does not read GPT-OSS MXFP4 checkpoints by offset (their "
                         "blocks are repacked for ggml at load); convert the model to GGUF (llama.cpp's "
                         "convert_hf_to_gguf.py keeps MXFP4) or use host_memory='auto'")
    del hf_config.quantization_config  # plain experts modules: the cache serves them
    return qcfg


def _top_k(hf_config) -> int:
    for name in ("num_experts_per_tok", "top_k", "moe_topk"):
        if getattr(hf_config, name, None):
            return int(getattr(hf_config, name))
    raise ValueError(f"{type(hf_config).__name__}: no num_experts_per_tok in config.json; the RAM tier needs top-k")


def _layer(stored: dict[str, StoredTensor], by_model_name: dict[str, str], converters, name: str, module,
           qcfg, dtype: torch.dtype, path: Path) -> tuple[dict[str, PartRange], Codec]:
    """One MoE layer's parts: where each expert's bytes are, and the codec that joins them."""
    if getattr(module, "is_transposed", False):
        raise ValueError(f"{path}: {name} holds its experts transposed ({type(module).__name__}); the RAM tier "
                         "does not read such checkpoints by offset. Convert the model to GGUF, or use "
                         "host_memory='auto'")
    experts = module.num_experts
    ranges, parts, kinds = {}, [], []
    for kind in expert_kinds(module):
        fused = f"{name}.{kind}"
        sources = _sources(converters, fused, experts, by_model_name)
        if sources is None and fused in by_model_name:    # one tensor [E, ...] in the module's layout
            sources = [(kind.removesuffix("_proj").removesuffix("_bias"), [by_model_name[fused]])]
        if sources is None:
            raise ValueError(f"{path}: no tensors for {fused} (neither per expert, as transformers maps "
                             f"{type(module).__name__}, nor fused); the checkpoint does not match the model")
        names = []
        for short, keys in sources:
            suffix = "bias" if kind.endswith("_bias") else "weight"
            part_names = _add_part(f"{short}.{suffix}", [stored[k] for k in keys], keys, experts, qcfg, ranges,
                                   parts, stored)
            names += part_names
        join = "fp8" if len(names) > len(sources) else ("concat" if len(names) > 1 else "one")
        block = qcfg["weight_block_size"] if join == "fp8" else None
        kinds.append(Kind(kind, join, tuple(names), block))
    return ranges, Codec(tuple(parts), tuple(kinds), dtype)


def _sources(converters, fused: str, experts: int, by_model_name: dict[str, str]):
    """[(short name, [stored key per expert])] for ``fused`` from transformers' merge rules, or None."""
    for sources, target, ops in converters:
        tail = target.lstrip(".")
        if not fused.endswith(tail) or "MergeModulelist" not in ops:
            continue
        prefix = fused[:-len(tail)]
        out = []
        for i, pattern in enumerate(sources):
            keys = [by_model_name.get(prefix + pattern.lstrip(".").replace("*", str(e))) for e in range(experts)]
            if any(k is None for k in keys):
                missing = prefix + pattern.lstrip(".").replace("*", str(keys.index(None)))
                raise ValueError(f"{missing} is missing from the checkpoint (transformers builds {fused} from "
                                 f"{', '.join(sources)}); the checkpoint is incomplete")
            out.append((_short(fused, i, len(sources)), keys))
        return out
    return None


def _short(fused: str, i: int, n: int) -> str:
    """The part's name: gate / up for a concatenated gate_up, else the kind's own."""
    if n == 2:
        return ("gate", "up")[i]
    return fused.rsplit(".", 1)[1].removesuffix("_proj")


def _add_part(part: str, tensors: list[StoredTensor], keys: list[str], experts: int, qcfg, ranges: dict,
              parts: list, stored: dict[str, StoredTensor]) -> list[str]:
    """Ranges and a ``Part`` for ``part`` (one tensor per expert, or one ``[E, ...]`` tensor);
    an FP8 weight brings its scale part too. Returns the part names added."""
    first = tensors[0]
    if len({(t.dtype, t.shape) for t in tensors}) > 1:
        raise ValueError(f"{keys[0]} and the other experts' tensors differ in dtype or shape; the checkpoint is damaged")
    if len(tensors) == 1:        # fused: expert e at offset + e * nbytes
        shape, nbytes = first.shape[1:], first.nbytes // experts
        if first.shape[0] != experts:
            raise ValueError(f"{keys[0]} has {first.shape[0]} experts, the model {experts}")
        ranges[part] = PartRange(first.file, first.offset, nbytes)
    else:
        shape, nbytes = first.shape, first.nbytes
        ranges[part] = PartRange(first.file, first.offset, nbytes, tuple((t.file, t.offset) for t in tensors))
    if first.dtype in _FLOATS:
        parts.append(Part(part, quant_format(first.dtype), tuple(shape)))
        return [part]
    if first.dtype != "F8_E4M3" or qcfg is None or qcfg.get("quant_method") != "fp8":
        raise ValueError(f"{keys[0]} is {first.dtype}; the RAM tier reads float experts (BF16, F16, F32) and "
                         "block FP8 (F8_E4M3 with weight_scale_inv, quant_method 'fp8')")
    parts.append(Part(part, FP8_E4M3, tuple(shape)))
    scale_keys = [k + "_scale_inv" for k in keys]
    missing = [k for k in scale_keys if k not in stored]
    if missing:
        raise ValueError(f"{keys[0]} has no weight_scale_inv next to it ({missing[0]}); block FP8 needs one scale per tile")
    scale_name = part.replace(".weight", ".scale")
    scales = [stored[k] for k in scale_keys]
    block = qcfg["weight_block_size"]
    grid = (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))
    scale_shape = scales[0].shape[1:] if len(scales) == 1 else scales[0].shape
    if tuple(scale_shape) != grid or scales[0].dtype != "F32":
        raise ValueError(f"{scale_keys[0]}: FP8 weight {list(shape)} with {block[0]}x{block[1]} blocks needs float32 "
                         f"weight_scale_inv {list(grid)}, got {scales[0].dtype} {list(scale_shape)}")
    _add_part(scale_name, scales, scale_keys, experts, None, ranges, parts, stored)
    return [part, scale_name]
